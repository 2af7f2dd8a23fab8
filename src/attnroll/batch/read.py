"""Reading a batch output back: the rows as a pandas DataFrame, an :class:`~attnroll.Explanation` per row,
the failures table and the manifest."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from . import store


def _frame(out: Path, which: str, schema: Any) -> Any:
    try:
        import pandas  # noqa: F401 - what to_pandas needs, with the message above
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401 - what read_shard needs, with the message above
    except ImportError:
        raise ImportError("read_batch needs pandas and pyarrow: pip install 'attnroll[batch]'") from None
    files = store.shard_files(out, which)
    table = pa.concat_tables([store.read_shard(f, schema=schema) for f in files]) if files else schema.empty_table()
    df = table.to_pandas()
    return df if df.empty else df.sort_values(["index"], kind="stable").reset_index(drop=True)


def read_batch(path: str | os.PathLike, *, method: str | None = None) -> Any:
    """The rows of the batch output ``path`` as a pandas DataFrame (columns as in :func:`store.row_schema`),
    in source order and, per input, in the run's method order; ``method`` keeps only that method's rows.

    Raises ValueError when ``path`` is not a batch output (no manifest)."""
    out = Path(path)
    meta = read_manifest(out)
    df = _frame(out, store.ROWS, store.row_schema())
    order = {m: i for i, m in enumerate(meta.get("key", {}).get("methods", []))}
    if not df.empty:
        df = df.assign(_m=df["method"].map(order)).sort_values(["index", "_m"], kind="stable")
        df = df.drop(columns="_m").reset_index(drop=True)
    if method is not None:
        if method not in set(df["method"]):
            raise ValueError(f"method={method!r} is not in {out} (it holds {sorted(set(df['method']))})")
        df = df[df["method"] == method].reset_index(drop=True)
    return df


def recorded_sources(path: str | os.PathLike) -> dict[str, str]:
    """{id: source} over the rows of a batch output: each input's image path (or text) as the run recorded
    it (reads the ``id`` and ``source`` columns only)."""
    out = Path(path)
    read_manifest(out)
    found: dict[str, str] = {}
    for f in store.shard_files(out, store.ROWS):
        t = store.read_shard(f, ["id", "source"])
        found.update(zip(t.column("id").to_pylist(), t.column("source").to_pylist()))
    return found


def read_failures(path: str | os.PathLike) -> Any:
    """The failures table of a batch output: index, id, source, method (None = the input could not be
    read), reason."""
    out = Path(path)
    read_manifest(out)
    return _frame(out, store.FAILURES, store.failure_schema())


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest (command, versions, model fingerprint, methods, options, counts) of a batch output."""
    meta = store.read_manifest(Path(path))
    if meta is None:
        raise ValueError(f"{os.fspath(path)} is not an attnroll batch output (no {store.MANIFEST}); make one with "
                         "'attnroll batch SOURCE --out DIR'")
    return meta


def row_explanation(row: Any) -> Any:
    """The :class:`~attnroll.Explanation` (batch of one) of a row of :func:`read_batch` (a pandas row or a
    dict): scores (1, units), full_row (1, n) with the prefix entries, grid or tokens, method, options,
    target. Arrays not stored in the table (layers, positions, extra) are absent."""
    import numpy as np
    import torch

    from ..explain.explanation import Explanation

    get = row.get if hasattr(row, "get") else row.__getitem__
    scores = torch.tensor(np.asarray(get("scores"), dtype=np.float32))[None]
    prefix = torch.tensor(np.asarray(get("prefix_scores"), dtype=np.float32))[None]
    grid, tokens, target = get("grid"), get("tokens"), get("target")
    if target is None or (isinstance(target, float) and target != target):
        target = get("target_name")
    else:
        target = [int(target)]
    return Explanation(
        scores=scores,
        full_row=torch.cat([prefix, scores], dim=1),
        tokens=None if tokens is None else [list(tokens)],
        grid=None if grid is None else (int(grid[0]), int(grid[1])),
        prefix=int(prefix.shape[1]),
        method=str(get("method")),
        options=json.loads(get("options")),
        target=target,
    )


def explanations(path: str | os.PathLike, method: str, *, pad: bool = False) -> Any:
    """All rows of one method stacked into one Explanation (B, units) in source order, with the ids. Maps
    over the same units (images of one model) stack as they are; token maps of different lengths raise
    ValueError, unless ``pad``: then each row is zero-padded on the right to the longest (``tokens`` keep
    each row's own tokens, ``attention_mask`` (B, units) marks the real ones)."""
    import torch

    df = read_batch(path, method=method)
    if df.empty:
        raise ValueError(f"{os.fspath(path)} has no rows for method {method!r}")
    each = [row_explanation(r) for _, r in df.iterrows()]
    widths = [e.full_row.shape[1] for e in each]
    if len(set(widths)) != 1 and not pad:
        raise ValueError(f"the {method!r} maps in {os.fspath(path)} have different lengths {sorted(set(widths))}; "
                         "stack them per row with row_explanation, or pass pad=True")
    first, n = each[0], max(widths)
    full = torch.zeros(len(each), n, dtype=torch.float32)
    mask = torch.zeros(len(each), n, dtype=torch.int64)
    for b, e in enumerate(each):
        full[b, : widths[b]] = e.full_row[0]
        mask[b, : widths[b]] = 1
    targets = [e.target[0] if isinstance(e.target, list) else e.target for e in each]
    from dataclasses import replace

    return replace(first, scores=full[:, first.prefix:], full_row=full, target=targets,
                   tokens=None if first.tokens is None else [e.tokens[0] for e in each],
                   attention_mask=mask if len(set(widths)) != 1 else None), list(df["id"])
