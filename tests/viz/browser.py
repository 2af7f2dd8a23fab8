"""A real headless browser for the viewer tests: Debian's chromium + chromedriver driven by selenium.

``driver()`` starts one (the tests share one per module); where no browser is installed it skips with the
reason. Helpers read what the page drew (canvas pixels, the readout) and what it asked for (console,
network), so that tests compare the page against the Explanation it was made from."""

from __future__ import annotations

import base64
import json
import os
import shutil
import time

import numpy as np
import pytest

CHROMIUM = next((p for p in (os.environ.get("ATTNROLL_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)
CHROMEDRIVER = os.environ.get("ATTNROLL_CHROMEDRIVER") or shutil.which("chromedriver")


def driver():
    """A headless chromium session (1280x1000 window) with console and network logs, or a skip."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service

    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no browser: the viewer tests need chromium and chromedriver "
                    "(apt-get install chromium chromium-driver; .ci/run installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,1000", "--force-device-scale-factor=1", "--hide-scrollbars"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def open_page(d, page, path, timeout: float = 10.0) -> float:
    """Save ``page`` (a ViewerPage or HTML str) at ``path``, open it from file://, wait until the viewer says
    it is ready; returns the page's own ready time in ms after navigation start. Clears the logs first."""
    html = page if isinstance(page, str) else page.html
    path.write_text(html, encoding="utf-8")
    d.get_log("browser"), d.get_log("performance")
    d.get("file://" + str(path))
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        ready = d.execute_script("return window.attnroll ? window.attnroll.ready : null")
        if ready is not None:
            return float(ready)
        time.sleep(0.02)
    raise AssertionError(f"the viewer did not get ready within {timeout} s; console: {d.get_log('browser')}")


def console_messages(d) -> list[str]:
    """Everything the page wrote to the console since the last call (errors, CSP violations, warnings)."""
    return [f"{m['level']}: {m['message']}" for m in d.get_log("browser")]


def requested_urls(d) -> list[str]:
    """Every URL the browser asked for since the last call (from the DevTools network log)."""
    urls = []
    for entry in d.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def canvas_rgba(d, element) -> np.ndarray:
    """A canvas' own pixels (its width x height, not the displayed size): (h, w, 4) uint8."""
    b64 = d.execute_script(
        "var c=arguments[0],x=c.getContext('2d').getImageData(0,0,c.width,c.height).data,s='';"
        "for(var i=0;i<x.length;i+=8192)s+=String.fromCharCode.apply(null,x.subarray(i,i+8192));"
        "return [c.width,c.height,btoa(s)];", element)
    w, h, data = b64
    return np.frombuffer(base64.b64decode(data), np.uint8).reshape(h, w, 4)


def set_control(d, element_id: str, value) -> None:
    """Set a select / range / checkbox the way a user's change arrives (value, then input and change events)."""
    d.execute_script(
        "var e=document.getElementById(arguments[0]);"
        "if(e.type==='checkbox'){e.checked=arguments[1];}else{e.value=arguments[1];}"
        "e.dispatchEvent(new Event('input',{bubbles:true}));e.dispatchEvent(new Event('change',{bubbles:true}));",
        element_id, value)


def hover(d, element, x: float, y: float) -> None:
    """Move the pointer to (x, y) pixels from the element's top-left corner."""
    from selenium.webdriver.common.action_chains import ActionChains

    # Centred in the window first: selenium offsets from the centre of the element's *visible* part.
    r = d.execute_script("arguments[0].scrollIntoView({block:'center',inline:'center'});"
                         "var b=arguments[0].getBoundingClientRect();return [b.width,b.height];", element)
    ActionChains(d, duration=0).move_to_element_with_offset(element, int(round(x - r[0] / 2)), int(round(y - r[1] / 2))).perform()


def readout(d, card) -> tuple[str, float | None]:
    """The card's readout: (where, value shown) after a hover."""
    where = card.find_element("css selector", ".readout .where").text
    v = card.find_element("css selector", ".readout .v").text
    return where, (float(v) if v else None)


def grey_expected(values: np.ndarray, how: str = "max") -> np.ndarray:
    """The grey-colormap pixel a value should get under scale "max": round(255 · v / max(v)), clipped at 0."""
    v = np.asarray(values, np.float64)
    hi = v.max()
    t = np.clip(v / hi, 0, 1) if hi > 0 else np.zeros_like(v)
    return np.rint(t * 255)


def wait_for(d, css: str, at_least: int = 1, timeout: float = 5.0) -> list:
    """The elements matching ``css`` once there are ``at_least`` of them (a details' toggle event, which
    builds what it opens, arrives after the click returns)."""
    t_end = time.monotonic() + timeout
    while True:
        found = d.find_elements("css selector", css)
        if len(found) >= at_least or time.monotonic() > t_end:
            return found
        time.sleep(0.02)


def value_tol(row, j: int) -> float:
    """How far the readout may be from ``row[j]``: the page's uint16 code of that row (its documented bound,
    :func:`attnroll.viz.viewer.quant.error_bound`) plus the 4 significant digits it prints."""
    from attnroll.viz.viewer.quant import encode_rows, error_bound

    r = np.asarray(row, dtype=np.float64).reshape(-1)
    bound = error_bound(encode_rows(r), r[None])[0, j]
    return float(bound + 5e-4 * (abs(r[j]) + bound) + 1e-12)
