"""The two engines: the local one (this process, batch after batch) and Ray Data (an actor pool, each
actor loading the model once). Both hand every batch to a :class:`~attnroll.batch.work.Worker`, which
explains, writes and commits it, so both produce the same rows."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .sources import Item
from .work import Job, Worker

RAY_INSTALL = "pip install 'attnroll[ray]'  (Ray Data 2.60: pip install 'ray[data]==2.60.0')"


@dataclass(frozen=True)
class ModelSpec:
    """How to load the model (in this process or in a Ray actor): ``name`` as ``attnroll explain --model``
    takes it (None = the embedded model of ``kind``), ``weights`` for a timm architecture."""

    name: str | None = None
    weights: str | None = None
    kind: str = "image"

    def load(self) -> Any:
        """The loaded model (``.model``, ``.kind``, ``.prepare_image``, ``.tokenizer``, ``.labels``)."""
        from ..models import load_model

        return load_model(self.name, self.weights, want=self.kind)


def chunks(items: list[Item], size: int) -> Iterator[list[Item]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def run_local(worker: Worker, todo: list[Item], batch_size: int, progress: Callable[[dict], None]) -> None:
    """Explain ``todo`` in this process, ``batch_size`` inputs per commit. A second thread reads and
    preprocesses the next batch while the model explains the current one (image decoding releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    batches = list(chunks(todo, batch_size))
    if not batches:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnroll-read") as pool:
        pending = pool.submit(worker.load, batches[0])
        for nxt in batches[1:] + [None]:
            loaded = pending.result()
            if nxt is not None:
                pending = pool.submit(worker.load, nxt)
            progress(worker.finish(loaded))


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError(f"--engine ray needs Ray Data: {RAY_INSTALL}") from None
    return ray


class RayWorker:
    """The ``map_batches`` actor: loads the model once, then explains, writes and commits each batch it gets
    and returns the batch's counts (the driver only sees counts, never the maps)."""

    def __init__(self, spec: ModelSpec, job: Job, threads: int):
        import torch

        torch.set_num_threads(max(1, int(threads)))
        self.worker = Worker(spec.load(), job)

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        items = [Item(int(i), str(d), str(k), path=_opt(p), text=_opt(t), pair=_opt(q)) for i, d, k, p, t, q in
                 zip(batch["index"], batch["id"], batch["kind"], batch["path"], batch["text"], batch["pair"])]
        counts = self.worker(items)
        return {k: np.array([v]) for k, v in counts.items()}


def _opt(v: Any) -> str | None:
    return None if v is None or (isinstance(v, float) and v != v) else str(v)


def run_ray(spec: ModelSpec, job: Job, todo: list[Item], batch_size: int, progress: Callable[[dict], None], *,
            num_workers: int = 1, address: str | None = None, cpus_per_worker: int | None = None) -> None:
    """Explain ``todo`` with Ray Data: ``from_items`` → ``map_batches`` over a pool of ``num_workers`` actors
    → each actor commits Parquet shards into ``job.out`` (a folder every node can write, on a cluster).
    Joins the cluster at ``address``; without one, uses a Ray runtime already started in this process, or
    starts a local one (``num_cpus`` = workers × cpus per worker, no dashboard) and stops it afterwards."""
    ray = import_ray()
    if cpus_per_worker is None:
        cpus_per_worker = 1 if address else max(1, (os.cpu_count() or 1) // num_workers)
    started = False
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        else:
            ray.init(num_cpus=num_workers * cpus_per_worker, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)
        started = True
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.from_items([it.as_dict() for it in todo])
        out = ds.map_batches(RayWorker, batch_size=batch_size, batch_format="numpy",
                             compute=ray.data.ActorPoolStrategy(size=num_workers),
                             num_cpus=cpus_per_worker,
                             fn_constructor_kwargs={"spec": spec, "job": job, "threads": cpus_per_worker})
        quiet = logging.getLogger("ray.data")
        level, quiet.level = quiet.level, logging.ERROR  # no execution-plan chatter on the user's terminal
        try:
            for counts in out.iter_rows():
                progress({k: int(v) for k, v in counts.items()})
        finally:
            quiet.setLevel(level)
    finally:
        if started:
            ray.shutdown()
