"""The local engine's shards: whole batches grouped up to ``shard_size`` inputs, committed early once explaining
them took ``shard_seconds``, what was explained committed on Ctrl-C; the rows do not depend on the shard
size; ``shard_size`` is checked and refused with the Ray engine."""

from __future__ import annotations

import contextlib

import pyarrow.parquet as pq
import pytest

from attnroll.batch import read_batch, run_batch
from attnroll.batch import engines
from attnroll.batch.run import check_shard_size

from .helpers import assert_same_rows, write_shapes


class FakeWorker:
    """Records what each commit holds (the items' indices); ``stop_at``: the batch whose compute is
    interrupted (Ctrl-C)."""

    def __init__(self, stop_at: int | None = None):
        self.commits: list[list[int]] = []
        self.computed = 0
        self.stop_at = stop_at

    @contextlib.contextmanager
    def kept_sessions(self):
        yield self

    def load(self, items):
        return items

    def compute(self, items):
        if self.computed == self.stop_at:
            raise KeyboardInterrupt
        self.computed += 1
        return items, [f"table of {items[0]}"], []

    def commit(self, computed):
        items, tables, failures = computed
        assert tables == [f"table of {b}" for b in items[::self.batch_size]]  # each batch's table, in order
        self.commits.append(list(items))
        return {"inputs": len(items), "rows": len(tables), "failures": 0}


def _run(worker, n, batch_size, **kw):
    done = []
    worker.batch_size = batch_size
    engines.run_local(worker, list(range(n)), batch_size, done.append, **kw)
    return done


@pytest.mark.parametrize("n, batch_size, shard_size, sizes", [
    (20, 3, 7, [6, 6, 6, 2]),       # whole batches: 7 // 3 = 2 per shard
    (20, 3, 2, [3] * 6 + [2]),      # a shard smaller than a batch: one batch each
    (20, 3, 9, [9, 9, 2]),
    (600, 32, None, [256, 256, 88]),  # the default: 256 inputs
    (5, 8, None, [5]),
])
def test_shards_hold_whole_batches_up_to_the_shard_size_in_source_order(n, batch_size, shard_size, sizes):
    w = FakeWorker()
    done = _run(w, n, batch_size, shard_size=shard_size)
    assert [len(c) for c in w.commits] == sizes
    assert [i for c in w.commits for i in c] == list(range(n))  # every input once, in order
    assert [d["inputs"] for d in done] == sizes  # progress counts each shard once it is committed


def test_a_shard_is_committed_once_its_batches_took_the_time_limit():
    w = FakeWorker()
    _run(w, 20, 3, shard_size=300, shard_seconds=0.0)  # every batch reaches the limit: one shard per batch
    assert [len(c) for c in w.commits] == [3] * 6 + [2]
    w = FakeWorker()
    _run(w, 20, 3, shard_size=300, shard_seconds=3600.0)
    assert [len(c) for c in w.commits] == [20]


@pytest.mark.parametrize("seconds_per_batch, sizes", [(2.0, [3] * 6 + [2]), (0.3, [12, 8])])
def test_the_clock_starts_with_the_shards_first_batch(monkeypatch, seconds_per_batch, sizes):
    """A batch slower than the time limit is committed at once (not held until the next one is explained);
    faster batches are grouped until their explaining took the limit (0.3 s each: 4 batches reach 1.2 s)."""
    clock = [100.0]
    monkeypatch.setattr(engines.time, "monotonic", lambda: clock[0])

    class Slow(FakeWorker):
        def compute(self, items):
            clock[0] += seconds_per_batch
            return super().compute(items)

    w = Slow()
    _run(w, 20, 3, shard_size=300, shard_seconds=1.0)
    assert [len(c) for c in w.commits] == sizes


def test_ctrl_c_commits_what_was_explained_then_stops():
    w = FakeWorker(stop_at=5)  # batches 0-4 explained, Ctrl-C while explaining batch 5
    with pytest.raises(KeyboardInterrupt):
        _run(w, 40, 3, shard_size=6)
    assert [i for c in w.commits for i in c] == list(range(15))
    assert [len(c) for c in w.commits] == [6, 6, 3]


def test_merged_keeps_each_part_in_order():
    a = ([1, 2], ["t1"], [{"id": "f1"}])
    b = ([3], ["t2", "t3"], [])
    assert engines.merged([a]) is a
    assert engines.merged([a, b]) == ([1, 2, 3], ["t1", "t2", "t3"], [{"id": "f1"}])


def test_rows_do_not_depend_on_the_shard_size(tmp_path):
    lm = engines.ModelSpec().load()  # the embedded shapes model
    src = tmp_path / "src"
    write_shapes(src, 13, seed=5)
    (src / "broken.png").write_bytes(b"not a png")
    one = run_batch(src, tmp_path / "one", methods=["rollout", "raw"], batch_size=2, shard_size=1, loaded=lm)
    big = run_batch(src, tmp_path / "big", methods=["rollout", "raw"], batch_size=2, loaded=lm)
    assert (one.explained, one.failed, one.rows) == (big.explained, big.failed, big.rows) == (13, 1, 26)  # 14 handled
    assert len(list((tmp_path / "one" / "rows").glob("*.parquet"))) == 7  # one shard per batch of 2
    shards = sorted((tmp_path / "big" / "rows").glob("*.parquet"))
    assert len(shards) <= 2  # 14 inputs, 256 per shard: one shard unless a batch waited a second
    assert sum(pq.read_table(f).num_rows for f in shards) == 26
    assert_same_rows(read_batch(tmp_path / "one"), read_batch(tmp_path / "big"))


def test_shard_size_is_checked_and_is_for_the_local_engine():
    assert check_shard_size(None, "local") is None and check_shard_size(64, "local") == 64
    with pytest.raises(ValueError, match=r"shard_size must be in \[1, inf\], got 0"):
        check_shard_size(0, "local")
    with pytest.raises(TypeError, match=r"shard_size must be an integer, got .*'8'"):
        check_shard_size("8", "local")
    with pytest.raises(ValueError, match=r"shard_size=64 sizes the local engine's shards; with engine='ray' each actor"):
        check_shard_size(64, "ray")
