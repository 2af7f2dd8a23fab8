"""Rows-only rollout through a Mamba-2 stack against its forward pass, side by side in one run.

A tiny-width, deep Mamba-2 language model with random weights (hidden 64, 8 layers, 4 heads of 32, state 16;
transformers' torch path), one prompt of n tokens:
  forward     model(input_ids) under no_grad (the reference, 1.00x);
  gates       the same forward with attnroll's hooks keeping every mixer's SSD gates, read off the mixer's own
              in_proj output (capture/mixers.py ``InProjTap`` + ``mamba2_gates``: the causal convolution and
              softplus on it; O(n·d) per layer kept);
  rows        rollout of the last token's row down the stack from those gates, one block of 256 output tokens at a
              time (core/mixers.py ``ssd_rows``: the per-head SSD matrices fused by the mean of |·|, rows
              normalised, residual blend 0.5; each head's columns before the block one rank-N product, added into
              Σ_h |M_h| head by head; the causal convolution is stated apart, not folded), never holding an n×n
              matrix: O(n²·h) entries per layer, exact;
  signed      the same sweep with the signed head mean instead (``ssd_signed_rows``: a reverse scan, O(n·N·h)
              per layer; heads' signed entries may cancel, see docs/methods.md);
  explain     ``attnroll.explain(model, ids, method="rollout")`` end to end, what a user calls: the forward with
              the gates kept, then the matrix-free sweep through every mixer layer (``core.mixers.SSDRows``, the
              convolution composed apart: Σ_c |S_h(c)|·|diag(σ(u_c))·T_c|, O(n²·h) per layer);
  keep past   (with --keep-past) explain with no earlier column left out (``core.mixers.FORGET_BELOW = 0``: the
              sweep otherwise skips, per head and block, the columns whose decay is below eps², the scan's
              forgotten past; how much that saves depends on the model's decays);
  folded      (with --folded) the same call with the convolution folded per channel before |·|
              (``capture.mixers.CONVOLUTION = "folded"``: O(n²·channels·K) per layer), its row beside explain's.
With --before SRC (another checkout's src/, e.g. the main branch's), that code's gates hook (recomputing in_proj
from the mixer's input) and ``ssd_rows`` are timed in the same rounds (gates0, rows0), their row checked equal.
Reported: median seconds over --repeat rounds (calls alternating), wall clock and this process's CPU time (user +
system: what other processes' load does not inflate), ratios to the forward, and the peak memory the rows step
allocates above its inputs (tracemalloc does not see torch; we state the largest blocks it holds: Σ_h |M_h| and
one head's block, 2·block·n floats). The machine load (/proc/loadavg) is printed with the figures.

Usage: python benchmarks/bench_mixers.py [--n 8192] [--layers 8] [--repeat 3] [--threads 2] [--before SRC] [--folded]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

import attnroll
from attnroll.capture import mixers as capture_mixers
from attnroll.capture.mixers import InProjTap, mamba2_gates
from attnroll.core import mixers


def build(layers: int):
    import transformers as T

    cfg = T.Mamba2Config(vocab_size=99, hidden_size=64, num_hidden_layers=layers, num_heads=4, head_dim=32,
                         state_size=16, n_groups=1, expand=2, chunk_size=256)
    torch.manual_seed(0)
    return T.Mamba2ForCausalLM(cfg).eval()


def gates_forward(model, ids, gates=None):
    """The forward with hooks keeping each mixer's gates: (logits, [(C, B, dt, A, D) per layer]); read off each mixer's
    in_proj output (InProjTap), or, with ``gates`` (another checkout's ``mamba2_gates``), recomputed from the
    mixer's input by it."""
    kept, hooks, taps = [], [], []
    for block in model.backbone.layers:
        tap = None if gates is not None else InProjTap(block.mixer)
        taps += [tap] if tap is not None else []

        def keep(m, a, k, o, tap=tap):
            hidden = a[0] if a else k["hidden_states"]
            g = gates(m, hidden) if tap is None else mamba2_gates(m, hidden, None, tap.take(hidden, None))
            kept.append((g.C, g.B, g.dt, g.A, g.D))  # what the sweep reads (not x, z, u: their buffers go)

        hooks.append(block.mixer.register_forward_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(input_ids=ids).logits
    finally:
        for h in [*hooks, *taps]:
            h.remove()
    return out, kept


def rows(kept, n: int, block: int, signed: bool = False, sweep=None) -> torch.Tensor:
    """The last token's rollout row, from the top layer down (|·| fusion, or the signed head mean); ``sweep``:
    another checkout's ``ssd_rows``."""
    sweep = mixers.ssd_rows if sweep is None else sweep
    r = torch.zeros(1, 1, n)
    r[0, 0, n - 1] = 1.0
    with torch.no_grad():
        for C, B, dt, A, D in reversed(kept):
            if signed:
                r = mixers.ssd_signed_rows(r, C, B, dt, A, D, a=0.5, c=0.5)
            else:
                r = sweep(r, C, B, dt, A, D, a=0.5, c=0.5, rows=block)
    return r


def load_before(src: str):
    """The attnroll package of another checkout's ``src`` directory, imported as ``attnroll_before``."""
    root = Path(src) / "attnroll"
    spec = importlib.util.spec_from_file_location("attnroll_before", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before {src}: no attnroll package there (expected {root}/__init__.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules["attnroll_before"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("attnroll_before.capture.mixers")


def timed(times: dict, key: str, f):
    t, c = time.perf_counter(), time.process_time()
    out = f()
    times.setdefault(key, []).append(time.perf_counter() - t)
    times.setdefault(key + " cpu", []).append(time.process_time() - c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=mixers.BLOCK)
    ap.add_argument("--before", default=None, help="another checkout's src/ to time beside this one")
    ap.add_argument("--folded", action="store_true", help="also time explain with the convolution folded")
    ap.add_argument("--keep-past", action="store_true", help="also time explain with every earlier column taken")
    ap.add_argument("--no-operators", action="store_true", help="time the forward and explain alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    before = load_before(args.before) if args.before else None
    model = build(args.layers)
    ids = torch.randint(3, 99, (1, args.n), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {}
    _, kept = gates_forward(model, ids)  # warm-up
    load0 = open("/proc/loadavg").read().split()[:3]
    got: dict[str, object] = {}

    def after():
        _, got["kept"] = timed(times, "gates", lambda: gates_forward(model, ids))
        got["r"] = timed(times, "rows", lambda: rows(got["kept"], args.n, args.block))
        got["rs"] = timed(times, "signed", lambda: rows(got["kept"], args.n, args.block, signed=True))

    def before_():
        _, kept0 = timed(times, "gates0", lambda: gates_forward(model, ids, before.mamba2_gates))
        got["r0"] = timed(times, "rows0", lambda: rows(kept0, args.n, args.block, sweep=before.ops.ssd_rows))

    def forward():
        with torch.no_grad():
            return model(input_ids=ids)

    def explain(convolution: str, forget=None):
        capture_mixers.CONVOLUTION, mixers.FORGET_BELOW = convolution, forget
        try:
            key = "keep past" if forget is not None else "explain" if convolution == "apart" else "folded"
            got[key] = timed(times, key, lambda: attnroll.explain(model, {"input_ids": ids}, method="rollout",
                                                                  sinks="keep").full_row)
        finally:
            capture_mixers.CONVOLUTION, mixers.FORGET_BELOW = "apart", None

    units = [lambda: timed(times, "forward", forward), lambda: explain("apart")]
    units += [after] if not args.no_operators else []
    units += [before_] if before is not None else []
    units += [lambda: explain("folded")] if args.folded else []
    units += [lambda: explain("apart", 0.0)] if args.keep_past else []
    for i in range(args.repeat):  # each unit takes each place in the round in turn (what runs first pays more)
        for unit in units[i % len(units):] + units[: i % len(units)]:
            unit()
    if args.no_operators:
        explain_report(args, times, got, load0)
        return
    hooks_alone(model, ids, times, before)
    report(args, times, got["kept"], got["r"], got["rs"], got.get("r0"), load0)
    explain_report(args, times, got, None)


def explain_report(args, times, got, load0) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    if load0 is not None:
        print(f"Mamba-2, hidden 64, {args.layers} layers, n = {args.n}, {args.threads} threads, median of "
              f"{args.repeat}; load {load0} -> {open('/proc/loadavg').read().split()[:3]}")
    for k in ("explain", "keep past", "folded"):
        if k in med:
            print(f"  {k:9s} (attnroll.explain rollout) wall {med[k]:8.3f} s {med[k] / med['forward']:6.2f}x   cpu "
                  f"{med[k + ' cpu']:8.3f} s {med[k + ' cpu'] / med['forward cpu']:6.2f}x")
    for k in ("keep past", "folded"):
        if k in got:
            d = (got["explain"] - got[k]).abs().max()
            print(f"  explain's row vs {k}'s: max |difference| {float(d):.3g} (entries up to "
                  f"{float(got['explain'].abs().max()):.3g})")


def hooks_alone(model, ids, times: dict, before) -> None:
    """The gate-keeping work alone, on the first mixer's kept input and in_proj output, per layer: read off the
    projection ("hook") and, with ``before``, recomputed from the input by that code ("hook0")."""
    mixer, seen = model.backbone.layers[0].mixer, {}
    tap = InProjTap(mixer)
    handle = mixer.register_forward_hook(lambda m, a, k, o: seen.update(h=a[0], p=tap.take(a[0], None)),
                                         with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)
        handle.remove()
        tap.remove()
        for _ in range(5):
            timed(times, "hook", lambda: mamba2_gates(mixer, seen["h"], None, seen["p"]))
            if before is not None:
                timed(times, "hook0", lambda: before.mamba2_gates(mixer, seen["h"]))


def report(args, times, kept, r, rs, r0, load0) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    heads = kept[0][0].shape[2]
    block_mb = 2 * args.block * args.n * 4 / 2**20
    gates_mb = sum(t.untyped_storage().nbytes() for g in kept for t in g[:3]) / 2**20  # the buffers kept alive
    print(f"Mamba-2, hidden 64, {args.layers} layers, {heads} heads, n = {args.n}, {args.threads} threads, "
          f"median of {args.repeat}; load {load0} -> {open('/proc/loadavg').read().split()[:3]}")
    names = [k for k in ("forward", "gates", "rows", "signed", "gates0", "rows0") if k in med]
    per_layer = {k: med[k] * args.layers for k in ("hook", "hook0", "hook cpu", "hook0 cpu") if k in med}
    for k in names:
        print(f"  {k:8s} wall {med[k]:8.3f} s {med[k] / med['forward']:6.2f}x   cpu {med[k + ' cpu']:8.3f} s "
              f"{med[k + ' cpu'] / med['forward cpu']:6.2f}x")
    for label, g, w in (("rollout (gates + rows)", "gates", "rows"), ("signed (gates + signed)", "gates", "signed"),
                        ("before: rollout (gates0 + rows0)", "gates0", "rows0")):
        if g in med and w in med:
            print(f"  {label} / forward: wall {(med[g] + med[w]) / med['forward']:.2f}x, cpu "
                  f"{(med[g + ' cpu'] + med[w + ' cpu']) / med['forward cpu']:.2f}x")
    if per_layer:
        print("  gate-keeping work alone (one layer's, x layers), cpu: " + ", ".join(
            f"{k} {per_layer[k + ' cpu']:.3f} s {per_layer[k + ' cpu'] / med['forward cpu']:.2f}x"
            for k in ("hook", "hook0") if k + " cpu" in per_layer))
    print(f"  kept gates {gates_mb:.1f} MiB (linear in n); largest rows blocks {block_mb:.1f} MiB (2 x block x n)")
    print(f"  row sums to {float(r.sum()):.6f} (|·|), {float(rs.sum()):.6f} (signed; min entry {float(rs.min()):.3g})")
    if r0 is not None:
        print(f"  before's row: max |difference| {float((r - r0).abs().max()):.3g} (entries up to "
              f"{float(r.abs().max()):.3g})")


if __name__ == "__main__":
    main()
