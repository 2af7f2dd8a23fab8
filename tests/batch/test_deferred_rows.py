"""The engine's rows built at commit time (``store.PendingRows``) and the batch's pixels concatenated by the
reader (``Worker.load``): the table against one built by ``pa.array`` from plain lists, the committed rows
against ``explain`` on each input (computed here from the PNG alone), and the paths where the reader's
concatenation does not apply (two target groups, images of different sizes) against the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")

import attnroll  # noqa: E402
from attnroll.batch import store  # noqa: E402
from attnroll.batch.sources import list_items  # noqa: E402
from attnroll.batch.work import Job, Worker, _stack  # noqa: E402

from .helpers import pixel_input, write_shapes  # noqa: E402


def test_pending_rows_give_the_table_pa_array_builds():
    """Ragged rows (token lengths 6 and 4, prefix 1): scores = full[b, 1:len_b], prefix_scores = full[b, :1]."""
    full = np.arange(12, dtype=np.float32).reshape(2, 6) / 7
    columns = {"index": [4, 5], "id": ["line:5", "line:6"], "source": ["a b", "c\td"], "method": ["raw"] * 2,
               "options": ["{}"] * 2, "target": [None, 1], "target_name": [None, "one"], "prediction": [0, 1],
               "probability": [0.5, 0.75], "grid": [None, None], "tokens": [list("abcdef"), list("wxyz")],
               "model": ["f" * 16] * 2}
    pending = store.PendingRows(columns, full, 1, [6, 4])
    assert pending.num_rows == 2
    plain = {**columns, "scores": [full[0, 1:6].tolist(), full[1, 1:4].tolist()],
             "prefix_scores": [full[0, :1].tolist(), full[1, :1].tolist()]}
    schema = store.row_schema()
    want = pa.Table.from_arrays([pa.array(plain[f.name], type=f.type) for f in schema], schema=schema)
    assert store.as_table(pending).equals(want)
    assert store.as_table(want) is want


@pytest.fixture(scope="module")
def worker_and_items(tmp_path_factory):
    from attnroll.models import load_model

    root = tmp_path_factory.mktemp("shapes-deferred")
    write_shapes(root, 6)
    lm = load_model(None, None, want="image")
    names = ["rollout"]
    job = Job(names, {"rollout": {}}, "f" * 16, str(tmp_path_factory.mktemp("out") / "run"))
    return Worker(lm, job), list_items(root)


def _rows(worker: Worker, computed: tuple) -> list[dict]:
    _, tables, _ = computed
    return [r for t in tables for r in store.as_table(t).to_pylist()]


def _check_against_explain(worker: Worker, rows: list[dict], items: list) -> None:
    """Each row's scores equal explain(rollout) on that input alone, from its PNG read here."""
    by_id = {it.id: it for it in items}
    assert sorted(r["id"] for r in rows) == sorted(by_id)
    for r in rows:
        e = attnroll.explain(worker.lm.model, pixel_input(by_id[r["id"]].path), "rollout",
                             **({} if r["target"] is None else {"target": r["target"]}))
        np.testing.assert_allclose(r["scores"], e.scores[0].numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(r["prefix_scores"], e.full_row[0, : e.prefix].numpy(), atol=1e-5, rtol=0)
        assert json.loads(r["options"])["attention"] == "recompute"


def test_the_readers_concatenation_gives_each_inputs_own_explanation(worker_and_items):
    worker, items = worker_and_items
    loaded = worker.load(items)
    torch.testing.assert_close(loaded[4], torch.cat([p[1] for p in loaded[2]]), atol=0, rtol=0)
    _check_against_explain(worker, _rows(worker, worker.compute(loaded)), items)


def test_two_target_groups_and_no_concatenation_give_the_same_rows(worker_and_items):
    """Items with their own class (one group) and without (another): each group concatenates its own
    pixels, as it does when the reader could not concatenate them (``stacked`` None)."""
    import dataclasses

    worker, items = worker_and_items
    mixed = [dataclasses.replace(it, target=1) if k % 2 else it for k, it in enumerate(items)]
    loaded = worker.load(mixed)
    rows = _rows(worker, worker.compute(loaded))
    assert sorted(r["target"] for r in rows if r["index"] % 2) == [1, 1, 1]
    _check_against_explain(worker, rows, mixed)
    unstacked = _rows(worker, worker.compute(loaded[:4] + (None,)))
    assert sorted(unstacked, key=lambda r: r["index"]) == sorted(rows, key=lambda r: r["index"])


def test_pixels_that_do_not_concatenate_are_left_to_the_groups():
    a, b = (None, torch.zeros(1, 3, 4, 4)), (None, torch.zeros(1, 3, 5, 5))
    assert _stack([a, b]) is None and _stack([]) is None
    torch.testing.assert_close(_stack([a, a]), torch.zeros(2, 3, 4, 4))
