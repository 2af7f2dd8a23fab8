"""The on-disk layout of a batch output and its atomic writes.

```
DIR/manifest.json             the command, versions, model fingerprint, methods, options, counts
DIR/rows/part-*.parquet       the explanations: one row per (input, method)      (ROW_SCHEMA)
DIR/failures/part-*.parquet   inputs that could not be explained, with the reason (FAILURE_SCHEMA)
DIR/png/<name>.<method>.png   overlays (with --png), named by work.overlay_name (a safe file name)
DIR/.lock                     held (flock) while a run writes; released by the OS even after kill -9
```
Each batch of inputs is committed by two atomic renames (its rows, then its failures; a temporary file in
the same folder first). An input is in at most one committed shard, so the committed shards *are* the
progress: a rerun lists them and explains only the inputs they do not hold. Temporary files left by a killed
run are never read (they do not match ``part-*.parquet``) and are removed by the next run. The manifest names
the run writing the folder (``run``); a worker commits only while it names its own run (:func:`check_run`),
so that a killed run's worker that is still alive (a Ray actor on a cluster) cannot add a batch a rerun redoes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .._io import atomic_write

FORMAT = "attnroll.batch/1"
ROWS, FAILURES, MANIFEST = "rows", "failures", "manifest.json"


def _pa() -> Any:
    try:
        import pyarrow as pa
    except ImportError:
        raise ImportError("attnroll batch writes Parquet with pyarrow: pip install 'attnroll[batch]'") from None
    return pa


@functools.lru_cache(maxsize=1)
def row_schema() -> Any:
    """The Parquet schema of ``rows/`` (see the README's "whole datasets" section); one object (immutable)."""
    pa = _pa()
    return pa.schema([
        ("index", pa.int64()),            # position of the input in the source
        ("id", pa.string()),              # relative path, "line:N", "row:N" or the source's own id
        ("source", pa.string()),          # image path, or the text (a tab before the pair)
        ("method", pa.string()),
        ("options", pa.string()),         # JSON, every option of the method with defaults filled in
        ("target", pa.int64()),           # the class explained (null for a non-class target)
        ("target_name", pa.string()),     # its label, or what was explained ("cosine similarity to the pair")
        ("prediction", pa.int64()),       # argmax of the model's class scores (null without class scores)
        ("probability", pa.float32()),    # softmax probability of the prediction
        ("scores", pa.list_(pa.float32())),         # saliency over patches (row-major) or tokens
        ("prefix_scores", pa.list_(pa.float32())),  # the prefix tokens' entries (CLS...), left out of scores
        ("grid", pa.list_(pa.int32())),   # [h, w] patch grid of image models, else null
        ("tokens", pa.list_(pa.string())),  # the tokens of text inputs (padding removed), else null
        ("model", pa.string()),           # fingerprint of the weights and config
    ])


def failure_schema() -> Any:
    """The Parquet schema of ``failures/``."""
    pa = _pa()
    return pa.schema([("index", pa.int64()), ("id", pa.string()), ("source", pa.string()),
                      ("method", pa.string()), ("reason", pa.string())])


def shard_name(first_index: int) -> str:
    """``part-<first input index>-<random>.parquet``: sorts in source order, never collides across workers."""
    return f"part-{first_index:09d}-{uuid.uuid4().hex[:8]}.parquet"


def write_table(path: Path, records: list[dict], schema: Any) -> Path:
    """Write ``records`` (dicts with the schema's fields) as one Parquet file, atomically and fsynced."""
    columns = [arrow_column([r.get(f.name) for r in records], f.type) for f in schema]
    return write_arrow(path, _pa().Table.from_arrays(columns, schema=schema))


def ragged(full: Any, start: int, lengths: list[int]) -> Any:
    """A list<float32> Arrow column from a (B, n) float32 array: row b holds ``full[b, start:lengths[b]]``
    (one flat buffer and offsets, no Python object per value)."""
    import numpy as np

    pa = _pa()
    full = np.ascontiguousarray(full, dtype=np.float32)
    B, n = full.shape
    lengths = np.asarray(lengths, dtype=np.int64)
    if B and (lengths == n).all():  # every row the same length (images): a strided slice
        values = full[:, start:].reshape(-1)
        offsets = np.arange(B + 1, dtype=np.int32) * (n - start)
    else:
        keep = np.arange(n)[None, :]
        mask = (keep >= start) & (keep < lengths[:, None])
        values = full[mask]
        offsets = np.concatenate([[0], np.cumsum(np.maximum(lengths - start, 0))]).astype(np.int32)
    return pa.ListArray.from_arrays(_arrow_of(pa, offsets, pa.int32()), _arrow_of(pa, values, pa.float32()))


def _arrow_of(pa: Any, values: Any, kind: Any) -> Any:
    """A 1-D numpy array of ``kind``'s dtype as an Arrow array over the same memory (``pa.array`` would
    first import pandas to look for pandas types: ~0.3 s on the first batch of a run)."""
    import numpy as np

    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def rows_table(columns: dict[str, Any]) -> Any:
    """An Arrow table of ``row_schema()`` from its columns (lists, or Arrow arrays such as :func:`ragged`)."""
    pa = _pa()
    schema = row_schema()
    arrays = [c if isinstance(c, pa.Array) else arrow_column(c, schema.field(name).type)
              for name, c in ((f.name, columns[f.name]) for f in schema)]
    return pa.Table.from_arrays(arrays, schema=schema)


@dataclass
class PendingRows:
    """The rows of one Explanation, every value already computed, as an Arrow table later (:meth:`table`):
    the engines build the table when they commit the batch (the writer thread), not in the thread that
    runs the model. ``columns``: ``row_schema()``'s columns but ``scores`` / ``prefix_scores``, as lists
    (or Arrow arrays, e.g. :func:`repeated_column`);
    ``full`` (B, n) float32 numpy array, the explained rows; ``prefix``: their first ``prefix`` entries go to
    ``prefix_scores``; ``lengths``: each row's real length (padding left out)."""

    columns: dict[str, Any]
    full: Any
    prefix: int
    lengths: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def table(self) -> Any:
        """The Arrow table of ``row_schema()`` (:func:`rows_table`)."""
        B = len(self.lengths)
        return rows_table({**self.columns, "scores": ragged(self.full, self.prefix, self.lengths),
                           "prefix_scores": ragged(self.full, 0, [self.prefix] * B)})


def as_table(rows: Any) -> Any:
    """An Arrow table from a table or :class:`PendingRows`."""
    return rows.table() if isinstance(rows, PendingRows) else rows


@functools.lru_cache(maxsize=64)
def repeated_column(value: Any, n: int, name: str) -> Any:
    """The ``row_schema()`` column ``name`` holding ``value`` in each of ``n`` rows (a list value given as a
    tuple, so that it hashes): the columns that one Explanation gives all of its rows (method, options, grid,
    model) are the same from one batch to the next, and an Arrow array is immutable, so each is built once."""
    return arrow_column([list(value) if isinstance(value, tuple) else value] * n, row_schema().field(name).type)


def arrow_column(values: list, kind: Any) -> Any:
    """``pa.array(values, type=kind)`` for the row schema's column types — int64, int32, float32, string and
    lists of them — None = null, built from numpy buffers: ``pa.array`` imports pandas on its first call
    (to look for pandas types), ~0.3 s of a run's first batch."""
    import numpy as np

    pa = _pa()
    nulls = any(v is None for v in values)
    validity = None
    if nulls:
        present = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        validity = pa.py_buffer(np.packbits(present, bitorder="little"))
    if pa.types.is_list(kind):
        lengths = [0 if v is None else len(v) for v in values]
        child = arrow_column([x for v in values if v is not None for x in v], kind.value_type)
        return pa.Array.from_buffers(kind, len(values), [validity, pa.py_buffer(_offsets(lengths))], children=[child])
    if pa.types.is_string(kind):
        data = [b"" if v is None else v.encode("utf-8") for v in values]
        buffers = [validity, pa.py_buffer(_offsets([len(b) for b in data])), pa.py_buffer(b"".join(data))]
        return pa.Array.from_buffers(kind, len(values), buffers)
    dtype = kind.to_pandas_dtype()  # the numpy dtype (a table of types; pandas is not imported)
    flat = np.array([0 if v is None else v for v in values] if nulls else values, dtype=dtype)
    return pa.Array.from_buffers(kind, len(values), [validity, pa.py_buffer(flat)])


def _offsets(lengths: list[int]) -> Any:
    import numpy as np

    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


#: The shards' Parquet codec. Snappy: half zstd's CPU per shard for ~10 % more bytes (float32 scores barely
#: compress). Measured on the shapes ViT's rows (32 per shard, 65 scores each, one thread, pyarrow's default
#: levels; docs/research/batch-engine.md): zstd 0.64 ms / 13.5 KiB (level 1 the same), snappy 0.31 ms /
#: 15.0 KiB, lz4 0.31 ms / 14.6 KiB, none 0.29 ms / 28.1 KiB; snappy over lz4 for its wider support among
#: Parquet readers. Readers take the codec from each file, so outputs written with zstd (by older versions)
#: read back and resume unchanged, and one output may hold both.
SHARD_CODEC = "snappy"


def write_arrow(path: Path, table: Any) -> Path:
    """Write an Arrow ``table`` as one Parquet file, atomically and fsynced."""
    import pyarrow.parquet as pq

    def fill(f: Any) -> None:
        # No dictionary pages: a shard's strings are mostly distinct (ids, paths) or one value, which the codec
        # packs as well; measured: a third less time per shard of 32 rows, and smaller files.
        pq.write_table(table, f, compression=SHARD_CODEC, use_dictionary=False)
        f.flush()
        os.fsync(f.fileno())

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, fill)
    return path


#: The key of a shard's Parquet metadata that says what made it (:func:`shard_meta`).
SHARD_META = b"attnroll.batch"


def shard_meta(key: dict, source_fingerprint: str) -> str:
    """What every shard of a run carries in its Parquet metadata (JSON): the run's key (source, column,
    model fingerprint, methods, options, target) and the fingerprint of the source's listing, so that a
    rerun can check each shard on its own, manifest or not."""
    return json.dumps({"format": FORMAT, "key": key, "source_fingerprint": source_fingerprint}, sort_keys=True)


def commit_tables(out: Path, tables: list[Any], failures: list[dict], meta: str | None = None) -> int:
    """Commit one batch: its row tables (Arrow tables or :class:`PendingRows`, as one shard) and its failures,
    each shard named after the batch's first input and carrying ``meta`` (:func:`shard_meta`) in its Parquet
    metadata; returns the number of rows written."""
    pa = _pa()
    tables = [as_table(t) for t in tables if t.num_rows]
    if not tables and not failures:
        return 0
    firsts = [min(t.column("index").to_pylist()) for t in tables] + [f["index"] for f in failures]
    name = shard_name(min(firsts))
    extra = None if meta is None else {SHARD_META: meta.encode("utf-8")}
    rows = pa.concat_tables(tables) if tables else None
    if rows is not None:
        write_arrow(out / ROWS / name, rows if extra is None else rows.replace_schema_metadata(extra))
    if failures:
        schema = failure_schema()
        write_table(out / FAILURES / name, failures, schema if extra is None else schema.with_metadata(extra))
    return 0 if rows is None else rows.num_rows


def shard_files(out: Path, which: str) -> list[Path]:
    """The committed shards of ``rows`` or ``failures``, sorted by name (source order)."""
    folder = Path(out) / which
    return sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []


@dataclass
class Shard:
    """One committed shard as a rerun sees it: its file, what made it (:func:`shard_meta`, decoded; None for
    a shard of an earlier version, which carries none), and its (id, index) per row."""

    path: Path
    meta: dict | None
    entries: list[tuple[str, int]]


def scan(out: Path) -> tuple[list[Shard], list[Shard]]:
    """The committed row shards and failure shards of ``out``, in name order (source order), each read for
    its metadata and its ``id`` and ``index`` columns only; a damaged shard raises ValueError naming it and
    saying what to do."""
    found = []
    for which in (ROWS, FAILURES):
        files = shard_files(out, which)
        found.append(_read_shards(files) if files else [])  # (a new output imports no pyarrow here)
    return found[0], found[1]


def committed_ids(out: Path) -> tuple[set[str], set[str]]:
    """(ids with rows, ids with failures) over all committed shards (reads only the ``id`` columns)."""
    rows, failures = committed_id_lists(out)
    return set(rows), set(failures)


def committed_id_lists(out: Path) -> tuple[list[str], list[str]]:
    """The ``id`` column of every committed row shard (one entry per row) and failure shard."""
    rows, failures = scan(out)
    return [i for s in rows for i, _ in s.entries], [i for s in failures for i, _ in s.entries]


def damaged(path: Path, why: str) -> ValueError:
    """The error for a shard that cannot be read: which file, why, and what to do."""
    return ValueError(f"{path} is not a readable batch shard ({why}); it was damaged or not written by attnroll "
                      "batch: delete it (a rerun explains its inputs again) or rerun with --overwrite to start over")


def read_shard(path: Path, columns: list[str] | None = None, schema: Any = None) -> Any:
    """One shard as an Arrow table (``columns`` only); a damaged file raises :func:`damaged`'s error."""
    import pyarrow.parquet as pq

    try:
        if schema is not None:
            return pq.read_table(path, schema=schema)
        return pq.ParquetFile(path).read(columns=columns, use_threads=False)
    except (OSError, ValueError, KeyError, TypeError) as e:  # pyarrow's ArrowInvalid is a ValueError
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        raise damaged(path, f"{type(e).__name__}: {str(e)[:200]}") from None


def _read_shards(files: list[Path]) -> list[Shard]:
    """:class:`Shard` of each of ``files``, in order, read by a few threads file by file
    (``pq.ParquetFile``: ``pq.ParquetDataset`` imports pyarrow.dataset, and with it pandas, ~0.3 s)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(f: Path) -> Shard:
        t = read_shard(f, ["id", "index"])
        raw = (t.schema.metadata or {}).get(SHARD_META)
        try:
            meta = None if raw is None else json.loads(raw)
        except ValueError:
            raise damaged(f, "its attnroll metadata is not JSON") from None
        return Shard(f, meta, list(zip(t.column("id").to_pylist(), t.column("index").to_pylist())))

    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        return list(pool.map(one, files))


def remove_temporaries(out: Path) -> int:
    """Delete the temporary files a killed run left in the shard and overlay folders; returns how many."""
    n = 0
    for which in (ROWS, FAILURES, "png"):
        folder = Path(out) / which
        if folder.is_dir():
            for f in folder.glob(".*.tmp"):
                f.unlink(missing_ok=True)
                n += 1
    return n


def read_manifest(out: Path) -> dict | None:
    """The manifest of a batch output, or None when ``out`` has none."""
    path = Path(out) / MANIFEST
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not a batch manifest (invalid JSON: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not an attnroll batch manifest (format "
                         f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r})")
    return meta


class StaleRunError(RuntimeError):
    """A worker of a run that another run has since taken over (a killed run's surviving Ray actor)."""


def check_run(out: Path, run: str) -> None:
    """Raise :class:`StaleRunError` unless the manifest of ``out`` names run ``run`` (read before each
    commit: a newer run writes its id before it lists what is missing)."""
    meta = read_manifest(out) or {}
    if meta.get("run") != run:
        raise StaleRunError(f"{out} is now written by another run ({meta.get('run')!r}, not {run!r}); this "
                            "worker's batch is left to it")


def write_manifest(out: Path, meta: dict) -> None:
    atomic_write(Path(out) / MANIFEST, json.dumps({"format": FORMAT, **meta}, indent=1, sort_keys=False))


def clear(out: Path) -> None:
    """Remove what a batch run wrote (manifest, shards, overlays) — for ``overwrite``; nothing else."""
    import shutil

    for which in (ROWS, FAILURES, "png"):
        shutil.rmtree(Path(out) / which, ignore_errors=True)
    (Path(out) / MANIFEST).unlink(missing_ok=True)


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out`` for a run; a second concurrent run is refused (RuntimeError)."""
    import fcntl

    Path(out).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(out) / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{out} is being written by another attnroll batch run; wait for it to end") from None
        yield
    finally:
        os.close(fd)
