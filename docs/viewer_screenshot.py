"""Re-take docs/viewer.png: `attnroll demo`'s viewer page in headless chromium, the second layer of gae
selected, the first image's per-head grid open and the pointer on a patch.

    attnroll demo --out /tmp/demo --no-text && python docs/viewer_screenshot.py /tmp/demo/viewer.html
"""

import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains


def main(page: str, out: str = str(Path(__file__).with_name("viewer.png"))) -> None:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,930",
              "--force-device-scale-factor=1"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        d.get("file://" + str(Path(page).resolve()))
        while not d.execute_script("return !!window.attnroll"):
            time.sleep(0.05)
        d.execute_script("var e=document.getElementById('ar-method');e.value='gae';e.dispatchEvent(new Event('change'));"
                         "var r=document.getElementById('ar-layer');r.value='3';r.dispatchEvent(new Event('input'));")
        d.find_element("css selector", "#ar-ex-0 details.heads summary").click()
        stack = d.find_element("css selector", "#ar-ex-0 .stack")
        ActionChains(d).move_to_element_with_offset(stack, 20, -40).perform()
        d.save_screenshot(out)
    finally:
        d.quit()


if __name__ == "__main__":
    main(*sys.argv[1:])
