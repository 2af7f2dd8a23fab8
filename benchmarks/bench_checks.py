"""What the bad-input checks add to explain(), measured directly: the check of the captured
attention at real tokens (``Context.check_attention``: one read of every layer) and the zeroing of padded
query rows in rollout (``Layers.layer`` with a mask), each timed on its own and set against the plain
forward pass of the same model and batch (the unit of explain's cost), in one process.

Models: ViT-B/16 (transformers default config, 197 tokens, random weights), per-head attention as gae /
raw see it and head-fused as rollout keeps it; BERT-base (128 tokens, batch 8, one example half padding) for
the masked path. Medians of --repeat runs after a warm-up.

Usage: python benchmarks/bench_checks.py [--repeat 20] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import attnroll
from attnroll.core import rollout as core_rollout
from attnroll.explain import Context, method_info


def median_time(fn, repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers as T

    torch.manual_seed(0)
    print(f"load {os.getloadavg()[0]:.2f}, threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("| model | batch | what | seconds | / forward |")
    print("|---|---|---|---|---|")
    vit = T.ViTForImageClassification(T.ViTConfig()).eval()
    for B in (1, 8):
        x = {"pixel_values": torch.randn(B, 3, 224, 224)}
        with torch.no_grad():
            fwd = median_time(lambda: vit(**x), max(3, args.repeat // 4))
        ctx = Context(vit, x, None, method_info("raw"), {}, None)
        for label, fuse in (("per-head (raw, gae)", None), ("head-fused (rollout)", "mean")):
            rec = attnroll.capture(vit, x, fuse_heads=fuse)
            t = median_time(lambda: ctx.check_attention(rec), args.repeat)
            print(f"| ViT-B/16 | {B} | check_attention, {label} | {t:.4f} | {t / fwd:.4f} |", flush=True)
        print(f"| ViT-B/16 | {B} | forward (sdpa, no_grad) | {fwd:.3f} | 1 |", flush=True)
    bert = T.BertForSequenceClassification(T.BertConfig()).eval()
    ids = torch.randint(5, 1000, (8, 128))
    mask = torch.ones(8, 128, dtype=torch.long)
    mask[-1, 64:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        fwd = median_time(lambda: bert(**inputs), max(3, args.repeat // 4))
    rec = attnroll.capture(bert, inputs, fuse_heads="mean")
    layers = core_rollout.parse_attentions(rec.attentions, fused=True, attention_mask=mask)
    t = median_time(lambda: [layers.layer(i) for i in range(len(rec.attentions))], args.repeat)
    print(f"| BERT-base, 1 of 8 half padded | 8 | masked layer reads incl. zeroing (12 layers) | {t:.4f} | "
          f"{t / fwd:.4f} |")
    print(f"| BERT-base | 8 | forward (sdpa, no_grad) | {fwd:.3f} | 1 |")


if __name__ == "__main__":
    main()
