"""Throughput of ``attnroll batch``: inputs per second, side by side in one run, of

  plain       a plain batched inference loop: read each image, preprocess, forward (the model as loaded,
              SDPA attention), softmax and argmax — no explanation, nothing written. It reads through the
              same read-ahead thread as the local engine (attnroll.batch.engines.read_ahead), so both sides
              do the same I/O the same way
  local       run_batch(engine="local"): the same reading, explain (rollout: the matrix-free route under the
              model's own SDPA kernel; gae: eager attention captured and a backward pass), rows built
              column-wise and committed as Parquet shards by a writer thread
  ray-K       run_batch(engine="ray", num_workers=K) as `attnroll batch --engine ray` runs on one machine:
              it starts a local Ray runtime, Ray Data starts K actors (each imports torch and loads the
              model), they explain and commit, the runtime is stopped — all inside the timed region
  ray-K@addr  the same job joining an already running local cluster (`ray start --head`, started once before
              and timed apart: "cluster start"), as on a multi-node cluster with `--address`

for ``rollout`` and ``gae`` on the embedded shapes ViT (64x64 input, 65 tokens) and a ViT-B/16 config with
random weights (224x224, 197 tokens), on the same PNG files (generated shapes images; ViT-B resizes them).
Each configuration reports three figures: **end to end** (inputs / wall time of the whole call: model
loading, and for Ray the runtime and actors, included), **start-up** (seconds from the call to the first
committed batch, from the shard files' modification times) and **steady** (inputs per second from the K-th
committed batch to the last, K = workers, so that every actor is running). The model is loaded once before
any timed run, so that no configuration pays the process's first imports of torch and transformers (the
Ray actors, fresh processes, do pay theirs: that is part of their start-up). The Ray actors use the machine's
CPUs shared between them (torch threads = CPUs / K), as the local engine uses them all. "interleaved" runs
the plain loop's step and the local engine's step batch by batch on the same inputs, the ratio least
disturbed by the load of a shared machine. ``--breakdown`` prints where a batch's time goes (decoding, the
plain forward, explain on each attention route, rows, the Parquet commit). Each configuration runs
--repeat times, alternating, each in a fresh Python process, and the best end-to-end run counts (the
machine is shared); with ``--ref`` the two trees' local engines swap places every other round, and each
one's per-round ratio to that round's plain loop and their median ("paired") are printed too.

``--cli`` times the command itself instead (``attnroll batch``, each run a cold process that imports torch,
transformers and Ray itself: what a user waits for), optionally beside a reference tree (``--ref``). The
report gives each Ray configuration's fixed cost (end to end less inputs / steady rate) and the dataset size
from which it would reach 0.8x the local engine end to end at these rates; ``--n-shapes 20000
--image-cache /tmp/attnroll-bench-images`` measures a large dataset (generated once, then reused).

Usage: python benchmarks/bench_batch.py [--models shapes,vit-b16] [--methods rollout,gae] [--n-shapes 4000]
       [--n-vit 64] [--vit-batch 8] [--repeat 1] [--ray fresh,joined | --ray none] [--workers 1,2]
       [--breakdown] [--interleaved-only] [--image-cache DIR] [--ref OTHER/src] [--cli]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# Before torch starts OpenMP: threads that wait passively. On a shared 2-core machine spinning OpenMP threads
# make a 2-thread forward 3-14x slower whenever another process runs (measured: the shapes ViT's forward of
# 32 images 200-1100 ms spinning, 65-77 ms passive, 60-80 ms on one thread). Every process of the benchmark
# (the configurations' children, the Ray runtime and its actors, `ray start`) inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def write_images(root: Path, n: int, chunk: int = 2000) -> list[Path]:
    """``n`` generated shapes PNGs in ``root``, made ``chunk`` at a time (a distinct seed each) so that a large
    dataset never holds all its pixels in memory; a ``complete`` marker says the folder is whole (reused
    by ``--image-cache``)."""
    from PIL import Image

    from attnroll.models import shapes

    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, n, chunk):
        images, _, _ = shapes.make_dataset(min(chunk, n - start), 11 + start // chunk)
        for i, im in enumerate(images, start):
            p = root / f"img{i:05d}.png"
            Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(p)
            paths.append(p)
    (root / "complete").write_text(str(n))
    return paths


def shapes_images(work: Path, n: int, cache: str | None) -> Path:
    """The folder of ``n`` shapes PNGs: in ``cache`` (made once, reused by later runs) or in ``work``."""
    src = (Path(cache) if cache else work) / f"images-{n}"
    marker = src / "complete"
    if not (marker.is_file() and marker.read_text() == str(n)):
        shutil.rmtree(src, ignore_errors=True)
        t0 = time.perf_counter()
        write_images(src, n)
        print(f"# generated {n} shapes PNGs in {src} in {time.perf_counter() - t0:.0f} s")
    return src


def vit_b16_dir(root: Path) -> Path:
    """A ViT-B/16 (224, 12 layers, 768 wide, 12 heads) with random weights, saved as a transformers folder."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=224, patch_size=16, num_labels=10)
    ViTForImageClassification(cfg).eval().save_pretrained(root)
    return root


def plain_loop(model_spec: str | None, src: Path, batch_size: int) -> "Timing":
    """The loop a user writes without attnroll: list the folder, read, preprocess, forward, softmax (the
    listing is timed, as the engine's own listing is)."""
    from attnroll.batch.engines import chunks, read_ahead
    from attnroll.batch.work import read_image
    from attnroll.models import load_model

    t0 = time.perf_counter()
    files = sorted(src.glob("*.png"))
    lm = load_model(model_spec, None, want="image")
    marks, done = [], 0

    def load(batch: list[Path]) -> torch.Tensor:
        return torch.cat([lm.prepare_image(read_image(str(f))) for f in batch])

    with torch.no_grad():
        for x in read_ahead(load, chunks(files, batch_size)):
            torch.softmax(lm.model(pixel_values=x).logits, dim=-1).max(dim=-1)
            done += x.shape[0]
            marks.append((time.perf_counter(), done))
    return Timing.of(t0, time.perf_counter(), marks, 1)


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


@dataclass
class Timing:
    """One run: ``seconds`` end to end, ``startup`` (seconds to the first committed batch), ``steady``
    (inputs per second from the K-th committed batch to the last), ``inputs``."""

    seconds: float
    startup: float
    steady: float
    inputs: int

    @property
    def rate(self) -> float:
        return self.inputs / self.seconds

    @property
    def fixed(self) -> float:
        """Seconds of the run that its steady rate does not explain (start-up, tail, shutdown): the run
        modelled as fixed + inputs / steady."""
        return self.seconds - self.inputs / self.steady

    @classmethod
    def of(cls, t0: float, t1: float, marks: list[tuple[float, int]], workers: int) -> "Timing":
        """From the call's start and end and its (time, inputs done) marks, one per committed batch."""
        marks = [m for m in marks if m[1] > 0]
        k = min(workers, len(marks)) - 1
        (ta, na), (tb, nb) = marks[k], marks[-1]
        rate = (nb - na) / (tb - ta) if tb > ta else float("nan")
        return cls(t1 - t0, marks[0][0] - t0, rate, marks[-1][1])


def batch_run(src: Path, model_spec: str | None, method: str, batch_size: int, engine: str, workers: int,
              work: Path, address: str | None = None) -> Timing:
    """run_batch into an empty folder. The marks are the committed shards' modification times (when each
    batch was committed, in the actor for Ray: the driver only hears of them through Ray Data's output
    stream, which can deliver them in bursts) and their rows."""
    from attnroll.batch import run_batch

    out = work / f"out-{engine}-{workers}-{method}"
    shutil.rmtree(out, ignore_errors=True)
    extra = {}
    if engine == "ray":  # the machine's CPUs shared between the actors, joined or not
        extra = {"num_workers": workers, "address": address,
                 "cpus_per_worker": max(1, (os.cpu_count() or 1) // workers)}
    t0 = time.time()
    run_batch(src, out, methods=[method], model=model_spec, batch_size=batch_size, engine=engine, **extra)
    return shard_timing(out, t0, time.time(), workers)


def shard_timing(out: Path, t0: float, t1: float, workers: int) -> Timing:
    """The Timing of a run into ``out`` from ``t0`` to ``t1`` (wall clock), its marks the committed shards'
    modification times and rows; ``out`` is removed."""
    import pyarrow.parquet as pq

    shards = sorted((out / "rows").glob("part-*.parquet"), key=lambda p: p.stat().st_mtime)
    marks, done = [], 0
    for p in shards:
        done += pq.ParquetFile(p).metadata.num_rows
        marks.append((p.stat().st_mtime, done))
    shutil.rmtree(out, ignore_errors=True)
    return Timing.of(t0, t1, marks, workers)


def cli_run(src: Path, method: str, batch_size: int, engine: str, workers: int, work: Path,
            tree: str | None) -> Timing:
    """The real command, ``python -m attnroll.commands batch SRC --out OUT ...``, in a fresh process: what a
    user waits for, the first imports of torch and transformers (and for Ray the runtime, Ray Data and the
    actors) included. ``tree``: a source folder to import attnroll from (another checkout, for a before /
    after comparison); None = this one."""
    out = work / f"out-cli-{engine}-{workers}-{method}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "attnroll.commands", "batch", str(src), "--out", str(out), "-m", method,
           "--batch-size", str(batch_size), "--engine", engine]
    if engine == "ray":
        cmd += ["--num-workers", str(workers), "--cpus-per-worker", str(max(1, (os.cpu_count() or 1) // workers))]
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    t0 = time.time()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return shard_timing(out, t0, time.time(), workers)


@contextlib.contextmanager
def local_cluster(cpus: int) -> Iterator[tuple[str, float]]:
    """A Ray cluster on this machine, started with ``ray start --head --block`` in its own session (so that
    only what it started is stopped afterwards); yields (its address, seconds it took to start)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # its own temp dir: `ray start` records its address there, where a plain ray.init() elsewhere on the
    # machine (another program's) would otherwise find it and join this cluster
    temp = tempfile.mkdtemp(prefix="rb-", dir="/tmp")
    cmd = [ray_cli, "start", "--head", "--block", f"--port={port}", f"--num-cpus={cpus}", "--include-dashboard=false",
           "--disable-usage-stats", f"--temp-dir={temp}"]
    # `ray start` turns token authentication on when ~/.ray/auth_token exists, which ray.init() does not
    # follow: the benchmark's cluster runs without it, as the job's own local runtime does
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        for line in proc.stdout:
            if "Ray runtime started" in line:
                break
        else:
            raise RuntimeError(f"ray start exited ({proc.wait()}) before the runtime started")
        started = time.perf_counter() - t0
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
        yield f"127.0.0.1:{port}", started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="shapes,vit-b16")
    ap.add_argument("--n-shapes", type=int, default=4000)
    ap.add_argument("--n-vit", type=int, default=64)
    ap.add_argument("--vit-batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--methods", default="rollout,gae")
    ap.add_argument("--ray", default="fresh,joined", help="Ray configurations: fresh (the runtime started by "
                    "the job), joined (a running cluster, --address), or none")
    ap.add_argument("--workers", default="1,2", help="Ray actors per configuration")
    ap.add_argument("--breakdown", action="store_true", help="where a batch's time goes, per step")
    ap.add_argument("--interleaved", action="store_true", help="also the batch-by-batch local / plain ratio")
    ap.add_argument("--interleaved-only", action="store_true",
                    help="only the batch-by-batch ratio of the local engine to the plain loop")
    ap.add_argument("--cli", action="store_true", help="time the command itself (`attnroll batch`, cold "
                    "processes: local and --engine ray with each --workers) instead of the configurations")
    ap.add_argument("--ref", help="also a reference source tree (e.g. /work/main/src), alternating: the local engine "
                    "beside this tree's (with --cli: every configuration)")
    ap.add_argument("--threads", type=int, help="torch threads of the plain loop and the local engine (default: "
                    "torch's, one per core); Ray actors share the cores as always")
    ap.add_argument("--image-cache", help="a folder where the generated PNGs are kept and reused (a large "
                    "--n-shapes takes minutes to generate), e.g. /tmp/attnroll-bench-images")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one configuration, in a child process
    args = ap.parse_args()
    if args.one:
        return run_one(json.loads(args.one))
    work = Path(tempfile.mkdtemp(prefix="attnroll-bench-batch-"))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; "
          f"load before: {os.getloadavg()}")
    modes = [] if args.ray == "none" or args.interleaved_only or args.cli else args.ray.split(",")
    workers = [int(k) for k in args.workers.split(",")]
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        address, cluster_s = None, float("nan")
        if "joined" in modes:
            address, cluster_s = stack.enter_context(local_cluster(os.cpu_count() or 1))
            print(f"# joined cluster at {address}: `ray start --head` took {cluster_s:.1f} s")
        for name in args.models.split(","):
            run_model(name, args, modes, workers, address, work)
    print(f"# load after: {os.getloadavg()}")


def run_model(name: str, args: argparse.Namespace, modes: list[str], workers: list[int], address: str | None,
              work: Path) -> None:
    """Every configuration on one model, --repeat times alternating; prints its table."""
    n, bs = (args.n_shapes, 32) if name == "shapes" else (args.n_vit, args.vit_batch)
    spec = None if name == "shapes" else str(vit_b16_dir(work / "vit-b16"))
    src = shapes_images(work, n, args.image_cache)
    files = sorted(src.glob("*.png"))
    methods = args.methods.split(",")
    for method in methods:
        if args.breakdown:
            parts = breakdown(spec, files, bs, method, work)
            print(f"# {name} {method}: ms per batch of {bs}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
        if args.interleaved or args.interleaved_only:
            ratio = interleaved(spec, files, bs, method, work)
            print(f"# {name} {method}: local engine / plain loop, batch by batch interleaved: {ratio:.2f}x")
    if args.interleaved_only:
        return
    if args.cli:
        return run_cli(name, n, bs, src, methods, workers, args, work)
    configs = [("plain", None, "local", 1, None)]
    for method in methods:
        configs.append(("local", method, "local", 1, None))
        if args.ref:  # the same engine from another tree, right after (the ratio to the same plain loop)
            configs.append(("local@ref", method, "local", 1, None))
        for mode in modes:
            for k in workers:
                configs.append((f"ray-{k}" + ("@addr" if mode == "joined" else ""), method, "ray", k,
                                address if mode == "joined" else None))
    best: dict = {}
    rounds: list[dict] = []
    for r in range(args.repeat):
        rounds.append({})
        for label, method, engine, k, addr in in_round_order(configs, r):
            one = {"src": str(src), "spec": spec, "method": method, "bs": bs, "engine": engine, "workers": k,
                   "work": str(work), "address": addr, "plain": label == "plain", "threads": args.threads}
            t = isolated(one, args.ref if label.endswith("@ref") else None)
            if t is None:
                continue
            print(f"#   {name} {label} {method or ''}: {t.seconds:.1f} s, start-up {t.startup:.1f} s, "
                  f"steady {t.steady:.1f}/s (load {os.getloadavg()[0]:.1f})")
            sys.stdout.flush()
            rounds[-1][(label, method)] = t
            if (label, method) not in best or t.seconds < best[(label, method)].seconds:
                best[(label, method)] = t
    report(name, n, bs, best, methods)
    report_paired(rounds, methods)


def in_round_order(configs: list[tuple], r: int) -> list[tuple]:
    """The configurations of round ``r``: the plain loop first, then on odd rounds each method's local engine
    and its ``@ref`` twin swapped, so that neither tree always runs right after the plain loop (in two earlier
    runs the second run of a round came out ~0.1x faster than the third whichever tree it was; a
    run with the same tree in both places, at load 3, showed no consistent order effect)."""
    if r % 2 == 0:
        return list(configs)
    out = list(configs)
    for i, c in enumerate(out[:-1]):
        if c[0] == "local" and out[i + 1][0] == "local@ref":
            out[i], out[i + 1] = out[i + 1], c
    return out


def report_paired(rounds: list[dict], methods: list[str]) -> None:
    """Per round, each local engine's end-to-end rate over that round's plain loop, and their median
    ("paired": load that drifts between rounds cancels within one)."""
    for method in methods:
        for label in ("local", "local@ref"):
            ratios = [rd[(label, method)].rate / rd[("plain", None)].rate for rd in rounds
                      if (label, method) in rd and ("plain", None) in rd]
            if ratios:
                print(f"# paired {method} {label} / plain per round: " + ", ".join(f"{x:.2f}" for x in ratios)
                      + f"; median {statistics.median(ratios):.2f}x")
    sys.stdout.flush()


def run_cli(name: str, n: int, bs: int, src: Path, methods: list[str], workers: list[int], args: argparse.Namespace,
            work: Path) -> None:
    """``--cli``: the command itself (cold processes), local and Ray with each worker count, this tree and, with
    --ref, the reference tree, alternating, --repeat times; prints each run and a table of the best."""
    trees = [("this", None)] + ([("ref", args.ref)] if args.ref else [])
    best: dict = {}
    for _ in range(args.repeat):
        for method in methods:
            for engine, k in [("local", 1)] + [("ray", k) for k in workers if args.ray != "none"]:
                for label, tree in trees:
                    t = cli_run(src, method, bs, engine, k, work, tree)
                    key = (label, method, engine if engine == "local" else f"ray-{k}")
                    print(f"#   cli {name} {'/'.join(key)}: {t.seconds:.1f} s, start-up {t.startup:.1f} s, "
                          f"steady {t.steady:.1f}/s (load {os.getloadavg()[0]:.1f})")
                    sys.stdout.flush()
                    if key not in best or t.seconds < best[key].seconds:
                        best[key] = t
    print(f"\n## {name} via `attnroll batch` (cold processes): {n} images, batch {bs}\n")
    print("| tree | method | engine | end to end (inputs/s) | start-up (s) | steady (inputs/s) | end to end vs local |")
    print("|---|---|---|---|---|---|---|")
    for (label, method, eng), t in best.items():
        loc = best[(label, method, "local")]
        print(f"| {label} | {method} | {eng} | {t.rate:.2f} | {t.startup:.2f} | {t.steady:.2f} | "
              f"{t.rate / loc.rate:.2f}x |")
    sys.stdout.flush()


def isolated(one: dict, tree: str | None = None) -> "Timing | None":
    """One timed configuration in a fresh Python process, as a user's command runs (and no Ray state left
    over from another configuration): it loads the model once untimed (so that no configuration pays the
    first imports of torch and transformers; Ray's actors, fresh processes, still pay theirs), then times.
    ``tree``: a source folder to import attnroll from (``--ref``); None = this one. A failed run is
    reported and retried once."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for attempt in (1, 2):
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(one)], capture_output=True, text=True,
                              env=env)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines:
            return Timing(**json.loads(lines[-1]))
        print(f"#   FAILED (attempt {attempt}): {one['engine']} {one['workers']} {one['address']}: "
              f"{(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    return None


def run_one(one: dict) -> None:
    """``--one``: the body of :func:`isolated`; prints the Timing as JSON."""
    from attnroll.models import load_model

    if one.get("threads"):  # the plain loop's and the local engine's; Ray actors take --cpus-per-worker
        torch.set_num_threads(one["threads"])
    load_model(one["spec"], None, want="image")
    src, work = Path(one["src"]), Path(one["work"])
    if one["plain"]:
        t = plain_loop(one["spec"], src, one["bs"])
    else:
        t = batch_run(src, one["spec"], one["method"], one["bs"], one["engine"], one["workers"], work, one["address"])
    print(json.dumps(t.__dict__))


def report(name: str, n: int, bs: int, best: dict, methods: list[str]) -> None:
    """A markdown table: inputs/s end to end, start-up, steady, and each ratio (engines: to the plain loop;
    Ray: to the local engine), and for Ray the dataset size at which it would reach 0.8x the local engine
    end to end (:func:`size_for_ratio`)."""
    plain = best[("plain", None)]
    print(f"\n## {name}: {n} images, batch {bs}\n")
    print("| method | configuration | end to end (inputs/s) | start-up (s) | steady (inputs/s) | ratio end to end "
          "| ratio steady | fixed cost (s) | 0.8x local end to end from |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| - | plain loop | {plain.rate:.2f} | {plain.startup:.2f} | {plain.steady:.2f} | | | "
          f"{plain.fixed:.1f} | |")
    for method in methods:
        loc = best.get(("local", method))
        if loc is None:
            continue
        for label in ("local", "local@ref"):
            t = best.get((label, method))
            if t is not None:
                print(f"| {method} | {label} | {t.rate:.2f} | {t.startup:.2f} | {t.steady:.2f} | "
                      f"{t.rate / plain.rate:.2f}x plain | {t.steady / plain.steady:.2f}x plain | {t.fixed:.1f} | |")
        for (label, m), t in best.items():
            if m == method and label.startswith("ray"):
                at = size_for_ratio(t, loc, 0.8)
                print(f"| {method} | {label} | {t.rate:.2f} | {t.startup:.2f} | {t.steady:.2f} | "
                      f"{t.rate / loc.rate:.2f}x local | {t.steady / loc.steady:.2f}x local | {t.fixed:.1f} | "
                      f"{'never (steady below 0.8x)' if at is None else f'{at:,.0f} inputs'} |")
    sys.stdout.flush()


def size_for_ratio(ray: "Timing", local: "Timing", ratio: float) -> float | None:
    """The number of inputs N from which Ray's end-to-end rate is at least ``ratio`` x the local engine's, each
    run modelled as its fixed cost plus N / its steady rate (:attr:`Timing.fixed`): the N solving
    local.fixed + N / local.steady = ratio * (ray.fixed + N / ray.steady); 0 when Ray is there from the
    start, None when its steady rate is below ``ratio`` x local's (it never gets there)."""
    gain = 1 / local.steady - ratio / ray.steady  # seconds per input that Ray's fixed cost is paid back with
    if not gain > 0:
        return None
    return max(0.0, (ratio * ray.fixed - local.fixed) / gain)


if __name__ == "__main__":
    main()
