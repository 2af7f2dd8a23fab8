import pytest


@pytest.fixture(scope="module")
def d():
    """One headless chromium session per browser-test module; skips, saying why, where no browser is installed."""
    from . import browser

    drv = browser.driver()
    yield drv
    drv.quit()
