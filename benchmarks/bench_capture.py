"""Capture cost, measured side by side in one run.

Memory: a BERT-base-sized model (12 layers, 12 heads, hidden 768; random weights) at n = 512 and 2048,
batch 1: the attention kept and the peak resident memory above the loaded model for (1) a plain SDPA forward,
(2) eager ``output_attentions=True``, (3) ``attnroll.capture`` keeping every head, (4) ``capture`` with
``fuse_heads="mean"``. Each cell runs in its own process, since peak RSS only grows.

Time: ViT-B/16 (random weights, 224x224) at batch 1 and 8: the time of ``capture`` (every head and fused)
and of a plain eager forward relative to one plain SDPA forward, interleaved so that load drift hits every
mode alike; the median of the per-round ratios.

Goals: attention storage about H = 12 times smaller when fused; capture within 1.10x of SDPA.

Usage: python benchmarks/bench_capture.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mem_cell(n: int, mode: str) -> None:
    import transformers as T

    import attnroll

    torch.manual_seed(0)
    model = T.BertModel(T.BertConfig(max_position_embeddings=max(512, n))).eval()
    ids = torch.randint(1000, 20000, (1, n))
    base = peak_mib()
    with torch.no_grad():
        if mode == "sdpa":
            model(input_ids=ids)
            kept = 0
        elif mode == "output_attentions":
            model.set_attn_implementation("eager")
            out = model(input_ids=ids, output_attentions=True)
            kept = sum(a.numel() * a.element_size() for a in out.attentions)
        else:
            fuse = None if mode == "capture" else "mean"
            rec = attnroll.capture(model, {"input_ids": ids}, fuse_heads=fuse)
            kept = sum(a.numel() * a.element_size() for a in rec.attentions)
    print(json.dumps(dict(n=n, mode=mode, kept_mib=kept / 2**20, extra_mib=peak_mib() - base)))


def timing(batch: int, rounds: int) -> dict:
    import transformers as T

    import attnroll

    torch.manual_seed(0)
    model = T.ViTForImageClassification(T.ViTConfig()).eval()  # ViT-B/16 at 224, SDPA attention
    eager = T.ViTForImageClassification(T.ViTConfig(attn_implementation="eager")).eval()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(batch, 3, 224, 224)

    def sdpa():
        with torch.no_grad():
            model(pixel_values=x)

    def plain_eager():
        with torch.no_grad():
            eager(pixel_values=x)

    runs = {
        "sdpa": sdpa,
        "eager": plain_eager,
        "capture": lambda: attnroll.capture(model, x),
        "capture_mean": lambda: attnroll.capture(model, x, fuse_heads="mean"),
    }
    for f in runs.values():
        f()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return {
        "batch": batch,
        "sdpa_s": med(times["sdpa"]),
        **{k: med([a / b for a, b in zip(times[k], times["sdpa"])]) for k in runs if k != "sdpa"},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cell", nargs=2, metavar=("N", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell:
        mem_cell(int(args.cell[0]), args.cell[1])
        return
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'n':>5} {'mode':>18} {'attention kept MiB':>19} {'peak RSS above model MiB':>25}")
    for n in (512, 2048):
        for mode in ("sdpa", "output_attentions", "capture", "capture_mean"):
            out = subprocess.run(
                [sys.executable, __file__, "--cell", str(n), mode], check=True, capture_output=True, text=True
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{n:>5} {mode:>18} {r['kept_mib']:>19.0f} {r['extra_mib']:>25.0f}", flush=True)
    print(f"\nViT-B/16, time relative to one SDPA forward (median of {args.rounds} interleaved rounds)")
    print(f"{'batch':>5} {'SDPA ms':>8} {'eager':>6} {'capture':>8} {'capture mean':>13}")
    for batch in (1, 8):
        r = timing(batch, args.rounds if batch == 1 else max(3, args.rounds // 2))
        print(f"{batch:>5} {r['sdpa_s'] * 1e3:>8.0f} {r['eager']:>6.2f} {r['capture']:>8.2f} {r['capture_mean']:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
