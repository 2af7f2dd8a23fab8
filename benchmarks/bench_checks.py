"""What the bad-input checks of issue 13 cost inside explain(): the check of the captured attention at real
tokens (``Context.check_attention``, one read of every layer) and the zeroing of padded query rows, timed side
by side with the checks switched off (monkeypatched to no-ops) in the same process, interleaved run by run.

Model: ViT-B/16 (transformers default config, 197 tokens, random weights) for raw / rollout / gae at batch 1
and 8; a BERT-base-sized text classifier with one padded example for the masked path.
Each entry: the median of --repeat interleaved pairs after a warm-up; the ratio is checks-on / checks-off.

Usage: python benchmarks/bench_checks.py [--repeat 5] [--threads N] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import attnroll
from attnroll.core import rollout as core_rollout
from attnroll.methods import base


def pair(fn, repeat: int) -> tuple[float, float]:
    """(median seconds with the checks, median without), interleaved."""
    on, off = [], []
    real_check, real_layer = base.Context.check_attention, core_rollout.Layers.layer

    def raw_layer(self, i):  # the layer read without the padding zeroing (values still checked as before)
        t = self.tensors[i].to(self.dtype)
        if self.validate and t.numel():
            self.check(i, float(t.amin()), t.sum(dim=-1))
        return t

    fn()
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        on.append(time.perf_counter() - t0)
        base.Context.check_attention = lambda self, rec: None
        core_rollout.Layers.layer = raw_layer
        try:
            t0 = time.perf_counter()
            fn()
            off.append(time.perf_counter() - t0)
        finally:
            base.Context.check_attention, core_rollout.Layers.layer = real_check, real_layer
    return statistics.median(on), statistics.median(off)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers as T

    torch.manual_seed(0)
    vit = T.ViTForImageClassification(T.ViTConfig()).eval()
    bert = T.BertForSequenceClassification(T.BertConfig()).eval()
    print(f"load {os.getloadavg()[0]:.2f}, threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("| model | batch | method | checks on (s) | off (s) | on / off |")
    print("|---|---|---|---|---|---|")
    for B in [int(b) for b in args.batches.split(",")]:
        x = {"pixel_values": torch.randn(B, 3, 224, 224)}
        for m in ("raw", "rollout", "gae"):
            a, b = pair(lambda: attnroll.explain(vit, x, m), args.repeat)
            print(f"| ViT-B/16 | {B} | {m} | {a:.3f} | {b:.3f} | {a / b:.3f} |", flush=True)
    ids = torch.randint(5, 1000, (8, 128))
    mask = torch.ones(8, 128, dtype=torch.long)
    mask[-1, 64:] = 0
    for m in ("rollout", "gae"):
        a, b = pair(lambda: attnroll.explain(bert, {"input_ids": ids, "attention_mask": mask}, m), args.repeat)
        print(f"| BERT-base, padded | 8 | {m} | {a:.3f} | {b:.3f} | {a / b:.3f} |", flush=True)


if __name__ == "__main__":
    main()
