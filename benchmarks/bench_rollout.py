"""Rollout speed and memory, measured side by side in one run.

For each size it times, on the same random attention (L=12 layers, H=12 heads):
  (a)  the naive per-layer loop common in notebooks: fuse heads, discard via flatten + topk, add I,
       renormalise rows, matmul — with discard_ratio 0.9 (vit-explain's default) and with none (a0);
  (b)  attnroll.rollout, full matrix;
  (c)  attnroll.rollout(rows=[0]), the CLS row only (cv: the same with validate=False, no value checks;
       c9: with discard_ratio 0.9);
  (d)  a plain read of the input: one sum over every attention tensor, the memory-bandwidth floor;
and the same (b), (c), (d) on already-fused input (head_fusion=None). Peak memory is the growth of the
process's resident set during the call (VmHWM reset through /proc/self/clear_refs), beyond the input.

Goals: (c) >= 10x faster than (a0) at n=197; on fused input (c) >= 50x faster than (b) at n=2048;
on per-head input (c) within 1.5x of (d) at every n.

Usage: python benchmarks/bench_rollout.py [--sizes 197,577,1025,2048] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time

import torch

import attnroll

L, H = 12, 12


def make_attention(B: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(L):
        x = torch.randn(B, H, n, n, generator=g)
        out.append(torch.softmax(x, dim=-1))
        del x
    return out


def naive_rollout(attn: list[torch.Tensor], discard_ratio: float) -> torch.Tensor:
    """The loop people copy (vit-explain's, with its row-normalisation and per-example discard fixed)."""
    B, _, n, _ = attn[0].shape
    eye = torch.eye(n)
    R = eye.expand(B, n, n)
    for a in attn:
        fused = a.mean(dim=1)
        if discard_ratio:
            flat = fused.reshape(B, -1)
            _, idx = flat.topk(int(flat.shape[-1] * discard_ratio), dim=-1, largest=False)
            flat.scatter_(-1, idx, 0.0)
        a_res = (fused + eye) / 2
        a_res = a_res / a_res.sum(dim=-1, keepdim=True)
        R = a_res @ R
    return R[:, 0]


def plain_read(attn: list[torch.Tensor]) -> float:
    return sum(float(a.sum()) for a in attn)


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


CLOCK = time.perf_counter


def measure(fn, repeat: int) -> tuple[float, float | None]:
    """Best time of ``repeat`` calls (after one warm-up) on ``CLOCK``, and the peak resident-set growth
    (bytes)."""
    fn()
    gc.collect()
    peak = None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = _proc_status("VmRSS")
        fn()
        peak = max(0, _proc_status("VmHWM") - base)
    except OSError:
        pass
    times = []
    for _ in range(repeat):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times), peak


def mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f}"


def run(sizes: list[tuple[int, int]], repeat: int) -> None:
    clock = "CPU" if CLOCK is time.process_time else "wall"
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"{platform.processor() or platform.machine()}; L={L}, H={H}; {clock} times in ms (best of {repeat})")
    head = (
        f"{'n':>5} {'B':>2} {'input MiB':>9} | {'(a) naive .9':>12} {'(a0) naive':>10} {'(b) full':>9} "
        f"{'(c) rows':>9} {'(cv) no check':>13} {'(c9) rows .9':>12} {'(d) read':>9} | {'a/c':>5} {'a0/c':>5} {'a/c9':>5} {'c/d':>5} {'cv/d':>5} | "
        f"fused: {'(b)':>8} {'(c)':>7} {'(d)':>7} {'b/c':>7} | peak MiB a0/b/c"
    )
    print(head)
    for n, B in sizes:
        attn = make_attention(B, n)
        reps = repeat if n <= 1025 else max(2, repeat // 2)
        t_a, _ = measure(lambda: naive_rollout(attn, 0.9), reps)
        t_a0, m_a0 = measure(lambda: naive_rollout(attn, 0.0), reps)
        t_b, m_b = measure(lambda: attnroll.rollout(attn), reps)
        t_c, m_c = measure(lambda: attnroll.rollout(attn, rows=[0]), reps)
        t_c9, _ = measure(lambda: attnroll.rollout(attn, rows=[0], discard_ratio=0.9), reps)
        t_cv, _ = measure(lambda: attnroll.rollout(attn, rows=[0], validate=False), reps)
        t_d, _ = measure(lambda: plain_read(attn), reps)
        in_bytes = sum(a.numel() * a.element_size() for a in attn)
        fused = [a.mean(dim=1) for a in attn]
        del attn
        gc.collect()
        f_b, _ = measure(lambda: attnroll.rollout(fused, head_fusion=None), reps)
        f_c, _ = measure(lambda: attnroll.rollout(fused, head_fusion=None, rows=[0]), reps)
        f_d, _ = measure(lambda: plain_read(fused), reps)
        del fused
        gc.collect()
        ms = lambda t: f"{t * 1e3:.1f}"  # noqa: E731
        print(
            f"{n:>5} {B:>2} {in_bytes / 2**20:>9.0f} | {ms(t_a):>12} {ms(t_a0):>10} {ms(t_b):>9} {ms(t_c):>9} "
            f"{ms(t_cv):>13} {ms(t_c9):>12} {ms(t_d):>9} | {t_a / t_c:>5.1f} {t_a0 / t_c:>5.1f} {t_a / t_c9:>5.1f} "
            f"{t_c / t_d:>5.2f} {t_cv / t_d:>5.2f} | "
            f"       {ms(f_b):>8} {ms(f_c):>7} {ms(f_d):>7} {f_b / f_c:>7.1f} | {mib(m_a0)}/{mib(m_b)}/{mib(m_c)}",
            flush=True,
        )


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc otherwise raises its mmap threshold after the first large free and keeps freed memory
        # resident, which would hide a call's temporaries from the peak-RSS measurement. Re-exec with a
        # fixed threshold so that every allocation above 64 KiB is mapped and unmapped on its own.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="197,577,1025,2048", help="comma-separated n (B=1), plus n=197 at B=8")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="cpu: process CPU time, robust to other load on a shared machine (use with --threads 1)",
    )
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [(int(s), 1) for s in args.sizes.split(",")]
    if any(n == 197 for n, _ in sizes):
        sizes.insert(1, (197, 8))
    run(sizes, args.repeat)


if __name__ == "__main__":
    main()
