"""The batch engine's per-run work: ``explain.explainer.Prepared`` (explain with the method, options and model facts
resolved once) against a fresh ``explain`` on the same inputs, call after call; a batch whose explain fails
for one input through it (that input fails alone, the others equal ``explain`` alone); the final counts of a
new output taken from its commits against the shards read back; the start-up objects frozen only for the
local run (``engines.heap_frozen``)."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch

pq = pytest.importorskip("pyarrow.parquet")

import attnroll  # noqa: E402
from attnroll.batch import read_manifest, run_batch, store  # noqa: E402
from attnroll.batch.engines import heap_frozen  # noqa: E402
from attnroll.batch.sources import list_items  # noqa: E402
from attnroll.batch.work import Job, Worker  # noqa: E402
from attnroll.capture import model_facts  # noqa: E402
from attnroll.explain.explainer import Prepared  # noqa: E402

from .helpers import pixel_input, write_shapes  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from attnroll.models import load_model

    root = tmp_path_factory.mktemp("shapes-prepared")
    paths = write_shapes(root, 8, seed=5)
    return load_model(None, None, want="image"), root, paths


def _same(a, b) -> None:
    """Two Explanations of the same inputs: equal maps (to float32 rounding), targets, options, rows."""
    torch.testing.assert_close(a.full_row, b.full_row, atol=1e-6, rtol=0)
    torch.testing.assert_close(a.scores, b.scores, atol=1e-6, rtol=0)
    assert (a.target, a.options, a.positions, a.grid, a.prefix, a.method) == (
        b.target, b.options, b.positions, b.grid, b.prefix, b.method)


@pytest.mark.parametrize("method, options", [("rollout", {}), ("rollout", {"alpha": 0.3, "start_layer": 1}),
                                             ("gae", {}), ("raw", {"attention": "dense"})])
def test_prepared_equals_a_fresh_explain_call_after_call(shapes, method, options):
    lm, _, paths = shapes
    prepared = Prepared(lm.model, method, **options)
    for k, target in [(0, None), (2, 1), (4, [0, 2]), (6, None)]:
        x = torch.cat([pixel_input(p) for p in paths[k : k + 2]])
        with torch.set_grad_enabled(prepared.method.needs_grad):
            got = prepared(x, target)
        _same(got, attnroll.explain(lm.model, x, method, target, **options))
    if options.get("attention") == "dense":  # the dense route asks no facts
        assert "facts" not in prepared.memo
        return
    want, kept = model_facts(lm.model, anatomy=False), prepared.memo["facts"]  # remembered, not another's
    assert {f.name: getattr(kept, f.name) for f in dataclasses.fields(want)} == vars(want)


def test_prepared_checks_options_once_and_each_calls_overrides(shapes):
    lm, _, paths = shapes
    x = pixel_input(paths[0])
    with pytest.raises(ValueError, match="alpha") as built:
        Prepared(lm.model, "rollout", alpha=2.0)
    with pytest.raises(ValueError) as called:
        attnroll.explain(lm.model, x, "rollout", alpha=2.0)
    assert str(built.value) == str(called.value)
    with pytest.raises(ValueError, match="no option 'bogus'"):
        Prepared(lm.model, "rollout", bogus=1)
    control = Prepared(lm.model, "random", seed=3)
    _same(control(x, seed=10), attnroll.explain(lm.model, x, "random", seed=10))
    _same(control(x), attnroll.explain(lm.model, x, "random", seed=3))
    with pytest.raises(ValueError, match="no option 'alpha'"):
        control(x, alpha=0.5)


def test_an_input_whose_explain_fails_fails_alone_and_the_others_equal_explain(shapes, tmp_path):
    """Class 99 does not exist: the batch's one call fails, then each input is explained alone (through the
    same prepared explain), the bad one becomes a failure naming the target."""
    lm, root, paths = shapes
    items = [dataclasses.replace(it, target=99 if k == 2 else 1) for k, it in enumerate(list_items(root)[:5])]
    worker = Worker(lm, Job(["rollout", "gae"], {"rollout": {}, "gae": {}}, "f" * 16, str(tmp_path / "o")))
    tables, failures = worker.explain(items)
    assert sorted((f["id"], f["method"]) for f in failures) == [(items[2].id, "gae"), (items[2].id, "rollout")]
    assert all("target" in f["reason"] for f in failures)
    rows = [r for t in tables for r in t.to_pylist()]
    assert sorted((r["id"], r["method"]) for r in rows) == sorted(
        (it.id, m) for k, it in enumerate(items) if k != 2 for m in ("rollout", "gae"))
    for r in rows:
        path = next(it.path for it in items if it.id == r["id"])
        with torch.set_grad_enabled(r["method"] == "gae"):
            e = attnroll.explain(lm.model, pixel_input(path), r["method"], 1)
        np.testing.assert_allclose(r["scores"], e.scores[0].numpy(), atol=2e-6, rtol=0)
        assert r["target"] == 1


def _shard_counts(out) -> dict:
    """The manifest's counts computed here from the shards' id columns."""
    rows = [i for f in sorted((out / "rows").glob("*.parquet")) for i in pq.read_table(f).column("id").to_pylist()]
    failed = {i for f in sorted((out / "failures").glob("*.parquet")) for i in pq.read_table(f).column("id").to_pylist()}
    return {"explained": len(set(rows) - failed), "failed": len(failed), "rows": len(rows)}


def test_a_new_outputs_counts_from_its_commits_equal_the_shards_and_a_resumed_one_reads_them(shapes, tmp_path,
                                                                                           monkeypatch):
    lm, root, _ = shapes
    src = tmp_path / "src"
    write_shapes(src, 7, seed=8)
    (src / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "out"
    reads, read = [], store.scan  # called by the resume's listing, and by _finish to count
    monkeypatch.setattr(store, "scan", lambda o: reads.append(o) or read(o))
    first = run_batch(src, out, methods=["rollout", "raw"], batch_size=3, shard_size=3, loaded=lm)  # 3 shards
    counts = read_manifest(out)["counts"]
    assert reads == [out] and {k: counts[k] for k in ("explained", "failed", "rows")} == _shard_counts(out)
    assert (first.explained, first.failed, first.rows, counts["missing"]) == (7, 1, 14, 0)  # (8 inputs handled)
    lost = sorted((out / "rows").glob("*.parquet"))[1]
    lost.unlink()  # the rerun explains only that shard's inputs, and counts the whole output from the shards
    again = run_batch(src, out, methods=["rollout", "raw"], batch_size=3, loaded=lm)
    counts = read_manifest(out)["counts"]
    assert reads == [out] * 3 and {k: counts[k] for k in ("explained", "failed", "rows")} == _shard_counts(out)
    assert (again.explained, again.failed, again.rows, counts["missing"]) == (3, 1, 14, 0)


def test_the_objects_of_before_the_run_are_frozen_only_during_it():
    assert gc.get_freeze_count() == 0
    before = len(gc.get_objects())
    with heap_frozen():
        assert gc.get_freeze_count() >= before
        assert len(gc.get_objects()) < before  # the collector's generations no longer hold them
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= before
    gc.freeze()  # a process that froze its own objects: left as it is
    try:
        mine = gc.get_freeze_count()
        with heap_frozen():
            assert gc.get_freeze_count() == mine
        assert gc.get_freeze_count() == mine
    finally:
        gc.unfreeze()


def test_a_local_run_leaves_nothing_frozen(shapes, tmp_path):
    lm, root, _ = shapes
    run_batch(root, tmp_path / "o", batch_size=4, loaded=lm)
    assert gc.get_freeze_count() == 0
