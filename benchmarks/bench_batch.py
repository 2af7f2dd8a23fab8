"""Throughput of ``attnroll batch``: inputs per second, side by side in one run, of

  plain       a plain batched inference loop: read each image, preprocess, forward (the model as loaded,
              SDPA attention), softmax and argmax — no explanation, nothing written. It reads through the
              same read-ahead thread as the local engine (attnroll.batch.engines.read_ahead), so both sides
              do the same I/O the same way
  local       run_batch(engine="local"): the same reading, explain (rollout: the matrix-free route under the
              model's own SDPA kernel, attention probabilities recomputed blockwise; gae: eager attention
              captured and a backward pass), rows built column-wise and committed as Parquet shards by a
              writer thread
  ray-1/ray-2 run_batch(engine="ray", num_workers=1 or 2): Ray Data actors (each loads the model once), the
              same work per batch; the Ray runtime is started once before (as on a cluster)

for ``rollout`` and ``gae`` on the embedded shapes ViT (64x64 input, 65 tokens) and a ViT-B/16 config with
random weights (224x224, 197 tokens), on the same PNG files (generated shapes images; ViT-B resizes them).
Every figure is end to end: model loading (in each Ray actor too), reading, explaining and writing. "steady"
leaves start-up out: the rate between the first and the last batch (for the engines, between the first and
the last committed shard, from the shards' modification times; one worker only). "interleaved" runs the plain
loop's step and the local engine's step batch by batch on the same inputs, the ratio least disturbed by the
load of a shared machine (there both sides read synchronously, no threads). ``--breakdown`` prints where a
batch's time goes (decoding, the plain forward, explain on each attention route, rows, the Parquet commit).
Each configuration runs --repeat times, alternating, and the best run counts (the machine is shared).

Usage: python benchmarks/bench_batch.py [--models shapes,vit-b16] [--methods rollout,gae] [--n-shapes 512]
       [--n-vit 32] [--vit-batch 8] [--repeat 2] [--skip-ray] [--breakdown] [--interleaved-only]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def write_images(root: Path, n: int) -> list[Path]:
    from PIL import Image

    from attnroll.models import shapes

    images, _, _ = shapes.make_dataset(n, 11)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, im in enumerate(images):
        p = root / f"img{i:05d}.png"
        Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(p)
        paths.append(p)
    return paths


def vit_b16_dir(root: Path) -> Path:
    """A ViT-B/16 (224, 12 layers, 768 wide, 12 heads) with random weights, saved as a transformers folder."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=224, patch_size=16, num_labels=10)
    ViTForImageClassification(cfg).eval().save_pretrained(root)
    return root


def plain_loop(model_spec: str | None, files: list[Path], batch_size: int) -> tuple[float, float]:
    """The loop a user writes without attnroll: read, preprocess, forward, softmax; (seconds, steady rate)."""
    from attnroll.batch.engines import chunks, read_ahead
    from attnroll.batch.work import read_image
    from attnroll.models import load_model

    t0 = time.perf_counter()
    lm = load_model(model_spec, None, want="image")
    marks, done = [], 0

    def load(batch: list[Path]) -> torch.Tensor:
        return torch.cat([lm.prepare_image(read_image(str(f))) for f in batch])

    with torch.no_grad():
        for x in read_ahead(load, chunks(files, batch_size)):
            torch.softmax(lm.model(pixel_values=x).logits, dim=-1).max(dim=-1)
            done += x.shape[0]
            marks.append((time.perf_counter(), done))
    return time.perf_counter() - t0, steady(marks)


def engine_worker(model_spec: str | None, files: list[Path], method: str, out: Path) -> tuple:
    """(loaded model, the local engine's Worker writing to ``out`` (emptied), the items of ``files``, out)."""
    from attnroll.batch import model_fingerprint
    from attnroll.batch.run import resolve_methods
    from attnroll.batch.sources import list_items
    from attnroll.batch.work import Job, Worker
    from attnroll.models import load_model

    lm = load_model(model_spec, None, want="image")
    names, opts = resolve_methods([method], None)
    shutil.rmtree(out, ignore_errors=True)
    worker = Worker(lm, Job(names, opts, model_fingerprint(lm.model), str(out)))
    return lm, worker, list_items(files[0].parent), out


def breakdown(model_spec: str | None, files: list[Path], batch_size: int, method: str, work: Path) -> dict:
    """Milliseconds per batch of each step, on the same inputs, one after the other (no threads): decoding
    and preprocessing, the plain forward, ``explain`` on the matrix-free route ("recompute") and the dense
    one (eager attention captured), the engine's rows (its compute step less explain), the shard commit."""
    from attnroll.methods import explain, method_info

    lm, worker, items, out = engine_worker(model_spec, files, method, work / f"out-breakdown-{method}")
    t: dict[str, float] = {}

    def timed(key: str, fn, *a, **k):
        t0 = time.perf_counter()
        r = fn(*a, **k)
        t[key] = t.get(key, 0.0) + time.perf_counter() - t0
        return r

    routes = ("recompute", "dense") if "attention" in method_info(method).options else (None,)
    batches = list(range(0, len(items), batch_size))
    worker.compute(worker.load(items[:batch_size]))  # warm-up: first-call imports (pyarrow) and allocations
    for i in batches:
        loaded = timed("decode + preprocess", worker.load, items[i : i + batch_size])
        x = torch.cat([p[1] for p in loaded[2]])
        with torch.no_grad():
            timed("plain forward", lambda: lm.model(pixel_values=x))
        with torch.set_grad_enabled(method_info(method).needs_grad):
            for route in routes:
                timed(f"explain ({route or 'default'})", explain, lm.model, x, method,
                      **({"attention": route} if route else {}))
        computed = timed("engine compute (explain + rows)", worker.compute, loaded)
        timed("commit (Parquet shard)", worker.commit, computed)
    shutil.rmtree(out, ignore_errors=True)
    return {k: 1000 * v / len(batches) for k, v in t.items()}


def interleaved(model_spec: str | None, files: list[Path], batch_size: int, method: str, work: Path) -> float:
    """Per-batch cost ratio robust to a shared machine's load: batch by batch, the plain loop's step (read,
    preprocess, forward) and the local engine's step (read, explain, rows, commit) run back to back on the same
    inputs; returns plain seconds / engine seconds summed over the batches (= engine throughput / plain)."""
    from attnroll.batch.work import read_image

    lm, worker, items, out = engine_worker(model_spec, files, method, work / f"out-interleaved-{method}")
    worker(items[:batch_size])  # warm-up: first-call imports (pyarrow) and allocations, left out of the ratio
    t_plain = t_engine = 0.0
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        t = time.perf_counter()
        with torch.no_grad():
            x = torch.cat([lm.prepare_image(read_image(it.path)) for it in chunk])
            torch.softmax(lm.model(pixel_values=x).logits, dim=-1).max(dim=-1)
        t_plain += time.perf_counter() - t
        t = time.perf_counter()
        worker(chunk)
        t_engine += time.perf_counter() - t
    shutil.rmtree(out, ignore_errors=True)
    return t_plain / t_engine


def steady(marks: list[tuple[float, int]]) -> float:
    """Inputs per second between the first and the last finished batch."""
    if len(marks) < 2:
        return float("nan")
    (t1, n1), (t2, n2) = marks[0], marks[-1]
    return (n2 - n1) / (t2 - t1)


def batch_run(src: Path, model_spec: str | None, method: str, batch_size: int, engine: str, workers: int,
              work: Path) -> tuple[float, float]:
    """(seconds end to end, steady rate); steady = inputs committed after the first shard over the time from
    the first shard to the last (shard modification times), start-up left out; only for one worker (with
    several, actors start at different times and the shards of a short run land in bursts)."""
    import pyarrow.parquet as pq

    from attnroll.batch import run_batch

    out = work / f"out-{engine}-{workers}-{method}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    run_batch(src, out, methods=[method], model=model_spec, batch_size=batch_size, engine=engine,
              num_workers=workers)
    sec = time.perf_counter() - t0
    shards = sorted((out / "rows").glob("part-*.parquet"), key=lambda p: p.stat().st_mtime)
    counts = [pq.ParquetFile(p).metadata.num_rows for p in shards]
    span = shards[-1].stat().st_mtime - shards[0].stat().st_mtime
    rate = sum(counts[1:]) / span if span > 0 and workers == 1 else float("nan")
    shutil.rmtree(out, ignore_errors=True)
    return sec, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="shapes,vit-b16")
    ap.add_argument("--n-shapes", type=int, default=512)
    ap.add_argument("--n-vit", type=int, default=32)
    ap.add_argument("--vit-batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--methods", default="rollout,gae")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="where a batch's time goes, per step")
    ap.add_argument("--interleaved-only", action="store_true",
                    help="only the batch-by-batch ratio of the local engine to the plain loop")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="attnroll-bench-batch-"))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load before: {os.getloadavg()}")
    if not (args.skip_ray or args.interleaved_only):
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        for name in args.models.split(","):
            n, bs = (args.n_shapes, 32) if name == "shapes" else (args.n_vit, args.vit_batch)
            spec = None if name == "shapes" else str(vit_b16_dir(work / "vit-b16"))
            src = work / f"images-{n}"
            if not src.exists():
                write_images(src, n)
            files = sorted(src.glob("*.png"))
            methods = args.methods.split(",")
            for method in methods:
                if args.breakdown:
                    parts = breakdown(spec, files, bs, method, work)
                    print(f"# {name} {method}: ms per batch of {bs}: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
                ratio = interleaved(spec, files, bs, method, work)
                print(f"# {name} {method}: local engine / plain loop, batch by batch interleaved: {ratio:.2f}x")
            if args.interleaved_only:
                continue
            configs = [("plain", None, "local", 1)]
            for method in methods:
                configs.append(("local", method, "local", 1))
                if not args.skip_ray:
                    configs += [("ray-1", method, "ray", 1), ("ray-2", method, "ray", 2)]
            best: dict = {}
            for _ in range(args.repeat):
                for label, method, engine, workers in configs:
                    if label == "plain":
                        sec, st = plain_loop(spec, files, bs)
                    else:
                        sec, st = batch_run(src, spec, method, bs, engine, workers, work)
                    key = (label, method)
                    if key not in best or sec < best[key][0]:
                        best[key] = (sec, st)
            report(name, n, bs, best, methods)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"# load after: {os.getloadavg()}")


def report(name: str, n: int, bs: int, best: dict, methods: list[str]) -> None:
    plain = n / best[("plain", None)][0]
    plain_st = best[("plain", None)][1]
    print(f"\n## {name}: {n} images, batch {bs}; inputs/s end to end (steady)")
    print(f"plain loop                {plain:7.2f} ({plain_st:7.2f})")
    for method in methods:
        if ("local", method) not in best:
            continue
        loc = n / best[("local", method)][0]
        loc_st = best[("local", method)][1]
        print(f"{method:<8} local            {loc:7.2f} ({loc_st:7.2f})   {loc / plain:5.2f}x plain "
              f"({loc_st / plain_st:5.2f}x steady)")
        for label in ("ray-1", "ray-2"):
            if (label, method) in best:
                r = n / best[(label, method)][0]
                r_st = best[(label, method)][1]
                print(f"{method:<8} {label:<16} {r:7.2f} ({r_st:7.2f})   {r / loc:5.2f}x local "
                      f"({r_st / loc_st:5.2f}x steady)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
