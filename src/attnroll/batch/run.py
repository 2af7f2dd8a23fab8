"""``run_batch``: explain every input of a source into a resumable Parquet dataset.

The run's *key* — the source, the column, the model's fingerprint, the methods and their resolved options —
is stored in the manifest. A rerun with the same key explains only the inputs that no committed shard
holds; a different key is refused (:class:`BatchMismatchError`) unless ``overwrite=True``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .. import _checks
from . import store
from .engines import ModelSpec, RayStart, begin_ray, run_local, run_ray
from .fingerprint import model_fingerprint
from .sources import Item, list_items, source_fingerprint
from .work import Job, Worker, has_class_scores, overlay_name

ENGINES = ("local", "ray")


class BatchMismatchError(ValueError):
    """The output folder holds results of another model, method set, options or source."""


@dataclass
class BatchResult:
    """What a run did: ``inputs`` in the source, ``done_before`` already committed (explained or failed) by
    earlier runs, ``explained`` now (inputs of this run with their rows and no failure), ``failed`` (all
    runs) inputs in the failures table, ``rows`` in total, ``seconds`` of this run and its throughput
    ``rate`` (inputs explained now per second); ``failed_now``: the inputs of this run that failed (for every
    method or some); ``missing``: inputs that no shard holds (0 after a completed run)."""

    out: str
    inputs: int
    done_before: int
    explained: int
    failed: int
    rows: int
    seconds: float
    failed_now: int = 0
    missing: int = 0

    @property
    def rate(self) -> float:
        return self.explained / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """One line: inputs, what this run explained and what failed, throughput, the output's totals."""
        resumed = f" ({self.done_before} done before)" if self.done_before else ""
        line = (f"{self.inputs} inputs{resumed}: {self.explained} explained now, {self.failed_now} failed in "
                f"{self.seconds:.1f} s ({self.rate:.1f}/s)")
        if self.failed != self.failed_now:
            line += f"; {self.failed} failed in all"
        if self.missing:
            line += f"; {self.missing} missing (rerun to complete)"
        return f"{line}; {self.rows} rows in {self.out}"


def resolve_methods(methods: Sequence[str] | str, options: dict | None) -> tuple[list[str], dict[str, dict]]:
    """Method names (validated, in order) and each one's options ({method: {key: value}}, checked by the
    method registry) with defaults filled in."""
    from ..methods import check_options

    names = _checks.check_method_names("methods", methods)
    options = _checks.check_method_options("options", options, names)
    return names, {m: check_options(m, dict(options.get(m, {}))) for m in names}


def run_key(source: Any, column: str | None, fingerprint: str, names: list[str], options: dict,
            target: int | None = None, target_column: str | None = None) -> dict:
    """What must match for a rerun to add to an existing output (JSON-comparable). The target settings are
    part of it only when given, so that outputs of earlier versions (predicted class) still resume."""
    from ..explain.explanation import jsonable

    key = {"source": str(Path(source).resolve()), "column": column, "model": fingerprint, "methods": names,
           "options": json.loads(json.dumps(jsonable(options), sort_keys=True))}
    if target is not None or target_column is not None:
        key["target"] = {"class": target, "column": target_column}
    return key


#: How to proceed when an output cannot be resumed.
_PROCEED = "rerun with the same settings to complete it, or pass --overwrite (overwrite=True) to start over"


def _key_diff(old: dict, key: dict) -> str:
    """What differs between two run keys ("" when nothing)."""
    diff = [k for k in sorted(set(key) | set(old)) if old.get(k) != key.get(k)]
    return "; ".join(f"{k}: {json.dumps(old.get(k))} before, {json.dumps(key.get(k))} now" for k in diff)


def check_resumable(meta: dict | None, key: dict, out: Path) -> None:
    """Refuse to mix: the stored key must equal ``key``; the message says what differs and how to proceed."""
    if meta is None:
        return
    what = _key_diff(meta.get("key", {}), key)
    if what:
        raise BatchMismatchError(f"{out} holds results of a different run ({what}); {_PROCEED}")


def check_shards(shards: list[store.Shard], key: dict, source_fp: str, items: list[Item], out: Path,
                 manifest: bool) -> None:
    """Refuse to add to shards that another run made, or that a changed source made: each shard's own record
    (:func:`store.shard_meta`) must name this run's key and source fingerprint, and every input it holds
    must be at the same position in the source now. A shard of an earlier version (no record) is trusted
    only under a ``manifest`` that matched the key. BatchMismatchError says which shard and why."""
    where = {it.id: it.index for it in items}
    for s in shards:
        for i, index in s.entries:
            if where.get(i) != index:
                now = "is no longer in it" if i not in where else f"is now at position {where[i]}"
                raise BatchMismatchError(f"the source changed since {out} was made: input {i!r} of {s.path} was at "
                                         f"position {index} and {now}; pass --overwrite (overwrite=True) to start "
                                         "over, or write to another output folder")
        if s.meta is None:
            if not manifest:
                raise BatchMismatchError(f"{out} has no {store.MANIFEST} and its shard {s.path.name} does not record "
                                         "what made it (an earlier version); restore the manifest to resume, or "
                                         "pass --overwrite (overwrite=True) to start over")
            continue
        what = _key_diff(s.meta.get("key", {}), key)
        if what:
            raise BatchMismatchError(f"{s.path} holds results of a different run ({what}); {_PROCEED}")
        if s.meta.get("source_fingerprint") != source_fp:
            raise BatchMismatchError(f"the source changed since {s.path} was made (inputs added, removed, renamed "
                                     "or edited); pass --overwrite (overwrite=True) to start over, or write to "
                                     "another output folder")


def run_batch(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    methods: Sequence[str] | str = ("rollout",),
    options: dict | None = None,
    model: str | None = None,
    weights: str | os.PathLike | None = None,
    loaded: Any = None,
    engine: str = "local",
    batch_size: int = 16,
    shard_size: int | None = None,
    num_workers: int = 1,
    address: str | None = None,
    png: bool = False,
    column: str | None = None,
    target: int | None = None,
    target_column: str | None = None,
    num_gpus: float = 0.0,
    cpus_per_worker: int | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    command: str | None = None,
    ray_start: RayStart | None = None, trust_remote_code: bool = False, allow_partial_weights: bool = False,
) -> BatchResult:
    """Explain every input of ``source`` with each of ``methods`` and write a Parquet dataset into ``out``.

    Args:
        source: an image folder (recursive), a text file (a tab separates a pair), a JSONL file (``text``,
            ``pair``, ``id``) or a Parquet / CSV table (``column``: its column of paths or texts, or "text,pair").
        out: the output folder (created); see :mod:`attnroll.batch.store` for its layout.
        methods: method names; options: {method: {key: value}}.
        model / weights / trust_remote_code / allow_partial_weights: as ``attnroll.models.load_model`` takes
            them (None = the embedded model); ``loaded``: that model already loaded, not loaded again here.
        engine: "local" (this process) or "ray" (Ray Data actors; ``num_workers`` of them; ``address`` joins
            a running cluster). batch_size: inputs per ``explain`` call (and per shard on Ray); shard_size: the
            local engine's inputs per shard at most (whole batches; None = 256; sooner after a second's work).
        png: also write overlays to ``out/png/`` (images). overwrite: discard an existing output of a
            different run instead of refusing. progress: called with (inputs finished, inputs to do).
        target: the class index to explain for every input (None = each input's predicted class);
            target_column: a table column (or JSONL field) of class indices, one per input (an empty cell =
            the predicted class). Class targets need a model with class scores.
        num_gpus: GPUs per Ray actor (a fraction such as 0.25 packs four actors on one GPU; 0 = CPU);
            the actor moves its model to its GPU. Ray engine only.
        cpus_per_worker: CPUs (torch threads) per Ray actor; None = 1 on a cluster (``address``), else this
            machine's CPUs shared between the ``num_workers`` actors. Ray engine only.
        ray_start: the Ray runtime being started by the caller (:class:`attnroll.batch.engines.RayStart`, as
            ``attnroll batch`` begins it before loading the model); None = begun here first thing, in the
            background (the driver's own work overlaps it). Stopped at the end when that start began it.

    Returns:
        a :class:`BatchResult`. Inputs that cannot be explained are rows of ``out/failures/``, not errors.

    Raises:
        ValueError: a bad source, method, option or engine; :class:`BatchMismatchError` when ``out`` holds a
            different run; ImportError: ``engine="ray"`` without Ray; RuntimeError: ``out`` is being written.
    """
    t0 = time.perf_counter()
    engine, batch_size, num_workers, num_gpus, cpus_per_worker, target, shard_size = _check_run_args(
        engine, batch_size, num_workers, num_gpus, cpus_per_worker, target, shard_size)
    with _ray_runtime(engine, address, num_workers, cpus_per_worker, ray_start) as ray_start:
        items, names, resolved, sfp = _inputs(source, column, target_column, out, methods, options, png)
        spec = ModelSpec(model, weights, items[0].kind, trust_remote_code, allow_partial_weights)
        lm = spec.load() if loaded is None else loaded
        _check_model_fits(lm, items, names, target is not None or target_column is not None)
        fp = model_fingerprint(lm.model)
        key = run_key(source, column, fp, names, resolved, target, target_column)
        out = Path(out)
        with store.locked(out):
            info = {**_manifest(key, lm, spec, engine, command, len(items), sfp), "run": uuid.uuid4().hex}
            todo, held = _resume(out, key, overwrite, items, {**info, "status": "running"}, sfp)
            job = Job(names, resolved, fp, str(out.resolve()), png, target, run=info["run"],
                      shard_meta=store.shard_meta(key, sfp))
            counter = _Counter(len(todo), progress)
            if engine == "local":
                known = _run_local(lm, job, todo, batch_size, shard_size, counter, held)
            else:
                known = run_ray(spec, job, todo, batch_size, counter, num_workers=num_workers, address=address,
                                cpus_per_worker=cpus_per_worker, num_gpus=num_gpus, ray_start=ray_start)
            return _finish(out, info, items, todo, time.perf_counter() - t0, known)


def _inputs(source: Any, column: str | None, target_column: str | None, out: Any, methods: Any, options: Any,
            png: bool) -> tuple[list[Item], list[str], dict, str]:
    """The source's items (the output folder left out of an image folder), the method names and their
    resolved options, and the source's fingerprint; with ``png`` the overlay names are checked distinct."""
    items = list_items(source, column, target_column, exclude=[out])
    names, resolved = resolve_methods(methods, options)
    if png:
        check_overlay_names(items, names)
    return items, names, resolved, source_fingerprint(source, items)


def _run_local(lm: Any, job: Job, todo: list[Item], batch_size: int, shard_size: int | None, counter: "_Counter",
               held: bool) -> tuple[list[str], list[str]] | None:
    """The local engine's run; the ids it committed (rows, failures) when ``out`` held nothing before (then
    they are all that ``out`` holds: ``_finish`` counts them instead of reading every shard back), else None."""
    worker = Worker(lm, job)
    worker.tally = None if held else ([], [])
    run_local(worker, todo, batch_size, counter, shard_size)
    return worker.tally


@contextlib.contextmanager
def _ray_runtime(engine: str, address: str | None, num_workers: int, cpus_per_worker: int | None,
                 ray_start: RayStart | None) -> Iterator[RayStart | None]:
    """For ``engine="ray"``: the Ray runtime starting in the background from the run's first line (or the
    caller's ``ray_start``), so that listing the source, loading and fingerprinting the model and scanning the
    output overlap it; stopped at the end when that start began it, also when the run stops before Ray's
    part (a bad source, a mismatched output). None for the local engine."""
    if engine == "ray" and ray_start is None:
        ray_start = begin_ray(address, num_workers, cpus_per_worker)
    try:
        yield ray_start
    finally:
        if ray_start is not None:
            ray_start.stop()


def _check_run_args(engine: Any, batch_size: Any, num_workers: Any, num_gpus: Any, cpus_per_worker: Any,
                    target: Any, shard_size: Any = None) -> tuple:
    """run_batch's scalar arguments, checked (and Ray importable for ``engine="ray"``), in that order."""
    engine = _checks.check_choice("engine", engine, ENGINES)
    if engine == "ray":
        from .engines import check_ray

        check_ray()
    return (engine, _checks.check_int("batch_size", batch_size, low=1),
            _checks.check_int("num_workers", num_workers, low=1), check_num_gpus(num_gpus, engine),
            check_cpus_per_worker(cpus_per_worker, engine),
            None if target is None else _checks.check_int("target", target, low=0),
            check_shard_size(shard_size, engine))


def _resume(out: Path, key: dict, overwrite: bool, items: list[Item], manifest: dict,
            source_fp: str) -> tuple[list[Item], bool]:
    """The items no committed shard holds and whether ``out`` holds any committed row or failure, after
    checking (or, with ``overwrite``, clearing) what ``out`` holds — the manifest's key, then each shard's
    own record (:func:`check_shards`) — removing a killed run's temporary files and writing this run's
    ``manifest``; call with ``out`` locked. The manifest (with this run's id) is written *before* the
    shards are listed: a worker of a killed run that is still alive (a Ray actor on a cluster) then finds
    another run's id and commits nothing more, so that no batch is both listed as missing and committed by
    it. A refusal puts the previous manifest back (or removes this run's, when there was none)."""
    meta = store.read_manifest(out)
    if overwrite and (meta is not None or any(store.shard_files(out, w) for w in (store.ROWS, store.FAILURES))):
        store.clear(out)  # (a folder that is no batch output is left as it is)
        meta = None
    check_resumable(meta, key, out)
    store.write_manifest(out, manifest)
    store.remove_temporaries(out)
    try:
        rows, failures = store.scan(out)
        check_shards(rows + failures, key, source_fp, items, out, manifest=meta is not None)
    except BaseException:
        if meta is None:
            (out / store.MANIFEST).unlink(missing_ok=True)
        else:
            store.write_manifest(out, {k: v for k, v in meta.items() if k != "format"})
        raise
    done = {i for s in rows + failures for i, _ in s.entries}
    return [it for it in items if it.id not in done], bool(done)


def check_overlay_names(items: list[Item], methods: list[str]) -> None:
    """Two inputs must not share an overlay file (:func:`~attnroll.batch.work.overlay_name`), also on a
    case-insensitive disk; only a hash collision could make them, and it is refused, not overwritten."""
    seen: dict[str, str] = {}
    for it in items:
        name = overlay_name(it.id, methods[0]).lower()
        if seen.setdefault(name, it.id) != it.id:
            raise ValueError(f"inputs {seen[name]!r} and {it.id!r} would write the same overlay file {name!r}; "
                             "rename one of them")


class _Counter:
    def __init__(self, total: int, progress: Callable[[int, int], None] | None):
        self.total, self.done, self.progress = total, 0, progress
        if progress is not None:
            progress(0, total)

    def __call__(self, counts: dict) -> None:
        self.done += int(counts.get("inputs", 0))
        if self.progress is not None:
            self.progress(self.done, self.total)


def _needs_grad(names: list[str]) -> dict[str, bool]:
    from ..methods import method_info

    return {m: bool(method_info(m).needs_grad) for m in names}


def check_shard_size(shard_size: Any, engine: str) -> int | None:
    """Inputs per shard of the local engine: None (the default) or an int >= 1; only for the local engine."""
    return _engine_int("shard_size", shard_size, engine, "local", "sizes the local engine's shards; with "
                       "engine='ray' each actor commits each batch it explains: set batch_size instead")


def _engine_int(name: str, value: Any, engine: str, needs: str, why: str) -> int | None:
    """An option of one engine only: None, or an int >= 1 refused (``why``) with any other engine."""
    if value is None:
        return None
    value = _checks.check_int(name, value, low=1)
    if engine != needs:
        raise ValueError(f"{name}={value!r} {why}")
    return value


def check_num_gpus(num_gpus: Any, engine: str) -> float:
    """GPUs per Ray actor: a number >= 0, either below 1 (a share of one GPU) or whole; only for Ray."""
    value = _checks.check_real("num_gpus", num_gpus, low=0.0)
    if value > 1 and not float(value).is_integer():
        raise ValueError(f"num_gpus must be a share of one GPU (0 < num_gpus <= 1) or a whole number of GPUs, "
                         f"got {num_gpus!r}")
    if value and engine != "ray":
        raise ValueError(f"num_gpus={num_gpus!r} places Ray actors on GPUs; it needs engine='ray' (the local engine "
                         "runs the model where it is: move it to a GPU before passing it as loaded=)")
    return float(value)


def check_cpus_per_worker(cpus: Any, engine: str) -> int | None:
    """CPUs per Ray actor: None (the default) or an int >= 1; only for Ray."""
    return _engine_int("cpus_per_worker", cpus, engine, "ray", "sizes Ray actors; it needs engine='ray' (the local "
                       "engine uses torch's threads: torch.set_num_threads)")


def _check_model_fits(lm: Any, items: list[Item], names: list[str], class_target: bool = False) -> None:
    """The model's kind must be the inputs'; gradient methods on a bare text encoder need pairs; a class
    target needs class scores."""
    kind = items[0].kind
    if lm.kind != kind:
        raise ValueError(f"model: {lm.name} is a{'n image' if lm.kind == 'image' else ' text'} model, but the "
                         f"source holds {kind}s")
    if class_target and kind == "text" and not has_class_scores(lm):
        raise ValueError(f"target: {lm.name} has no class scores (a sentence encoder), so there is no class to "
                         "explain; leave target / target_column out")
    if kind == "text" and any(_needs_grad(names).values()) and any(it.pair is None for it in items):
        if not has_class_scores(lm):
            grad = [m for m, g in _needs_grad(names).items() if g]
            raise ValueError(f"methods {grad} need a scalar target, and {lm.name} has no class scores: give "
                             "every text a pair (explained for the cosine similarity of the two sentences)")


def _manifest(key: dict, lm: Any, spec: ModelSpec, engine: str, command: str | None, n: int,
              source_fp: str | None = None) -> dict:
    from importlib import metadata

    import torch

    versions = {
        "attnroll": metadata.version("attnroll"),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for mod in ("transformers", "pyarrow", "ray"):
        m = sys.modules.get(mod)
        if m is not None:
            versions[mod] = getattr(m, "__version__", "?")
    return {"key": key, "model_name": lm.name, "model_spec": {"name": spec.name, "weights": spec.weights},
            "kind": spec.kind, "engine": engine, "command": command, "versions": versions,
            "counts": {"inputs": n}, "source_fingerprint": source_fp}


def _finish(out: Path, info: dict, items: list[Item], todo: list[Item], seconds: float,
            known: tuple[list[str], list[str]] | None = None) -> BatchResult:
    """Count what is committed, write the final manifest, return the result. ``known``: the ids of every
    committed row (one per row) and failure when the run knows them all (a new output explained by the local
    engine: its commits are all there is); else the committed shards are read. Counts are of the source's
    inputs: explained = with rows and no failure, failed = with a failure (for one method or all)."""
    row_ids, failed_ids = store.committed_id_lists(out) if known is None else known
    listed = {it.id for it in items}
    done_rows, failed, rows = set(row_ids) & listed, set(failed_ids) & listed, len(row_ids)
    n, now = len(items), {it.id for it in todo}
    counts = {"inputs": n, "explained": len(done_rows - failed), "failed": len(failed), "rows": rows,
              "missing": n - len(done_rows | failed)}
    explained_now, failed_now = len((done_rows - failed) & now), len(failed & now)
    status = "complete" if counts["missing"] == 0 else "incomplete"
    store.write_manifest(out, {**info, "status": status, "counts": counts, "last_run": {
        "seconds": round(seconds, 3), "explained": explained_now, "failed": failed_now,
        "done_before": n - len(todo), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
    return BatchResult(str(out), n, n - len(todo), explained_now, len(failed), rows, seconds, failed_now,
                       counts["missing"])
