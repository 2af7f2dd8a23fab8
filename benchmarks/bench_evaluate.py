"""Cost of the perturbation metrics: attnroll's batched implementation against the per-image, per-step loop a
notebook would write, side by side in one run, on the embedded shapes model (64x64, 8x8 patches = 64 units).

  loop      for each image, for each step: copy the image, fill the removed patches, one forward of batch 1
  batched   attnroll.evaluate.deletion / positive_perturbation (many perturbed copies per forward)

Both compute the same curves (checked here: max difference printed). Deletion uses one step per patch (65
points); positive perturbation Chefer's 10 points. Times are wall-clock medians of --repeat runs.

With --run: the whole default ``attnroll evaluate`` run (its default methods and every metric of the shapes
data) side by side, scoring as before (perturbed copies ``--batch-size`` per forward pass) and as now (many
copies per pass, up to attnroll.evaluate.suite.SCORING_ELEMENTS pixels), with torch's default threads as the
command has them; both must give the same table. The machine's load (/proc/loadavg) is printed before and
after: on a shared machine other processes change both times.

Usage: python benchmarks/bench_evaluate.py [--n 64] [--repeat 3] [--threads 1] [--batch-size 64]
       python benchmarks/bench_evaluate.py --run [--n 40]
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


def load_average() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "unknown"


def default_run(n: int, batch_size: int, batched: bool) -> tuple[float, dict, dict]:
    """The default ``attnroll evaluate`` run on n shapes images: (seconds, explaining seconds per method, the
    table's values); ``batched=False`` scores ``batch_size`` copies per pass, as before."""
    from PIL import Image

    from attnroll.evaluate import suite
    from attnroll.models.loading import load_shapes

    lm = load_shapes()
    images, labels, masks = shapes.make_dataset(n, 12345)
    x = shapes.preprocess(images)
    fill = lm.prepare_image(Image.new("RGB", (x.shape[-1], x.shape[-2]), (0, 0, 0)))[0]
    kept = suite.SCORING_ELEMENTS
    suite.SCORING_ELEMENTS = kept if batched else 0
    try:
        t = time.perf_counter()
        res = suite.evaluate_methods(lm.model, x, labels=labels, masks=shapes.patch_masks(masks), fill=fill,
                                     batch_size=batch_size)
        return time.perf_counter() - t, res.seconds, res.values
    finally:
        suite.SCORING_ELEMENTS = kept


def compare_runs(n: int, batch_size: int) -> None:
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads "
          f"{torch.get_num_threads()} (default), n = {n} images, batch size {batch_size}")
    print(f"load average before: {load_average()}")
    t_before, ex_before, v_before = default_run(n, batch_size, batched=False)
    print(f"load average between: {load_average()}")
    t_after, ex_after, v_after = default_run(n, batch_size, batched=True)
    print(f"load average after: {load_average()}")
    diff = max(abs(v_before[m][k] - v_after[m][k]) for m in v_before for k in v_before[m]
               if v_before[m][k] == v_before[m][k])
    print(f"\n{'scoring':<34}{'total s':>9}{'explaining s':>14}{'scoring s':>11}")
    for name, t, ex in (("before: batch-size copies / pass", t_before, ex_before),
                        ("now: many copies / pass", t_after, ex_after)):
        print(f"{name:<34}{t:>9.1f}{sum(ex.values()):>14.1f}{t - sum(ex.values()):>11.1f}")
    sb, sa = t_before - sum(ex_before.values()), t_after - sum(ex_after.values())
    print(f"\nwhole run {t_before / t_after:.2f}x faster, scoring {sb / sa:.2f}x; "
          f"max |difference| of the table's values {diff:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--run", action="store_true", help="the default evaluate run, scoring before and now")
    a = p.parse_args()
    if a.run:
        compare_runs(a.n, a.batch_size)
        return
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
