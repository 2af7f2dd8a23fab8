"""Long prompts: the matrix-free route of ``explain`` against a plain SDPA forward, measured side by side.

Models (random weights): an 8-layer, 256-wide, 8-head Llama config (vocab 32,000) and a
GPT-2-small-sized config (12 layers, 768 wide, 12 heads, vocab 50,257), batch 1, n = 1k ... 32k; ViT-B/16
(224x224, n = 197) at batch 1 and 8.

Per cell, in the same process and interleaved round by round: a plain SDPA forward (no grad); ``explain``
with ``rollout`` (auto route = recompute); a plain SDPA forward + backward of the same target logit (all
parameters requiring grad, as training would); ``explain`` with ``gae``; and the dense route
(``attention="dense"``: eager n×n capture) where it fits. Time: CPU time of the calling thread (torch runs
single-threaded ops, autograd's CPU backward included, on it), which other processes' load on the shared
cores barely moves, the median over rounds (one round at large n; 15 / 5 for ViT-B at batch 1 / 8; the
ratios also as the median over rounds of each round's own ratio, "pair", which a load that drifts between
rounds moves less); wall clock is recorded too. Peak memory: the largest resident set sampled every millisecond during the call, above the resident set
just before it; glibc is told to return large blocks to the system (MALLOC_MMAP_THRESHOLD_) so that one
call's freed memory does not hide the next one's. Each (model, n) runs in its own process with one thread.

``--device cuda`` runs the cells on the GPU (the plan adds Llama n = 65,536 and 131,072): time is then wall
clock between ``torch.cuda.synchronize()`` calls and peak memory ``torch.cuda.max_memory_allocated`` above the
allocation at entry. (Written for the issue's GPU run; not yet run on a GPU: none was lent to this project's
sessions so far.)

``--ref SRC`` runs every cell a second time, right after, with another checkout's package (``SRC``: its
``src`` folder, e.g. a worktree of main) on ``PYTHONPATH``: a before/after comparison in one run.

Usage: python benchmarks/bench_long_context.py [--quick] [--json out.json] [--only llama:32768,...] [--skip ...]
       [--ref OTHER/src] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch

#: Where the cells run: set by ``--device`` for the cell processes.
DEVICE = os.environ.get("ATTNROLL_BENCH_DEVICE", "cpu")

MODES = ("sdpa_forward", "rollout", "sdpa_forward_backward", "gae", "dense_rollout", "dense_gae")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class CudaPeak:
    """Largest CUDA allocation while the block runs, above the allocation at entry (bytes)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.extra = torch.cuda.max_memory_allocated() - self.base


def clock() -> float:
    """The time the benchmark reads: the calling thread's CPU time on CPU, wall clock after a sync on CUDA."""
    if DEVICE == "cpu":
        return time.thread_time()
    torch.cuda.synchronize()
    return time.perf_counter()


class PeakSampler:
    """Largest resident set seen while the block runs, above the level at entry (bytes)."""

    def __enter__(self):
        self.base = self.peak = rss()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, rss())
        self.extra = self.peak - self.base


def build(name: str, n: int):
    """(model, inputs) of one cell, on ``DEVICE``."""
    model, x = _build_cpu(name, n)
    return model.to(DEVICE), {k: v.to(DEVICE) for k, v in x.items()}


def _build_cpu(name: str, n: int):
    import transformers as T

    torch.manual_seed(0)
    if name == "llama":
        cfg = T.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                            max_position_embeddings=max(n, 128), vocab_size=32000)
        return T.LlamaForCausalLM(cfg).eval(), {"input_ids": torch.randint(0, 32000, (1, n))}
    if name == "gpt2":
        cfg = T.GPT2Config(n_positions=max(n, 128))  # 12 layers, 768 wide, 12 heads: GPT-2 small
        return T.GPT2LMHeadModel(cfg).eval(), {"input_ids": torch.randint(0, 50257, (1, n))}
    batch = int(name.split("_b")[1])
    m = T.ViTForImageClassification(T.ViTConfig(num_labels=1000)).eval()  # ViT-B/16, 224x224
    return m, {"pixel_values": torch.randn(batch, 3, 224, 224)}


def run_mode(model, x, mode: str) -> None:
    import attnroll

    if mode == "sdpa_forward":
        with torch.no_grad():
            model(**x)
    elif mode == "sdpa_forward_backward":
        logits = model(**x).logits
        y = logits[:, -1].max(dim=-1).values if logits.ndim == 3 else logits.max(dim=-1).values
        y.sum().backward()
        model.zero_grad(set_to_none=True)
    elif mode in ("rollout", "gae"):
        attnroll.explain(model, x, mode)
    else:
        attnroll.explain(model, x, mode.split("_")[1], attention="dense")


def cell(name: str, n: int, modes: list[str], rounds: int) -> dict:
    torch.set_num_threads(1)
    model, x = build(name, n)
    small = build(name, 64)[1] if name in ("llama", "gpt2") else x
    for mode in modes:  # warm-up: kernels, first-call costs
        run_mode(model, small, mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, int] = {m: 0 for m in modes}
    for _ in range(rounds):
        for mode in modes:
            with (PeakSampler() if DEVICE == "cpu" else CudaPeak()) as s:
                t, w = clock(), time.perf_counter()
                run_mode(model, x, mode)
                times[mode].append(clock() - t)
                walls[mode].append(time.perf_counter() - w)
            peaks[mode] = max(peaks[mode], s.extra)
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    wall = {m: sorted(v)[len(v) // 2] for m, v in walls.items()}
    pair = {m: sorted(a / b for a, b in zip(times[m], times[ref]))[rounds // 2]
            for m, ref in REFERENCE.items() if m in times and ref in times}
    return {"model": name, "n": n, "time_s": med, "wall_s": wall, "pair_ratio": pair, "rounds": rounds,
            "peak_mib": {m: p / 2**20 for m, p in peaks.items()}}


#: The plain pass each explain mode is compared with.
REFERENCE = {"rollout": "sdpa_forward", "gae": "sdpa_forward_backward", "dense_rollout": "sdpa_forward",
             "dense_gae": "sdpa_forward_backward"}


def plan(quick: bool, device: str = "cpu") -> list[tuple[str, int, list[str], int]]:
    base = ["sdpa_forward", "rollout"]
    grad = ["sdpa_forward_backward", "gae"]
    dense = ["dense_rollout", "dense_gae"]
    if quick:
        return [("llama", 1024, base + grad + dense, 1), ("vit_b1", 197, base + dense[:1], 1)]
    out = [("vit_b1", 197, base + dense[:1], 15), ("vit_b8", 197, base + dense[:1], 5)]
    out += [("llama", 1024, base + grad + dense, 2), ("llama", 2048, base + grad + dense, 1)]
    out += [("llama", n, base + grad, 1) for n in (4096, 8192)]
    out += [("gpt2", 1024, base + grad + dense[:1], 1), ("gpt2", 2048, base + grad, 1), ("gpt2", 4096, base, 1)]
    out += [("gpt2", 8192, base, 1), ("llama", 16384, base + grad, 1), ("llama", 32768, base, 1)]
    if device != "cpu":  # the GPU run goes to n = 131,072
        out += [("llama", 65536, base, 1), ("llama", 131072, base, 1)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated cells model:n to run (default: all)")
    ap.add_argument("--skip", default=None, help="comma-separated cells model:n to leave out")
    ap.add_argument("--ref", default=None, help="another checkout's src folder: each cell also runs with it")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the cells run (default cpu)")
    ap.add_argument("--cell", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        name, n, modes, rounds = args.cell
        print(json.dumps(cell(name, int(n), modes.split(","), int(rounds))))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576",
           "ATTNROLL_BENCH_DEVICE": args.device}
    results = []
    print("load:", os.getloadavg(), flush=True)
    only = set(args.only.split(",")) if args.only else None
    skip = set(args.skip.split(",")) if args.skip else set()
    for name, n, modes, rounds in plan(args.quick, args.device):
        if (only is not None and f"{name}:{n}" not in only) or f"{name}:{n}" in skip:
            continue
        for label, src in [("", None)] + ([("ref", args.ref)] if args.ref else []):
            r = run_cell(name, n, modes, rounds, env, src)
            if r is None:
                continue
            r["code"] = label or "this"
            results.append(r)
            print(("ref     " if label else "") + report(r), flush=True)
        if args.json:  # after every cell: a later cell that runs out of time or memory loses only itself
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


def run_cell(name: str, n: int, modes: list[str], rounds: int, env: dict, src: str | None) -> dict | None:
    """One cell in its own process (with ``src`` first on PYTHONPATH when given); None when it failed."""
    if src is not None:
        paths = [os.path.abspath(src)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env = {**env, "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [sys.executable, __file__, "--cell", name, str(n), ",".join(modes), str(rounds)]
    before = os.getloadavg()[0]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(f"{name} n={n}: failed\n{p.stderr[-2000:]}", flush=True)
        return None
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["load_before"], r["load"] = before, os.getloadavg()[0]
    return r


def report(r: dict) -> str:
    t, m = r["time_s"], r["peak_mib"]
    parts = [f"{r['model']:7s} n={r['n']:6d} load {r.get('load_before', r['load']):.1f}-{r['load']:.1f}"]
    pair = r.get("pair_ratio", {})
    for mode, ref in REFERENCE.items():
        if mode in t:
            paired = f", pair {pair[mode]:.3f}x" if mode in pair and r.get("rounds", 1) > 1 else ""
            parts.append(f"{mode} {t[mode]:.3f}s ({t[mode] / t[ref]:.3f}x time{paired}, {m[mode]:.0f}/{m[ref]:.0f} MiB "
                         f"= {m[mode] / max(m[ref], 1e-9):.2f}x)")
    parts.append(f"sdpa fwd {t['sdpa_forward']:.2f}s")
    if "sdpa_forward_backward" in t:
        parts.append(f"fwd+bwd {t['sdpa_forward_backward']:.2f}s")
    return " | ".join(parts)


if __name__ == "__main__":
    main()
