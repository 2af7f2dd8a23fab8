"""An image map of a Qwen2.5-VL-sized vision tower on the matrix-free route, against the model's own forward,
side by side in one run.

Model (random weights): Qwen2.5-VL's vision tower at its real sizes — depth 32, hidden 1280, 16 heads, MLP
3420, patch 14, windows of 112 pixels (8x8 patches) with full attention in blocks 7, 15, 23, 31, 2x2 merger —
under a small language model (2 layers, 256 wide, 4 heads; the map's cost is the tower's). One image of
``--size`` pixels square (default 224: 16x16 = 256 patches, 64 image tokens), one prompt.

Per round, interleaved: the model's forward under its own SDPA kernels (no grad), then
``attnroll.explain(model, inputs, "rollout")`` (capture of the kernels' q/k + the composed map). Time: CPU
time of the calling thread with torch on one thread (other processes' load on shared cores barely moves it),
the median over rounds, and the median of each round's own ratio; wall clock is recorded too, with the load
average.

Usage: python benchmarks/bench_vlm_vision.py [--size 224] [--rounds 3] [--depth 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(depth: int):
    import transformers

    vc = dict(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, window_size=112,
              fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < depth], out_hidden_size=256,
              spatial_merge_size=2, temporal_patch_size=2)
    tc = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=1000, max_position_embeddings=4096,
              rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0})
    cfg = transformers.Qwen2_5_VLConfig(text_config=tc, vision_config=vc, image_token_id=990, video_token_id=991,
                                        vision_start_token_id=992, vision_end_token_id=993)
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()


def inputs(size: int) -> dict:
    side = size // 14
    n = side * side
    ids = torch.tensor([[5, 6, 7, 992] + [990] * (n // 4) + [993, 8, 9, 10]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == 990).long(),
            "pixel_values": torch.randn(n, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)),
            "image_grid_thw": torch.tensor([[1, side, side]])}


def timed(fn) -> tuple[float, float]:
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c0, time.perf_counter() - w0


def main() -> None:
    import attnroll

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depth", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(args.depth)
    inp = inputs(args.size)
    with torch.no_grad():
        model(**inp)  # warm-up
    attnroll.explain(model, inp, "rollout")
    fwd, exp, ratios = [], [], []
    for _ in range(args.rounds):
        with torch.no_grad():
            f = timed(lambda: model(**inp))
        e = timed(lambda: attnroll.explain(model, inp, "rollout"))
        fwd.append(f)
        exp.append(e)
        ratios.append(e[0] / f[0])
    med = statistics.median
    n = inp["pixel_values"].shape[0]
    print(f"Qwen2.5-VL vision tower depth {args.depth}, hidden 1280, 16 heads, patch 14; image {args.size}x{args.size} "
          f"({n} patches, {n // 4} image tokens); {args.rounds} rounds, 1 thread")
    print(f"forward (SDPA, no grad): cpu {med(c for c, _ in fwd):.2f} s, wall {med(w for _, w in fwd):.2f} s")
    print(f"explain rollout (matrix-free): cpu {med(c for c, _ in exp):.2f} s, wall {med(w for _, w in exp):.2f} s")
    print(f"ratio explain / forward: {med(c for c, _ in exp) / med(c for c, _ in fwd):.3f} (median of rounds' "
          f"ratios {med(ratios):.3f})")
    with open("/proc/loadavg") as f:
        print("load average:", f.read().strip())


if __name__ == "__main__":
    main()
