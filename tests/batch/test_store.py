"""batch.store: Arrow columns built from numpy buffers against ``pa.array``, the id scan against pyarrow's
dataset reader, and the engine's writing and reading path importing no pandas."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from attnroll.batch import store  # noqa: E402

COLUMNS = [
    ([3, None, -7, 2 ** 40], pa.int64()),
    ([], pa.int64()),
    ([0.1, None, 1e-30, 3.5], pa.float32()),
    ([1, 2, None], pa.int32()),
    (["a", None, "é✓ and a tab\t", ""], pa.string()),
    ([None, None], pa.string()),
    ([None, None, None], pa.list_(pa.int32())),
    ([[8, 8], [1, 2], None], pa.list_(pa.int32())),
    ([["[CLS]", "ü"], None, [], ["x"]], pa.list_(pa.string())),
    ([[0.5, None], [], None], pa.list_(pa.float32())),
]


@pytest.mark.parametrize("values, kind", COLUMNS, ids=[f"{k}-{i}" for i, (_, k) in enumerate(COLUMNS)])
def test_arrow_column_equals_pa_array(values, kind):
    got = store.arrow_column(values, kind)
    got.validate(full=True)
    want = pa.array(values, type=kind)
    assert got.type == kind and got.equals(want) and got.null_count == want.null_count


@pytest.mark.parametrize("name, value", [("method", "rollout"), ("options", '{"alpha": 0.5}'), ("grid", (8, 8)),
                                         ("grid", None), ("tokens", None), ("model", "sha256:ab")])
def test_repeated_column_equals_pa_array_of_the_repeated_value(name, value):
    """The engine's shared columns (one value in every row; a list as a tuple) against ``pa.array`` of the
    value repeated; a second call gives the same immutable array."""
    kind = store.row_schema().field(name).type
    got = store.repeated_column(value, 3, name)
    got.validate(full=True)
    want = pa.array([list(value) if isinstance(value, tuple) else value] * 3, type=kind)
    assert got.type == kind and got.equals(want) and got.null_count == want.null_count
    assert store.repeated_column(value, 3, name) is got and len(store.repeated_column(value, 2, name)) == 2


def test_rows_table_equals_the_table_pa_array_builds():
    """A whole row table (every column of the schema, nulls included) against one built by ``pa.array``."""
    full = np.arange(12, dtype=np.float32).reshape(2, 6) / 7
    columns = {"index": [0, 1], "id": ["a.png", "b/ü.png"], "source": ["/x/a.png", "/x/b/ü.png"],
               "method": ["rollout"] * 2, "options": ['{"alpha": 0.5}'] * 2, "target": [3, None],
               "target_name": ["three", None], "prediction": [3, 1], "probability": [0.25, 0.875],
               "scores": store.ragged(full, 1, [6, 6]), "prefix_scores": store.ragged(full, 0, [1, 1]),
               "grid": [[1, 5], [1, 5]], "tokens": [None, None], "model": ["f" * 16] * 2}
    got = store.rows_table(columns)
    schema = store.row_schema()
    plain = {k: v.to_pylist() if isinstance(v, pa.Array) else v for k, v in columns.items()}
    want = pa.Table.from_arrays([pa.array(plain[f.name], type=f.type) for f in schema], schema=schema)
    assert got.equals(want)


def test_committed_ids_in_shard_order_as_the_dataset_reader_gives_them(tmp_path):
    """The id scan (file by file, threads) against pyarrow's dataset reader over the same shards."""
    for first in (64, 0, 32, 96):
        ids = [f"img{i:03d}" for i in range(first, first + 32)]
        store.write_arrow(tmp_path / store.ROWS / store.shard_name(first),
                          pa.table({"index": list(range(first, first + 32)), "id": ids}))
    store.write_table(tmp_path / store.FAILURES / store.shard_name(5),
                      [{"index": 5, "id": "bad.png", "source": "bad.png", "method": None, "reason": "corrupt"}],
                      store.failure_schema())
    rows, failed = store.committed_id_lists(tmp_path)
    files = [str(f) for f in store.shard_files(tmp_path, store.ROWS)]
    assert rows == pq.ParquetDataset(files).read(columns=["id"]).column("id").to_pylist()
    assert rows[:2] == ["img000", "img001"] and len(rows) == 128 and failed == ["bad.png"]
    assert store.committed_id_lists(tmp_path / "new") == ([], [])


@pytest.mark.slow
def test_writing_and_reading_shards_imports_no_pandas(tmp_path):
    """Building a batch's rows, committing it and scanning the committed ids (a run's own path) import no
    pandas, which ``pa.array`` and pyarrow's dataset reader would (~0.3 s each, in a fresh process)."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import numpy as np
        from attnroll.batch import store
        out = Path({str(tmp_path)!r})
        full = np.ones((2, 5), dtype=np.float32)
        table = store.rows_table({{"index": [0, 1], "id": ["a", "b"], "source": ["a", "b"], "method": ["raw"] * 2,
            "options": ["{{}}"] * 2, "target": [1, None], "target_name": ["one", None], "prediction": [1, 0],
            "probability": [0.5, 0.75], "scores": store.ragged(full, 1, [5, 5]),
            "prefix_scores": store.ragged(full, 0, [1, 1]), "grid": [[2, 2]] * 2, "tokens": [None] * 2,
            "model": ["m"] * 2}})
        store.commit_tables(out, [table], [{{"index": 2, "id": "c", "source": "c", "method": None, "reason": "bad"}}])
        assert store.committed_id_lists(out) == (["a", "b"], ["c"])
        print("pandas" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"
