"""The two engines: the local one (this process, batch after batch) and Ray Data (an actor pool, each
actor loading the model once). Both hand every batch to a :class:`~attnroll.batch.work.Worker`, which
explains, writes and commits it, so both produce the same rows."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterable, Iterator

from .sources import Item
from .work import Job, Worker

RAY_INSTALL = "pip install 'attnroll[ray]'  (Ray Data 2.60: pip install 'ray[data]==2.60.0')"


@dataclass(frozen=True)
class ModelSpec:
    """How to load the model (in this process or in a Ray actor): ``name`` as ``attnroll explain --model``
    takes it (None = the embedded model of ``kind``), ``weights`` for a timm architecture;
    ``trust_remote_code`` / ``allow_partial_weights`` as :func:`attnroll.models.load_model` takes them."""

    name: str | None = None
    weights: str | None = None
    kind: str = "image"
    trust_remote_code: bool = False
    allow_partial_weights: bool = False

    def __post_init__(self) -> None:
        if self.weights is not None:  # a path object: kept as text (the manifest is JSON)
            object.__setattr__(self, "weights", os.fspath(self.weights))

    def load(self) -> Any:
        """The loaded model (``.model``, ``.kind``, ``.prepare_image``, ``.tokenizer``, ``.labels``)."""
        from ..models import load_model

        return load_model(self.name, self.weights, want=self.kind, trust_remote_code=self.trust_remote_code,
                          allow_partial_weights=self.allow_partial_weights)


def chunks(items: list[Item], size: int) -> Iterator[list[Item]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def read_ahead(load: Callable[[Any], Any], batches: Iterable[Any], depth: int = 2) -> Iterator[Any]:
    """``load(batch)`` for each batch, in order, computed by a reader thread up to ``depth`` batches ahead of
    the consumer (image decoding and Parquet reading release the GIL). Used by the local engine and by the
    benchmark's plain loop, so that both read the same way."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnroll-read")
    it = iter(batches)
    try:
        queue = deque(pool.submit(load, b) for b in islice(it, depth))
        while queue:
            ready = queue.popleft().result()
            for b in islice(it, 1):
                queue.append(pool.submit(load, b))
            yield ready
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


#: The local engine's default shard: at most this many inputs (whole batches) per committed shard. Each shard
#: costs a fixed ~1 ms of CPU (file, Parquet footer, rename, fsync) on a 2-core machine's shared cores; measured
#: on the shapes ViT (batches of 32, docs/research/batch-engine.md): 1.2-1.4 ms per batch committed alone,
#: 0.3-0.5 ms per batch in shards of 8 batches. Larger shards also suit Parquet readers (fewer, larger files).
SHARD_INPUTS = 256
#: ... and a shard is committed once explaining its batches took this many seconds, whatever its size: a crash
#: or ``kill -9`` loses at most about this much work, or one batch of a model slower than that.
SHARD_SECONDS = 1.0


def run_local(worker: Worker, todo: list[Item], batch_size: int, progress: Callable[[dict], None],
              shard_size: int | None = None, shard_seconds: float = SHARD_SECONDS) -> None:
    """Explain ``todo`` in this process, ``batch_size`` inputs per ``explain`` call: a reader thread reads and
    preprocesses the next batches, this thread explains, a writer thread commits the previous shard (at most
    one shard waits; an input counts as done once its shard is committed). A shard holds the whole batches
    explained since the last one, up to ``shard_size`` inputs (None: :data:`SHARD_INPUTS`; at least one
    batch), committed earlier once its batches took ``shard_seconds`` to explain. Ctrl-C commits what was explained
    before it stops. The capture sessions stay open for the run (``Worker.kept_sessions``)."""
    from concurrent.futures import ThreadPoolExecutor

    per_shard = max(1, (SHARD_INPUTS if shard_size is None else shard_size) // batch_size)
    with (
        heap_frozen(),
        worker.kept_sessions(),
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnroll-write") as writer,
    ):
        pending, group, since = None, [], 0.0

        def commit(shard: list[tuple]) -> None:  # after the previous shard: at most one waits
            nonlocal pending
            if pending is not None:
                progress(pending.result())
            pending = writer.submit(worker.commit, merged(shard))

        try:
            for loaded in read_ahead(worker.load, chunks(todo, batch_size)):
                # the clock starts with the shard's first batch, so that a slow batch is committed at once
                since = since if group else time.monotonic()
                group.append(worker.compute(loaded))
                if len(group) >= per_shard or time.monotonic() - since >= shard_seconds:
                    commit(group)
                    group = []
        except KeyboardInterrupt:
            if group:  # what was explained is kept: the rerun does not explain it again
                writer.submit(worker.commit, merged(group)).result()
            raise
        if group:
            commit(group)
        if pending is not None:
            progress(pending.result())

def merged(computed: list[tuple]) -> tuple:
    """One shard's :meth:`Worker.compute` result from consecutive batches' results (in source order)."""
    if len(computed) == 1:
        return computed[0]
    return tuple([x for c in computed for x in c[k]] for k in range(3))


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Keep the objects that exist now (the imported libraries and the loaded model: ~430,000 for the
    embedded model) out of the garbage collector's full collections during the block, and hand them back
    afterwards (``gc.freeze`` / ``gc.unfreeze``). A process that has just imported torch and transformers
    holds them uncollected in its young generations, so the run's own allocations trigger one full
    collection of all of them (measured: 0.17-0.25 s, ~5 % of a 4,000-image run of the shapes model); the
    frozen objects are skipped by it, and are ordinary objects again after the block, so the caller's process
    collects them as it would have. Nothing is collected less: garbage made during the block is not frozen,
    and what was garbage before it is freed once the block ends. A process that froze objects itself
    (``gc.get_freeze_count() > 0``, e.g. a pre-fork server) is left alone."""
    import gc

    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _needs_ray() -> str:
    return f"--engine ray needs Ray Data: {RAY_INSTALL}"


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError(_needs_ray()) from None
    return ray


def check_ray() -> None:
    """Raise the ImportError of :func:`import_ray` when Ray Data is not installed, without importing it
    (importing ``ray.data`` takes seconds: :class:`RayStart` does it in the background)."""
    from importlib.util import find_spec

    spec = find_spec("ray")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not any(os.path.isdir(os.path.join(loc, "data")) for loc in locations) or find_spec("pyarrow") is None:
        raise ImportError(_needs_ray())


def ray_cpus(address: str | None, num_workers: int, cpus_per_worker: int | None) -> int:
    """CPUs (torch threads) per Ray actor: as given, else 1 on a cluster (``address``) and this machine's
    CPUs shared between the ``num_workers`` actors without one."""
    if cpus_per_worker is not None:
        return cpus_per_worker
    return 1 if address else max(1, (os.cpu_count() or 1) // num_workers)


def begin_ray(address: str | None, num_workers: int, cpus_per_worker: int | None) -> "RayStart":
    """The runtime for ``num_workers`` actors of :func:`ray_cpus` CPUs each, starting in the background."""
    return RayStart(address, num_workers * ray_cpus(address, num_workers, cpus_per_worker))


class RayStart:
    """The Ray runtime started (or joined) in a background thread, then Ray Data imported there, so that the
    driver lists the source, loads and fingerprints the model and scans the output meanwhile: on one
    machine ``ray.init`` spends seconds starting the runtime's processes, most of it waiting on them.
    :meth:`wait` returns whether this start began the runtime (re-raising what starting raised);
    :meth:`stop` stops a runtime this start began. A runtime already running in this process is used as
    it is (and left running).

    The thread lives until :meth:`stop` and shuts the runtime down itself: Ray ties the processes it starts
    to the thread that started them (Linux's parent-death signal is per thread), so a thread that ended
    after ``ray.init`` would take the runtime's GCS and raylet with it."""

    def __init__(self, address: str | None, num_cpus: int):
        import threading

        self.address, self.num_cpus = address, num_cpus
        self.started = False
        self._error: BaseException | None = None
        self._ready, self._done = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="attnroll-ray-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import ray  # the core only: the runtime's processes start before Ray Data is imported

            self.started = start_ray(ray, self.address, self.num_cpus)
            import_ray()
        except BaseException as e:  # noqa: BLE001 - handed to the driver's thread by wait()
            self._error = e
        finally:
            self._ready.set()
        self._done.wait()
        if self.started:
            import ray

            ray.shutdown()

    def wait(self) -> bool:
        """Block until the runtime runs; whether this start began (or joined) it."""
        self._ready.wait()
        if self._error is not None:
            if isinstance(self._error, ImportError):
                raise ImportError(_needs_ray()) from self._error
            raise self._error
        return self.started

    def stop(self) -> None:
        """Stop the runtime if this start began it (after its start has finished); idempotent."""
        self._ready.wait()
        self._done.set()
        self._thread.join()
        self.started = False


#: Calls of one actor running at once: one reading the next batch, one explaining, one committing the last.
ACTOR_CALLS = 3
#: At most this many Ray blocks (beyond it a block holds several batches, which its call runs one by one);
#: one block per batch below it, so that each call is one batch.
MAX_BLOCKS = 10_000


class RayWorker:
    """The ``map_batches`` actor: loads the model once, then explains, writes and commits each batch it gets
    and returns the batch's counts (the driver only sees counts, never the maps).

    Ray Data runs up to :data:`ACTOR_CALLS` calls of one actor at once, in threads; the model step holds a
    lock, so that the actor overlaps like the local engine: while one batch is explained, the next is
    decoded and the previous one committed (decoding and Parquet writing release the GIL). Each call commits
    its own shard before it returns, so a batch is either wholly committed or not at all."""

    def __init__(self, spec: ModelSpec, job: Job, threads: int, num_gpus: float = 0.0):
        import threading

        import torch

        torch.set_num_threads(max(1, int(threads)))
        lm = spec.load()
        if num_gpus and torch.cuda.is_available():  # Ray set CUDA_VISIBLE_DEVICES to this actor's GPU
            lm.model.to("cuda")
        self.worker = Worker(lm, job)
        self.model_lock = threading.Lock()

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        loaded = self.worker.load(batch_items(batch))
        with self.model_lock:  # one explain at a time: it hooks the model, and the CPUs (or GPU) are the model's
            computed = self.worker.compute(loaded)
        counts = self.worker.commit(computed)
        return {k: np.array([v]) for k, v in counts.items()}


def batch_rows(todo: list[Item], batch_size: int) -> list[dict]:
    """The rows of the Ray dataset: one per batch of ``batch_size`` items (their :meth:`Item.as_dict` as
    JSON), so that every actor call explains and commits exactly the batch the local engine would, whatever
    Ray Data's block sizes."""
    return [{"first": chunk[0].index, "items": json.dumps([it.as_dict() for it in chunk])}
            for chunk in chunks(todo, batch_size)]


def batch_items(batch: dict) -> list[Item]:
    """The items of a Ray Data batch of :func:`batch_rows` rows (numpy columns), in order."""
    return [Item(int(d["index"]), str(d["id"]), str(d["kind"]), path=d["path"], text=d["text"], pair=d["pair"],
                 target=None if int(d["target"]) < 0 else int(d["target"]))
            for row in batch["items"] for d in json.loads(str(row))]


def map_batches_options(spec: ModelSpec, job: Job, cpus_per_worker: int, num_gpus: float = 0.0,
                        restart: bool = False) -> dict[str, Any]:
    """The keyword arguments of ``Dataset.map_batches`` (besides the actor class and its compute strategy,
    :func:`actor_pool`): one :func:`batch_rows` row per call, actors of ``cpus_per_worker`` CPUs and
    ``num_gpus`` GPUs each (0: CPU only; a fraction packs several actors on one GPU), each built with the
    model spec and the job. ``restart`` keeps Ray Data's restart of a lost actor (on a cluster, where a node
    can go away); on one machine an actor that dies is not restarted (a rerun resumes the output), which also
    spares the C++ warning Ray prints for restartable actors."""
    opts: dict[str, Any] = {
        "batch_size": 1, "batch_format": "numpy", "num_cpus": cpus_per_worker,
        "fn_constructor_kwargs": {"spec": spec, "job": job, "threads": cpus_per_worker, "num_gpus": num_gpus},
    }
    if num_gpus:
        opts["num_gpus"] = num_gpus
    if not restart:
        opts["max_restarts"] = 0
    return opts


def actor_pool(ray: Any, num_workers: int) -> Any:
    """A fixed pool of ``num_workers`` actors, each running :data:`ACTOR_CALLS` calls at once in threads
    (``RayWorker`` serialises the model step itself) and sent as many batches ahead."""
    return ray.data.ActorPoolStrategy(size=num_workers, max_concurrent_calls_per_actor=ACTOR_CALLS,
                                      max_tasks_in_flight_per_actor=ACTOR_CALLS, enable_true_multi_threading=True)


def start_ray(ray: Any, address: str | None, num_cpus: int) -> bool:
    """Join the cluster at ``address``, or start a local Ray runtime of ``num_cpus`` CPUs (no dashboard, no
    log forwarding), unless one runs in this process already; whether this call started (or joined) it.
    Without ``address`` the runtime is always a new one (``address="local"``): a plain ``ray.init()`` would
    join whatever cluster ``ray start`` last started on this machine (another user's, or a benchmark's)."""
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR, "configure_logging": True}
    if address:
        ray.init(address=address, **quiet)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
    return True


def run_ray(spec: ModelSpec, job: Job, todo: list[Item], batch_size: int, progress: Callable[[dict], None], *,
            num_workers: int = 1, address: str | None = None, cpus_per_worker: int | None = None,
            num_gpus: float = 0.0, ray_start: RayStart | None = None) -> None:
    """Explain ``todo`` with Ray Data: ``from_items`` (one row per batch; one block per batch, up to
    :data:`MAX_BLOCKS`) → ``map_batches`` over a pool of ``num_workers`` actors → each actor commits Parquet
    shards into ``job.out`` (a folder every node can write, on a cluster). Joins the cluster at ``address``;
    without one, uses a Ray runtime already started in this process, or starts a new local one (``num_cpus``
    = workers × CPUs per worker, no dashboard) and stops it afterwards. ``cpus_per_worker`` (torch threads
    per actor): see :func:`ray_cpus`. ``ray_start``: the runtime already being started (by the caller, in
    the background), which this call waits for and stops when that start began it."""
    cpus_per_worker = ray_cpus(address, num_workers, cpus_per_worker)
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    if ray_start is None:
        ray_start = begin_ray(address, num_workers, cpus_per_worker)
    try:
        rows = batch_rows(todo, batch_size)  # while the runtime may still be starting (0.5 s at 50,000 inputs)
        ray_start.wait()
        ray = import_ray()
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), MAX_BLOCKS)))
        with warnings.catch_warnings():  # max_restarts has no named parameter in Ray 2.60 yet
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            out = ds.map_batches(RayWorker, compute=actor_pool(ray, num_workers),
                                 **map_batches_options(spec, job, cpus_per_worker, num_gpus, restart=bool(address)))
        with _quiet_ray_data():
            for counts in out.iter_rows():
                progress({k: int(v) for k, v in counts.items()})
    finally:
        ray_start.stop()


@contextlib.contextmanager
def _quiet_ray_data() -> Iterator[None]:
    """No execution-plan chatter from Ray Data's Python loggers on the user's terminal."""
    loggers = [logging.getLogger(n) for n in ("ray.data", "ray")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)
