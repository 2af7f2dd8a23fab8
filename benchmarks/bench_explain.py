"""explain() cost per method, relative to one plain SDPA forward pass of the same model and batch.

Model: ViT-B/16 (transformers ViTForImageClassification, default config: 12 layers, 12 heads, hidden 768,
224x224, 197 tokens, 1000 classes) with random weights. For batch sizes 1 and 8 it times:
  forward   model(pixel_values) under torch.no_grad() with attn_implementation="sdpa" (the reference, 1.00x);
  each attention method through attnroll.explain (capture switches the model to eager attention for the pass);
  Captum's integrated gradients at its default 50 steps, saliency and input x gradient, side by side.
Each entry is the median of --repeat runs after one warm-up (integrated gradients: one run, no warm-up).

Goal: rollout <= 1.10x the plain forward.
Goals (value-aware methods, batch 8): norm, globenc, alti <= 3x; decompx <= 10x. They are not in the
default list (value_zeroing re-runs every block n times): ``--methods value_aware`` runs VALUE_AWARE (add
``--batches 8 --repeat 1`` for the goal's setting); ``name:key=value`` passes an option. ``decompx`` is its
default ``bias="separate"`` (one backward pass); ``decompx:bias=absdot``, the paper's AbsDot rule, carries
n + 1 shares per row (~150 forwards' matrix products at n = 197; ~8 minutes at batch 8 on 2 cores): time it
alone with ``--methods decompx:bias=absdot --batches 8 --slow-max-batch 8 --repeat 1 --paired``; ``--layers``
builds a shallower ViT-B (same width) for quick per-layer probes.

Usage: python benchmarks/bench_explain.py [--batches 1,8] [--repeat 3] [--ig-max-batch 8] [--threads N] [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import attnroll

ATTENTION = ["raw", "rollout", "per_head_rollout", "grad_rollout", "gae", "attn_gradcam"]
CAPTUM = ["saliency", "input_x_gradient", "integrated_gradients"]
VALUE_AWARE = ["rollout", "measured_rollout", "norm", "norm_rollout", "globenc", "alti", "alti_logit",
               "decompx", "decompx:bias=absdot", "value_zeroing"]
#: O(n)-forward entries, timed only up to --slow-max-batch.
SLOW = {"decompx:bias=absdot", "value_zeroing"}


def _value(v: str):
    """An option value as the CLI's ``-o`` reads it: JSON when it parses (numbers, true/false), else the str."""
    try:
        return json.loads(v)
    except ValueError:
        return v


def timed(fn, repeat: int, warm: bool = True) -> float:
    if warm:
        fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ig-max-batch", type=int, default=8, help="skip integrated gradients above this batch size")
    ap.add_argument("--ig-steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--paired", action="store_true",
                    help="time a forward right before each method run and report the ratio of the pair (median over "
                         "--repeat pairs): robust to load that drifts while the benchmark runs")
    ap.add_argument("--slow-max-batch", type=int, default=1, help=f"skip {sorted(SLOW)} above this batch size")
    ap.add_argument("--methods", default=",".join(ATTENTION + CAPTUM))
    ap.add_argument("--layers", type=int, default=12, help="ViT-B blocks (12 = ViT-B/16; fewer for quick probes)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(num_labels=1000, num_hidden_layers=args.layers)).eval()
    model.set_attn_implementation("sdpa")
    wanted = [w for m in args.methods.split(",") for w in (VALUE_AWARE if m == "value_aware" else [m])]
    try:
        import captum  # noqa: F401
    except ImportError:
        wanted = [m for m in wanted if m not in CAPTUM]
        print("captum not installed: Captum baselines skipped")
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, layers {args.layers}")
    print(f"{'batch':>5} {'method':<22} {'seconds':>9} {'x forward':>10}")
    for B in [int(b) for b in args.batches.split(",")]:
        x = {"pixel_values": torch.randn(B, 3, 224, 224, generator=torch.Generator().manual_seed(B))}

        def fwd():
            with torch.no_grad():
                model(**x)

        base = timed(fwd, args.repeat)
        print(f"{B:>5} {'forward (sdpa)':<22} {base:>9.3f} {1.0:>9.2f}x", flush=True)
        for entry in wanted:
            m, _, opt = entry.partition(":")
            opts = {k: _value(v) for k, v in (kv.split("=", 1) for kv in opt.split(";"))} if opt else {}
            if m == "integrated_gradients":
                opts = {"n_steps": args.ig_steps, "internal_batch_size": 50}
            slow = entry in SLOW
            if (m == "integrated_gradients" and B > args.ig_max_batch) or (slow and B > args.slow_max_batch):
                print(f"{B:>5} {entry:<22} {'skipped':>9}")
                continue
            ig = m == "integrated_gradients"
            run = lambda: attnroll.explain(model, x, m, target=7, **opts)  # noqa: E731
            label = f"{m} ({args.ig_steps} steps)" if ig else entry
            if args.paired:
                pairs = [(timed(fwd, 1, warm=False), timed(run, 1, warm=False)) for _ in range(args.repeat)]
                f, t = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
                ratio = statistics.median(p[1] / p[0] for p in pairs)
                print(f"{B:>5} {label:<22} {t:>9.3f} {ratio:>9.2f}x  (paired forward {f:.3f} s)", flush=True)
                continue
            t = timed(run, 1 if ig or slow else args.repeat, warm=not (ig or slow))
            print(f"{B:>5} {label:<22} {t:>9.3f} {t / base:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
