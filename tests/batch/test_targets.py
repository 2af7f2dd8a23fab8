"""Targets of a batch run and the Ray actor options: ``target=`` (one class for every input) and
``target_column=`` (one per input, from a table column or a JSONL field) give rows equal to
``explain(..., target=t)``; a changed target refuses to resume; ``num_gpus`` is validated and reaches
``map_batches`` and the actors' options without needing a GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("pyarrow")
pytest.importorskip("pandas")

import attnroll  # noqa: E402
from attnroll.batch import BatchMismatchError, list_items, read_batch, run_batch  # noqa: E402
from attnroll.batch.engines import ModelSpec, map_batches_options  # noqa: E402
from attnroll.batch.work import Job  # noqa: E402

from .helpers import pixel_input, write_shapes  # noqa: E402


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    return root, write_shapes(root, 6, seed=5)


@pytest.fixture(scope="module")
def shapes_model():
    from attnroll.models.shapes import load_shapes_model

    return load_shapes_model()


def _gae(model, path, target):
    return attnroll.explain(model, pixel_input(path), "gae", target=target)


@pytest.mark.slow  # over a second
def test_one_class_for_every_input_equals_explain_with_that_target(images, shapes_model, tmp_path):
    root, paths = images
    r = run_batch(root, tmp_path / "o", methods=["gae", "rollout"], target=2, batch_size=4)
    df = read_batch(tmp_path / "o", method="gae")
    assert r.explained == 6 and list(df["target"]) == [2] * 6
    for _, row in df.iterrows():
        e = _gae(shapes_model, root / row["id"], 2)
        np.testing.assert_allclose(np.asarray(row["scores"]), e.scores[0].numpy(), rtol=0, atol=2e-6)
        predicted = _gae(shapes_model, root / row["id"], None)
        if predicted.target[0] != 2:  # the target changes the map: the rows are not the predicted class's
            assert not np.allclose(np.asarray(row["scores"]), predicted.scores[0].numpy(), atol=1e-4)
    with pytest.raises(BatchMismatchError, match="different run \\(target: "):
        run_batch(root, tmp_path / "o", methods=["gae", "rollout"], target=1, batch_size=4)
    with pytest.raises(BatchMismatchError, match="different run \\(target: "):
        run_batch(root, tmp_path / "o", methods=["gae", "rollout"], batch_size=4)


def test_a_target_column_gives_each_input_its_class_and_empty_cells_the_predicted_one(images, shapes_model, tmp_path):
    root, paths = images
    labels = ["3", "", "0", "1", "", "2"]
    csv = tmp_path / "val.csv"
    csv.write_text("path,label\n" + "".join(f"{p},{t}\n" for p, t in zip(paths, labels)))
    assert [it.target for it in list_items(csv, "path", "label")] == [3, None, 0, 1, None, 2]
    run_batch(csv, tmp_path / "o", methods=["gae"], column="path", target_column="label", batch_size=4)
    df = read_batch(tmp_path / "o")
    for (_, row), p, t in zip(df.iterrows(), paths, labels):
        e = _gae(shapes_model, p, int(t) if t else None)
        assert row["target"] == e.target[0] and (not t or row["target"] == int(t))
        np.testing.assert_allclose(np.asarray(row["scores"]), e.scores[0].numpy(), rtol=0, atol=2e-6)


def test_a_jsonl_target_field_on_a_text_classifier(bert_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = [("the cat sat", 1), ("a dog ran", None), ("birds sing", 0)]
    jl = tmp_path / "t.jsonl"
    jl.write_text("".join(json.dumps({"text": s, "y": y}) + "\n" for s, y in texts))
    run_batch(jl, tmp_path / "o", methods=["gae"], model=str(bert_dir), target_column="y", batch_size=3)
    df = read_batch(tmp_path / "o")
    tok = AutoTokenizer.from_pretrained(bert_dir)
    model = AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    for (_, row), (s, y) in zip(df.iterrows(), texts):
        e = attnroll.explain(model, tok([s], return_tensors="pt"), "gae", target=y, tokenizer=tok, specials="keep")
        assert row["target"] == e.target[0]
        np.testing.assert_allclose(np.asarray(row["scores"]), e.scores[0].numpy(), atol=1e-5)


def test_bad_targets_name_the_row_and_what_is_expected(images, tmp_path):
    root, paths = images
    csv = tmp_path / "v.csv"
    csv.write_text(f"path,label\n{paths[0]},1.5\n")
    with pytest.raises(ValueError, match=r"row 0, column 'label'.*class index .* got 1.5"):
        list_items(csv, "path", "label")
    with pytest.raises(ValueError, match="target_column='y' is not a column"):
        run_batch(csv, tmp_path / "o", column="path", target_column="y")
    with pytest.raises(ValueError, match="target_column='label' applies to a Parquet / CSV table or a JSONL"):
        run_batch(root, tmp_path / "o", target_column="label")
    with pytest.raises(ValueError, match="target must be"):
        run_batch(root, tmp_path / "o", target=-1)
    assert not (tmp_path / "o" / "rows").exists()


def test_num_gpus_is_checked_and_reaches_the_actor_options(tmp_path):
    job = Job(["rollout"], {"rollout": {}}, "fp", str(tmp_path))
    spec = ModelSpec()
    on_gpu = map_batches_options(spec, job, 2, num_gpus=0.25)
    assert on_gpu["num_gpus"] == 0.25 and on_gpu["fn_constructor_kwargs"]["num_gpus"] == 0.25
    assert on_gpu["num_cpus"] == 2 and on_gpu["fn_constructor_kwargs"]["threads"] == 2
    assert on_gpu["batch_size"] == 1 and on_gpu["max_restarts"] == 0  # one row = one of our batches
    cpu = map_batches_options(spec, job, 1, num_gpus=0.0, restart=True)
    assert "num_gpus" not in cpu and "max_restarts" not in cpu  # a cluster keeps Ray Data's actor restarts
    for bad, what in ((-1, "num_gpus must be"), (1.5, "a share of one GPU"), ("x", "num_gpus must be"),
                      (0.5, "needs engine='ray'")):
        with pytest.raises((ValueError, TypeError), match=what):
            run_batch(tmp_path, tmp_path / "o", num_gpus=bad, engine="local")
    for bad, what in ((0, r"cpus_per_worker must be in \[1, inf\], got 0"), (1.0, "cpus_per_worker must be an integer"),
                      (2, "cpus_per_worker=2 sizes Ray actors; it needs engine='ray'")):
        with pytest.raises((ValueError, TypeError), match=what):
            run_batch(tmp_path, tmp_path / "o", cpus_per_worker=bad, engine="ray" if bad != 2 else "local")
