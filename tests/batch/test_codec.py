"""The shards' Parquet codec (``store.SHARD_CODEC``, snappy; older outputs used zstd): new shards are written with it,
and an output written before with zstd (the earlier codec) reads back and resumes unchanged — a resumed run
adds snappy shards beside the zstd ones and the whole equals a fresh run's rows."""

from __future__ import annotations

import pytest

pq = pytest.importorskip("pyarrow.parquet")

from attnroll.batch import read_batch, run_batch, store  # noqa: E402

from .helpers import assert_same_rows, write_shapes  # noqa: E402


def _codecs(out, which: str) -> set[str]:
    """Every column chunk's codec over the committed shards of ``which``."""
    found = set()
    for f in store.shard_files(out, which):
        meta = pq.ParquetFile(f).metadata
        found |= {meta.row_group(g).column(c).compression for g in range(meta.num_row_groups)
                  for c in range(meta.num_columns)}
    return found


def _rewrite_as_zstd(out) -> None:
    """Each committed shard rewritten in place as the earlier code wrote it (zstd, no dictionary pages)."""
    for which in (store.ROWS, store.FAILURES):
        for f in store.shard_files(out, which):
            table = pq.read_table(f)
            pq.write_table(table, f, compression="zstd", use_dictionary=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec-src")
    write_shapes(root, 9, seed=4)
    (root / "broken.png").write_bytes(b"not a png")  # one failure, so that the failures table exists too
    return root


def test_new_shards_use_the_shard_codec(source, tmp_path):
    run_batch(source, tmp_path / "out", methods=["rollout"], batch_size=4)
    assert store.SHARD_CODEC == "snappy"
    assert _codecs(tmp_path / "out", store.ROWS) == {"SNAPPY"} == _codecs(tmp_path / "out", store.FAILURES)


def test_an_old_zstd_output_reads_back_and_resumes(source, tmp_path):
    fresh = tmp_path / "fresh"
    run_batch(source, fresh, methods=["rollout", "raw"], batch_size=4)
    want = read_batch(fresh)

    old = tmp_path / "old"

    def stop(done, total):
        if done >= 4:
            raise KeyboardInterrupt("killed after the first batch")

    with pytest.raises(KeyboardInterrupt):
        run_batch(source, old, methods=["rollout", "raw"], batch_size=4, shard_size=4, progress=stop)
    _rewrite_as_zstd(old)
    assert _codecs(old, store.ROWS) == {"ZSTD"}
    partial = read_batch(old)
    assert 0 < len(partial) < len(want)
    assert_same_rows(partial, want[want["id"].isin(set(partial["id"]))])  # the old shards read back

    again = run_batch(source, old, methods=["rollout", "raw"], batch_size=4)
    # the first two batches: the first shard, then the batch explained before Ctrl-C (committed as it stopped):
    # 7 inputs with rows and broken.png's failure
    assert again.done_before == len(set(partial["id"])) + 1 == 8
    assert again.explained == 2
    assert _codecs(old, store.ROWS) == {"ZSTD", "SNAPPY"}  # old shards kept, new ones beside them
    assert_same_rows(read_batch(old), want)
    assert again.rows == len(want) and again.failed == 1
