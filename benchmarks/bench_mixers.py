"""Rows-only rollout through a Mamba-2 stack against its forward pass, side by side in one run.

A tiny-width, deep Mamba-2 language model with random weights (hidden 64, 8 layers, 4 heads of 32, state 16;
transformers' torch path), one prompt of n tokens:
  forward     model(input_ids) under no_grad (the reference, 1.00x);
  gates       the same forward with attnroll's hooks reading every mixer's SSD gates (capture/mixers.py
              ``mamba2_gates``: in_proj, convolution, softplus; O(n·d) per layer kept);
  rows        rollout of the last token's row down the stack from those gates, one block of 256 output tokens at a
              time (core/mixers.py ``ssd_rows``: the per-head SSD matrices fused by the mean of |·|, rows
              normalised, residual blend 0.5; each head's columns before the block one rank-N product, added into
              Σ_h |M_h| head by head; the causal convolution is stated apart, not folded), never holding an n×n
              matrix: O(n²·h) entries per layer, exact;
  signed      the same sweep with the signed head mean instead (``ssd_signed_rows``: a reverse scan, O(n·N·h)
              per layer; heads' signed entries may cancel, see docs/methods.md).
Reported: median seconds over --repeat rounds (calls alternating), ratios to the forward, and the peak memory
the rows step allocates above its inputs (tracemalloc does not see torch; we state the largest blocks it holds:
Σ_h |M_h| and one head's block, 2·block·n floats). The machine load (/proc/loadavg) is printed with the figures.

Usage: python benchmarks/bench_mixers.py [--n 8192] [--layers 8] [--repeat 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnroll.capture.mixers import mamba2_gates
from attnroll.core import mixers


def build(layers: int):
    import transformers as T

    cfg = T.Mamba2Config(vocab_size=99, hidden_size=64, num_hidden_layers=layers, num_heads=4, head_dim=32,
                         state_size=16, n_groups=1, expand=2, chunk_size=256)
    torch.manual_seed(0)
    return T.Mamba2ForCausalLM(cfg).eval()


def gates_forward(model, ids):
    """The forward with hooks reading each mixer's gates: (logits, [SSDGates per layer])."""
    kept, hooks = [], []
    for block in model.backbone.layers:
        hooks.append(block.mixer.register_forward_hook(
            lambda m, a, k, o: kept.append(mamba2_gates(m, a[0] if a else k["hidden_states"])), with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return out, kept


def rows(kept, n: int, block: int, signed: bool = False) -> torch.Tensor:
    """The last token's rollout row, from the top layer down (|·| fusion, or the signed head mean)."""
    r = torch.zeros(1, 1, n)
    r[0, 0, n - 1] = 1.0
    with torch.no_grad():
        for g in reversed(kept):
            if signed:
                r = mixers.ssd_signed_rows(r, g.C, g.B, g.dt, g.A, g.D, a=0.5, c=0.5)
            else:
                r = mixers.ssd_rows(r, g.C, g.B, g.dt, g.A, g.D, a=0.5, c=0.5, rows=block)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=mixers.BLOCK)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.layers)
    ids = torch.randint(3, 99, (1, args.n), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"forward": [], "gates": [], "rows": [], "signed": []}
    _, kept = gates_forward(model, ids)  # warm-up
    for _ in range(args.repeat):
        t = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids)
        times["forward"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _, kept = gates_forward(model, ids)
        times["gates"].append(time.perf_counter() - t)
        t = time.perf_counter()
        r = rows(kept, args.n, args.block)
        times["rows"].append(time.perf_counter() - t)
        t = time.perf_counter()
        rs = rows(kept, args.n, args.block, signed=True)
        times["signed"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    heads = kept[0].C.shape[2]
    block_mb = 2 * args.block * args.n * 4 / 2**20
    gates_mb = sum(sum(t.numel() * t.element_size() for t in (g.x, g.C, g.B, g.dt, g.z, g.u)) for g in kept) / 2**20
    print(f"Mamba-2, hidden 64, {args.layers} layers, {heads} heads, n = {args.n}, {args.threads} threads, "
          f"median of {args.repeat}; load {open('/proc/loadavg').read().split()[:3]}")
    for k in ("forward", "gates", "rows", "signed"):
        print(f"  {k:8s} {med[k]:8.3f} s  {med[k] / med['forward']:6.2f}x")
    print(f"  rollout (gates + rows) / forward: {(med['gates'] + med['rows']) / med['forward']:.2f}x; signed "
          f"(gates + signed) / forward: {(med['gates'] + med['signed']) / med['forward']:.2f}x")
    print(f"  kept gates {gates_mb:.1f} MiB (linear in n); largest rows blocks {block_mb:.1f} MiB (2 x block x n)")
    print(f"  row sums to {float(r.sum()):.6f} (|·|), {float(rs.sum()):.6f} (signed; min entry {float(rs.min()):.3g})")


if __name__ == "__main__":
    main()
