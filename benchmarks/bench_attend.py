"""The fused attention of rollout's capture (``core.operators.attend_mean``) against the SDPA call it replaces.

For the embedded shapes ViT (B = 32, n = 65, 4 heads of 16) and a ViT-B/16 config with random weights
(B = 8, n = 197, 12 heads of 64), at each torch thread count, side by side in one process with the calls
alternating (round robin, median of --repeat rounds after one warm-up):
  forward         model(pixel_values) under no_grad with transformers' SDPA kernel (the reference, 1.00x);
  attend_mean     explain(rollout) with the capture computing each layer's attention itself (the default on CPU);
  sdpa+mean       explain(rollout) with the model's SDPA kernel running and the head mean computed after it
                  (``mean_probs``: the route on accelerators), forced by switching ``own_attention_applies`` off;
  ref             with --ref SRC: attend_mean of another tree's ``core/operators.py`` (e.g. /work/main/src).
Per layer, inside the model: the SDPA call + its contiguous output in the forward, and each variant's
fused call (attend_mean, or the SDPA call + mean_probs).

Usage: python benchmarks/bench_attend.py [--threads 1,2] [--models shapes,vitb] [--repeat 20] [--vitb-repeat 4]
       [--ref /work/main/src]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

# As bench_batch.py: OpenMP threads that wait passively (spinning ones make 2-thread runs erratic on a shared
# machine), set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import attnroll  # noqa: E402
from attnroll.capture import recompute  # noqa: E402
from attnroll.core import operators  # noqa: E402


def load_ref(src: str):
    """attend_mean of the tree at ``src`` (its core/operators.py loaded beside this one), returning this
    tree's FusedLayer so that the product after the forward accepts it."""
    path = Path(src) / "attnroll" / "core" / "operators.py"
    spec = importlib.util.spec_from_file_location("attnroll.core._bench_ref_operators", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    mod._ARENA = operators._ARENA  # the arena that explain's kept_buffers activates

    def attend(layer, v):
        out, f = mod.attend_mean(layer, v)
        return out, operators.FusedLayer(f.probs, f.heads, f.is_causal_model)

    return attend


def build(name: str):
    """(model, inputs) with SDPA attention."""
    if name == "shapes":
        from attnroll.models import load_model

        m = load_model(None, None, want="image").model.eval()
        return m, torch.randn(32, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    m = ViTForImageClassification(ViTConfig(num_labels=1000)).eval()
    m.set_attn_implementation("sdpa")
    return m, torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(0))


class Timers:
    """Wraps the capture's attend_mean and mean_probs and torch's SDPA function with timers (ms per call)."""

    def __init__(self, variants: dict):
        self.variants, self.cur, self.t = variants, None, {}
        self._am, self._mp, self._own = recompute.attend_mean, recompute.mean_probs, recompute.own_attention_applies
        self._sdpa = torch.nn.functional.scaled_dot_product_attention
        recompute.attend_mean = lambda layer, v: self._timed(self.cur, self.variants[self.cur], layer, v)
        recompute.mean_probs = lambda layer: self._timed("mean_probs", self._mp, layer)
        recompute.own_attention_applies = lambda *a: self.cur != "sdpa+mean" and self._own(*a)
        torch.nn.functional.scaled_dot_product_attention = self._sdpa_timed

    def _timed(self, key, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.t.setdefault(key, []).append(time.perf_counter() - t0)
        return out

    def _sdpa_timed(self, *a, **kw):
        key = "sdpa (forward)" if self.cur is None else "sdpa (explain)"
        return self._timed(key, lambda: self._sdpa(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2))

    def restore(self) -> None:
        recompute.attend_mean, recompute.mean_probs = self._am, self._mp
        recompute.own_attention_applies = self._own
        torch.nn.functional.scaled_dot_product_attention = self._sdpa


def measure(name: str, threads: int, repeat: int, ref: str | None) -> dict:
    """Median ms per call of the forward and each explain variant, and per layer of each fused call."""
    torch.set_num_threads(threads)
    m, x = build(name)
    variants = {"attend_mean": operators.attend_mean, "sdpa+mean": operators.attend_mean}
    if ref:
        variants["ref"] = load_ref(ref)
    timers = Timers(variants)
    calls = {"forward": None, **{k: k for k in variants}}
    wall: dict[str, list[float]] = {k: [] for k in calls}
    try:
        for rnd in range(repeat + 1):
            if rnd == 1:
                timers.t.clear()
            for key, cur in calls.items():
                timers.cur = cur
                t0 = time.perf_counter()
                if cur is None:
                    with torch.no_grad():
                        m(pixel_values=x)
                else:
                    attnroll.explain(m, {"pixel_values": x}, "rollout")
                if rnd:
                    wall[key].append(time.perf_counter() - t0)
    finally:
        timers.restore()
    med = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
    layer = {k: statistics.median(v) * 1e3 for k, v in timers.t.items()}
    return {"call": med, "layer": layer}


def report(name: str, threads: int, r: dict) -> None:
    call, layer = r["call"], r["layer"]
    fwd = call["forward"]
    parts = [f"forward {fwd:.2f} ms"] + [f"{k} {v:.2f} ms ({v / fwd:.3f}x)" for k, v in call.items() if k != "forward"]
    print(f"{name} threads={threads} per call: " + ", ".join(parts))
    sdpa = layer.get("sdpa (forward)", float("nan"))
    rows = [f"sdpa+contiguous in the forward {sdpa:.3f}"]
    rows += [f"{k} {layer[k]:.3f}" for k in ("attend_mean", "ref") if k in layer]
    if "mean_probs" in layer and "sdpa (explain)" in layer:
        rows.append(f"sdpa {layer['sdpa (explain)']:.3f} + mean_probs {layer['mean_probs']:.3f}")
    print(f"{name} threads={threads} per layer (ms): " + ", ".join(rows), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--models", default="shapes,vitb")
    ap.add_argument("--repeat", type=int, default=20, help="rounds for the shapes ViT")
    ap.add_argument("--vitb-repeat", type=int, default=4, help="rounds for ViT-B/16")
    ap.add_argument("--ref", default=None, help="another tree's src/ whose attend_mean runs beside this one's")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, attnroll from {Path(attnroll.__file__).parent}, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, load {os.getloadavg()}")
    for name in args.models.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            rep = args.repeat if name == "shapes" else args.vitb_repeat
            report(name, threads, measure(name, threads, rep, args.ref))


if __name__ == "__main__":
    main()
