"""``attnroll batch`` through click's runner: the summary and exit codes, failures, refusing to mix runs,
overlays, and one-line usage errors."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("click")
pytest.importorskip("pyarrow")
from PIL import Image  # noqa: E402

from attnroll.batch import overlay_name, read_batch, read_failures, row_explanation  # noqa: E402

from ..batch.helpers import write_shapes  # noqa: E402
from .test_cli import one_line_error, run  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    write_shapes(root, 6)
    (root / "deeper" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    return root


def test_summary_failures_exit_code_and_resume(folder, tmp_path):
    out = tmp_path / "o"
    res = run("batch", folder, "--out", out, "-m", "rollout,raw", "--batch-size", "4")
    assert res.exit_code == 3, res.output  # completed, one input failed
    line = res.stdout.strip().splitlines()[-1]
    assert line.startswith("7 inputs: 6 explained now, 1 failed in ") and "; 12 rows in" in line
    assert list(read_failures(out)["id"]) == ["deeper/corrupt.jpg"]
    assert sorted(set(read_batch(out)["method"])) == ["raw", "rollout"]
    again = run("batch", folder, "--out", out, "-m", "rollout,raw", "--batch-size", "4")
    assert again.exit_code == 3 and "(7 done before): 0 explained now, 0 failed in " in again.stdout
    assert "; 1 failed in all; 12 rows" in again.stdout
    assert len(read_batch(out)) == 12


def test_a_different_run_is_refused_then_overwritten(folder, tmp_path):
    out = tmp_path / "o"
    assert run("batch", folder, "--out", out, "-m", "rollout").exit_code == 3
    msg = one_line_error(run("batch", folder, "--out", out, "-m", "rollout", "-o", "alpha=0.8"), 2)
    assert "different run (options:" in msg and "--overwrite" in msg
    res = run("batch", folder, "--out", out, "-m", "rollout", "-o", "alpha=0.8", "--overwrite")
    assert res.exit_code == 3 and '"alpha": 0.8' in read_batch(out)["options"][0]


def test_png_overlays_are_each_rows_map_over_its_image(folder, tmp_path):
    from attnroll import viz

    out = tmp_path / "o"
    assert run("batch", folder, "--out", out, "-m", "gae", "--png").exit_code == 3
    df = read_batch(out)
    assert len(df) == 6
    for _, row in df.iterrows():
        png = out / "png" / overlay_name(row["id"], "gae")
        want = viz.overlay(row_explanation(row), Image.open(folder / row["id"]).convert("RGB"))
        assert np.array_equal(np.asarray(Image.open(png)), np.asarray(want))


def test_usage_errors_are_one_line(folder, tmp_path):
    assert "unknown ['nope']" in one_line_error(run("batch", folder, "--out", tmp_path / "o", "-m", "nope"), 2)
    msg = one_line_error(run("batch", folder, "--out", tmp_path / "o", "--num-workers", "2"), 2)
    assert "for --engine ray" in msg
    (tmp_path / "notes.docx").write_text("x")
    assert "unsupported file type '.docx'" in one_line_error(run("batch", tmp_path / "notes.docx", "--out", tmp_path / "o"), 2)
    msg = one_line_error(run("batch", folder, "--out", tmp_path / "o", "-m", "rollout", "-o", "alpah=1"), 2)
    assert "none of the methods ['rollout'] takes alpah" in msg
    msg = one_line_error(run("batch", folder, "--out", tmp_path / "o", "-o", "alpah=1"), 2)  # no -m
    assert "no method takes alpah=" in msg
    assert not (tmp_path / "o").exists()


def test_ray_engine_without_ray_says_how_to_install(folder, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    msg = one_line_error(run("batch", folder, "--out", tmp_path / "o", "--engine", "ray"), 1)
    assert "pip install 'attnroll[ray]'" in msg


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """8 shapes images in one folder (what --data FOLDER reads), with batch outputs of two models."""
    root = tmp_path_factory.mktemp("flat")
    src = root / "imgs"
    src.mkdir()
    from attnroll.models import shapes

    from ..batch.helpers import to_uint8

    images, labels, _ = shapes.make_dataset(8, 21)
    for i, im in enumerate(images):
        Image.fromarray(to_uint8(im)).save(src / f"x{i}.png")
    for name, model in (("a", "shapes"), ("b", "shapes-marker")):
        assert run("batch", src, "--out", root / name, "-m", "rollout,gae", "--model", model).exit_code == 0
    return root


def _json(path):
    import json

    return json.loads(path.read_text())


@pytest.mark.slow
def test_evaluate_scores_a_batch_output_like_explaining_again(flat, tmp_path):
    common = ["--metrics", "deletion,positive", "--steps", "8"]
    res = run("evaluate", "--maps", flat / "a", "--out", tmp_path / "m", *common)
    assert res.exit_code == 0, res.output
    ref = run("evaluate", "--data", flat / "imgs", "--methods", "rollout,gae", "--out", tmp_path / "r", *common)
    assert ref.exit_code == 0, ref.output
    got, want = _json(tmp_path / "m" / "evaluation.json"), _json(tmp_path / "r" / "evaluation.json")
    assert got["precomputed"] == ["rollout", "gae"] and got["n"] == want["n"] == 8
    assert [r["method"] for r in got["rows"]] == [r["method"] for r in want["rows"]] == ["rollout", "gae"]
    for a, b in zip(got["rows"], want["rows"]):
        for k in ("deletion", "positive"):
            assert a[k] == pytest.approx(b[k], abs=1e-6)
    msg = one_line_error(run("evaluate", "--maps", flat / "a", "--model", "shapes-marker", "--out", tmp_path / "x"), 2)
    assert "made by another model" in msg
    assert "leave --data out" in one_line_error(run("evaluate", "--maps", flat / "a", "--data", "shapes"), 2)


@pytest.mark.slow
def test_audit_reads_two_batch_outputs_like_explaining_again(flat, tmp_path):
    res = run("audit", flat / "a", flat / "b", "-m", "gae", "--format", "png", "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    ref = run("audit", "shapes", "shapes-marker", "--data", flat / "imgs", "-m", "gae", "--format", "png",
              "--out", tmp_path / "r")
    assert ref.exit_code == 0, ref.output
    got, want = _json(tmp_path / "m" / "audit.json"), _json(tmp_path / "r" / "audit.json")
    for k in ("js", "spearman", "topk"):
        np.testing.assert_allclose(got[k], want[k], atol=1e-6)
    assert got["flagged"] == want["flagged"] and got["pred_b"] == want["pred_b"] and max(want["js"]) > 0.01
    # one side precomputed, the other explained here
    mixed = run("audit", flat / "a", "shapes-marker", "-m", "gae", "--format", "png", "--out", tmp_path / "x")
    assert mixed.exit_code == 0, mixed.output
    np.testing.assert_allclose(_json(tmp_path / "x" / "audit.json")["js"], want["js"], atol=1e-6)
    assert "no 'flow' maps" in one_line_error(run("audit", flat / "a", flat / "b", "-m", "flow"), 2)


@pytest.mark.slow
def test_evaluate_scores_a_text_batch_output_like_explaining_again(bert_dir, tmp_path):
    texts = tmp_path / "t.txt"  # lengths differ: the stored token maps are padded back onto one batch
    texts.write_text("the cat sat on the mat\na dog ran\nthe dog sat on a cat the end\ncat\n")
    res = run("batch", texts, "--out", tmp_path / "o", "-m", "rollout,gae", "--model", bert_dir)
    assert res.exit_code == 0, res.output
    got = run("evaluate", "--maps", tmp_path / "o", "--out", tmp_path / "m")
    assert got.exit_code == 0, got.output
    ref = run("evaluate", "--model", bert_dir, "--data", texts, "--methods", "rollout,gae", "--out", tmp_path / "r")
    assert ref.exit_code == 0, ref.output
    a, b = _json(tmp_path / "m" / "evaluation.json"), _json(tmp_path / "r" / "evaluation.json")
    assert a["precomputed"] == ["rollout", "gae"] and a["n"] == b["n"] == 4
    for x, y in zip(a["rows"], b["rows"]):
        assert x["method"] == y["method"]
        for k in ("comprehensiveness", "sufficiency"):
            assert x[k] == pytest.approx(y[k], abs=1e-6)


def test_target_flags_and_num_gpus_usage_errors(folder, tmp_path):
    import attnroll
    from attnroll.models.shapes import load_shapes_model

    out = tmp_path / "o"
    assert run("batch", folder, "--out", out, "-m", "gae", "--target", "1").exit_code == 3  # the corrupt file
    df = read_batch(out)
    model = load_shapes_model()
    from ..batch.helpers import pixel_input

    for _, row in df.iterrows():
        e = attnroll.explain(model, pixel_input(folder / row["id"]), "gae", target=1)
        np.testing.assert_allclose(np.asarray(row["scores"]), e.scores[0].numpy(), atol=2e-6)
    assert set(df["target"]) == {1}
    msg = one_line_error(run("batch", folder, "--out", tmp_path / "x", "--target", "1", "--target-column", "y"), 2)
    assert "give one" in msg
    assert "needs engine='ray'" in one_line_error(run("batch", folder, "--out", tmp_path / "x", "--num-gpus", "0.5"), 2)
    assert "cpus_per_worker=2 sizes Ray actors" in one_line_error(
        run("batch", folder, "--out", tmp_path / "x", "--cpus-per-worker", "2"), 2)
    assert "shard_size=8 sizes the local engine's shards" in one_line_error(
        run("batch", folder, "--out", tmp_path / "x", "--engine", "ray", "--shard-size", "8"), 2)
    assert "applies to a Parquet / CSV table" in one_line_error(
        run("batch", folder, "--out", tmp_path / "x", "--target-column", "y"), 2)
    assert not (tmp_path / "x").exists()


def test_audit_reads_text_batch_outputs_like_explaining_again(bert_dir, tmp_path):
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from attnroll.evaluate.audit import audit

    other = tmp_path / "bert2"  # the same architecture, other weights
    shutil.copytree(bert_dir, other)
    m2 = AutoModelForSequenceClassification.from_pretrained(other)
    with torch.no_grad():
        for p in m2.bert.encoder.parameters():
            p.mul_(1.3)
    m2.save_pretrained(other)
    texts = ["the cat sat on the mat", "a dog ran", "the dog sat on a cat the end", "cat"]
    (tmp_path / "t.txt").write_text("\n".join(texts) + "\n")
    for name, model in (("a", bert_dir), ("b", other)):
        assert run("batch", tmp_path / "t.txt", "--out", tmp_path / name, "-m", "gae", "--model", model).exit_code == 0
    res = run("audit", tmp_path / "a", tmp_path / "b", "-m", "gae", "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    tok = AutoTokenizer.from_pretrained(bert_dir)
    ma = AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    want = audit(ma, m2.eval(), enc, method="gae").as_dict()
    got = _json(tmp_path / "m" / "audit.json")
    for k in ("js", "spearman", "topk"):
        np.testing.assert_allclose(got[k], want[k], atol=1e-6)
    assert got["pred_a"] == want["pred_a"] and got["pred_b"] == want["pred_b"] and max(want["js"]) > 1e-3
    mixed = run("audit", tmp_path / "a", other, "-m", "gae", "--out", tmp_path / "x")  # B explained here
    assert mixed.exit_code == 0, mixed.output
    np.testing.assert_allclose(_json(tmp_path / "x" / "audit.json")["js"], want["js"], atol=1e-6)
    assert "--format html" in one_line_error(run("audit", tmp_path / "a", tmp_path / "b", "-m", "gae",
                                                 "--format", "png"), 2)
