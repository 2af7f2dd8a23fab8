"""Cost of the perturbation metrics: attnroll's batched implementation against the per-image, per-step loop a
notebook would write, side by side in one run, on the embedded shapes model (64x64, 8x8 patches = 64 units).

  loop      for each image, for each step: copy the image, fill the removed patches, one forward of batch 1
  batched   attnroll.evaluate.deletion / positive_perturbation (many perturbed copies per forward)

Both compute the same curves (checked here: max difference printed). Deletion uses one step per patch (65
points); positive perturbation Chefer's 10 points. Times are wall-clock medians of --repeat runs.

Usage: python benchmarks/bench_evaluate.py [--n 64] [--repeat 3] [--threads 1] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from attnroll import explain
from attnroll.evaluate import deletion, positive_perturbation
from attnroll.models import shapes


def timed(fn, repeat: int):
    out, ts = None, []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


@torch.no_grad()
def loop_curves(model, x, scores, counts, fill, target):
    """Per image, per step: remove the `count` most relevant patches (stable order), one forward each."""
    B, units = scores.shape
    h = w = int(units**0.5)
    ph, pw = x.shape[-2] // h, x.shape[-1] // w
    order = torch.sort(-scores, dim=1, stable=True).indices
    probs = torch.empty(B, len(counts))
    correct = torch.empty(B, len(counts))
    for b in range(B):
        for s, k in enumerate(counts):
            img = x[b : b + 1].clone()
            for u in order[b, :k].tolist():
                i, j = divmod(u, w)
                img[..., i * ph : (i + 1) * ph, j * pw : (j + 1) * pw] = fill
            logits = model(pixel_values=img).logits[0]
            probs[b, s] = logits.softmax(-1)[target[b]]
            correct[b, s] = float(logits.argmax() == target[b])
    return probs, correct


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads {a.threads}, "
          f"n = {a.n} images, batch size {a.batch_size}")
    model = shapes.load_shapes_model()
    images, _, _ = shapes.make_dataset(a.n, 12345)
    x = shapes.preprocess(images)
    scores = explain(model, x, "rollout").scores
    with torch.no_grad():
        target = model(pixel_values=x).logits.argmax(-1)
    units = scores.shape[1]

    rows = []
    counts = list(range(units + 1))
    t_loop, (pl, _) = timed(lambda: loop_curves(model, x, scores, counts, 0.0, target), 1)
    t_b, r = timed(lambda: deletion(model, x, scores, target=target.tolist(), batch_size=a.batch_size), a.repeat)
    diff = float((torch.as_tensor(r.curves) - pl).abs().max())
    rows.append(("deletion (65 steps)", t_loop, t_b, diff))

    fr = [i / 10 for i in range(10)]
    counts = [round(f * units) for f in fr]
    t_loop, (_, cl) = timed(lambda: loop_curves(model, x, scores, counts, 0.0, target), 1)
    t_b, r = timed(lambda: positive_perturbation(model, x, scores, target=target.tolist(),
                                                 batch_size=a.batch_size), a.repeat)
    diff = float((torch.as_tensor(r.curves) - cl).abs().max())
    rows.append(("positive perturbation (10 pts)", t_loop, t_b, diff))

    print(f"\n{'metric':<32}{'loop s':>9}{'batched s':>11}{'speed-up':>10}{'max |diff|':>12}")
    for name, tl, tb, d in rows:
        print(f"{name:<32}{tl:>9.2f}{tb:>11.2f}{tl / tb:>9.1f}x{d:>12.2e}")
    per_img = rows[0][2] / a.n
    print(f"\nbatched deletion: {per_img * 1e3:.1f} ms per image ({units + 1} forwards each)")


if __name__ == "__main__":
    main()
