"""The interactive viewer at growing prompt lengths, in headless chromium, beside the static token page.

For n tokens, 12 layers and 3 methods (synthetic rows: the viewer only reads them), side by side in one run:

  viewer    viz.view: final + per-layer rows of every method, uint16, drawn in chunks
  static    viz.tokens_html of the final rows (no script: what attnroll wrote before the viewer)
  dense     what a page embedding every attention matrix would carry: L·H·n² numbers (H = 12) at ~7 bytes
            each in JSON (computed, not built)

Printed per n: page sizes, load (navigation start -> load event) of both pages, the viewer's "ready" (its
controls work), all tokens in the page, and one method switch + one layer move measured inside the page.
Medians of --repeat loads. Needs chromium + chromedriver + selenium.

Usage: python benchmarks/bench_viewer.py [--sizes 512,1024,2048,4096,8192] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from attnroll import viz
from attnroll.explain.explanation import Explanation

SWITCH = ("var t=performance.now(),m=document.getElementById('ar-method');m.value='gae';"
          "m.dispatchEvent(new Event('change'));var r=document.getElementById('ar-layer');r.value='6';"
          "r.dispatchEvent(new Event('input'));return performance.now()-t;")


def prompt(n: int, layers: int = 12, methods=("rollout", "gae", "grad_rollout")) -> dict:
    g = torch.Generator().manual_seed(n)
    toks = [[f"w{j % 997}" for j in range(n)]]
    out = {}
    for m in methods:
        L = torch.rand(layers, 1, n, generator=g) ** 4
        L = L / L.sum(-1, keepdim=True)
        out[m] = Explanation(scores=L[-1].clone(), full_row=L[-1].clone(), layers=L, tokens=toks, method=m)
    return out


def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    o = webdriver.ChromeOptions()
    o.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        o.add_argument(a)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=o)


def load(d, path: str, n: int | None) -> dict:
    d.get("file://" + path)  # returns after the load event
    out = {"load": d.execute_script("var t=performance.getEntriesByType('navigation')[0];return t.loadEventEnd;")}
    if n is None:
        return out
    while d.execute_script("return window.attnroll ? 0 : 1"):
        time.sleep(0.01)
    out["ready"] = d.execute_script("return window.attnroll.ready")
    while d.execute_script("return document.querySelectorAll('#ar-ex-0 .t').length") < n:
        time.sleep(0.01)
    out["all"] = d.execute_script("return performance.now()")
    out["switch"] = d.execute_script(SWITCH)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512,1024,2048,4096,8192")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        print("bench_viewer: skipped, no chromium + chromedriver (apt-get install chromium chromium-driver)")
        return
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (1/5/15 min)")
    print(f"{'n':>6} {'viewer MB':>9} {'static MB':>9} {'dense MB':>9} {'static load':>11} {'viewer load':>11} "
          f"{'ready':>6} {'all tokens':>10} {'switch':>6}  (ms)")
    d = driver()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in (int(s) for s in args.sizes.split(",")):
                E = prompt(n)
                page = viz.view(E)
                static = viz.tokens_html(E["rollout"])
                vp, sp = os.path.join(tmp, f"v{n}.html"), os.path.join(tmp, f"s{n}.html")
                page.save(vp)
                with open(sp, "w", encoding="utf-8") as f:
                    f.write(static)
                runs_v = [load(d, vp, n) for _ in range(args.repeat)]
                runs_s = [load(d, sp, None) for _ in range(args.repeat)]
                med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
                dense = 12 * 12 * n * n * 7 / 1e6
                print(f"{n:>6} {page.nbytes / 1e6:>9.3f} {len(static.encode()) / 1e6:>9.3f} {dense:>9.0f} "
                      f"{med(runs_s, 'load'):>11.0f} {med(runs_v, 'load'):>11.0f} {med(runs_v, 'ready'):>6.0f} "
                      f"{med(runs_v, 'all'):>10.0f} {med(runs_v, 'switch'):>6.1f}")
    finally:
        d.quit()


if __name__ == "__main__":
    main()
