"""The Ray actor's own logic, without Ray: batches travel as one row each (the items round-trip exactly), an
actor running several calls at once in threads (as Ray Data runs it) explains one batch at a time, commits
every input exactly once and writes the local engine's rows, and a killed run's surviving worker commits
nothing once a rerun has started."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pandas")

from attnroll.batch import list_items, read_batch, read_manifest, run_batch  # noqa: E402
from attnroll.batch.engines import ACTOR_CALLS, ModelSpec, RayWorker, batch_items, batch_rows  # noqa: E402
from attnroll.batch.run import resolve_methods  # noqa: E402
from attnroll.batch.sources import Item  # noqa: E402
from attnroll.batch import store  # noqa: E402
from attnroll.batch.work import Job, Worker  # noqa: E402

from .helpers import assert_same_rows, write_shapes  # noqa: E402


def as_ray_batch(rows: list[dict]) -> dict:
    """What Ray Data hands a ``batch_format="numpy"`` call: one numpy array per column."""
    return {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}


def test_batch_rows_round_trip_every_field_and_keep_the_local_chunks():
    items = [Item(0, "a.png", "image", path="/x/a.png"), Item(1, "line:2", "text", text="one", pair="two", target=3),
             Item(2, "row:3", "text", text="tab\there", target=0),
             Item(3, "b", "image", path="/x/ü b.png", target=None)]
    rows = batch_rows(items, 3)
    assert [json.loads(r["items"])[0]["index"] for r in rows] == [r["first"] for r in rows] == [0, 3]
    assert [len(json.loads(r["items"])) for r in rows] == [3, 1]  # the local engine's chunks of 3
    assert batch_items(as_ray_batch(rows)) == items
    assert [batch_items(as_ray_batch([r])) for r in rows] == [items[:3], items[3:]]


class Recording(RayWorker):
    """A RayWorker that records how many compute steps run at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.running, self.most, self.guard = 0, 0, threading.Lock()
        compute = self.worker.compute

        def counted(loaded):
            with self.guard:
                self.running += 1
                self.most = max(self.most, self.running)
            try:
                return compute(loaded)
            finally:
                with self.guard:
                    self.running -= 1

        self.worker.compute = counted


def test_concurrent_actor_calls_commit_every_input_once_with_the_local_rows(tmp_path):
    src = tmp_path / "shapes"
    write_shapes(src, 24)
    local = tmp_path / "local"
    run_batch(src, local, methods=["rollout", "gae"], batch_size=4)
    names, opts = resolve_methods(["rollout", "gae"], None)
    fp = read_manifest(local)["key"]["model"]
    out = tmp_path / "actor"
    actor = Recording(ModelSpec(), Job(names, opts, fp, str(out)), threads=1)
    rows = batch_rows(list_items(src), 4)
    with ThreadPoolExecutor(max_workers=ACTOR_CALLS) as pool:  # Ray Data's threads in one actor
        counts = list(pool.map(lambda r: actor(as_ray_batch([r])), rows))
    shutil.copy(local / "manifest.json", out / "manifest.json")  # what run_batch writes around the actors
    assert actor.most == 1  # the model's hooks are never shared by two explains
    assert sum(int(c["inputs"][0]) for c in counts) == 24 and sum(int(c["rows"][0]) for c in counts) == 48
    df = read_batch(out)
    ids = [it.id for it in list_items(src)]
    assert sorted(df["id"]) == sorted(ids * 2)
    assert len(list((out / "rows").glob("part-*.parquet"))) == len(rows)  # one shard per batch
    assert_same_rows(read_batch(local), df)


def test_a_killed_runs_surviving_worker_commits_nothing_once_a_rerun_started(tmp_path, monkeypatch):
    """The old run's worker (a Ray actor that outlived its driver) commits a batch exactly while the rerun
    lists what is missing: it is refused, and the rerun explains that batch once."""
    import pyarrow.parquet as pq

    src, out = tmp_path / "shapes", tmp_path / "o"
    write_shapes(src, 12)
    run_batch(src, out, batch_size=4, shard_size=4)  # three shards
    meta = read_manifest(out)
    names, opts = resolve_methods(["rollout"], None)
    orphan = Worker(ModelSpec().load(), Job(names, opts, meta["key"]["model"], str(out), run=meta["run"]))
    lost = sorted((out / "rows").glob("part-*.parquet"))[1]
    lost_ids = set(pq.read_table(lost, columns=["id"]).column("id").to_pylist())
    lost.unlink()
    outcome, listing = [], store.scan

    def orphan_commits_while_listed(folder):
        if outcome:  # the listing of what is missing only (not the count at the end)
            return listing(folder)
        try:
            orphan([it for it in list_items(src) if it.id in lost_ids])
            outcome.append("committed")
        except store.StaleRunError:
            outcome.append("refused")
        return listing(folder)

    monkeypatch.setattr(store, "scan", orphan_commits_while_listed)
    again = run_batch(src, out, batch_size=4)
    assert outcome == ["refused"] and again.explained == len(lost_ids) == 4
    assert sorted(read_batch(out)["id"]) == sorted(it.id for it in list_items(src))  # each input once
    assert read_manifest(out)["run"] not in (None, meta["run"])
