"""``attnroll evaluate`` and ``attnroll audit`` through click's test runner: the table / CSV equal the library on
the same data, the audit verdicts, exit codes and one-line errors, nothing half-written."""

import csv
import io
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("click")
pytest.importorskip("matplotlib")
T = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from attnroll.evaluate.suite import evaluate_methods  # noqa: E402
from attnroll.models import shapes  # noqa: E402

from .test_cli import one_line_error, run  # noqa: E402  (the same runner and one-line-error check)


@pytest.mark.slow
def test_evaluate_csv_matches_the_library(tmp_path):
    res = run("evaluate", "--n", 6, "--seed", 3, "--methods", "rollout,random", "--steps", 4, "--batch-size", 4,
              "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path)) == ["curves.png", "evaluation.csv", "evaluation.json"]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "evaluation.csv").read_text())))
    assert [r["method"] for r in rows] == ["rollout", "random"]
    images, labels, masks = shapes.make_dataset(6, 3)
    want = evaluate_methods(shapes.load_shapes_model(), shapes.preprocess(images), ["rollout", "random"],
                            labels=labels, masks=shapes.patch_masks(masks), steps=4, batch_size=4,
                            fill=-1.0)  # --fill black: a black pixel is -1 after the shapes preprocessing
    for r in rows:
        for k in ("deletion", "insertion", "positive", "negative", "pointing", "mass", "iou"):
            assert float(r[k]) == pytest.approx(want.values[r["method"]][k], rel=1e-5, abs=1e-9), (r["method"], k)
    rec = json.loads((tmp_path / "evaluation.json").read_text())
    assert rec["n"] == 6 and rec["seed"] == 3 and set(rec["curves"]) == {"rollout", "random"}
    assert Image.open(tmp_path / "curves.png").size[0] > 400
    assert "rollout" in res.output and "deletion" in res.output


def test_evaluate_method_options_reach_the_method(tmp_path):
    # -o alpha=0.9 changes rollout's maps, so its localisation numbers must equal the library run with alpha=0.9
    res = run("evaluate", "--n", 4, "--methods", "rollout", "--metrics", "mass,iou", "-o", "rollout.alpha=0.9",
              "--out", tmp_path)
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO((tmp_path / "evaluation.csv").read_text())))
    images, labels, masks = shapes.make_dataset(4, 12345)
    want = evaluate_methods(shapes.load_shapes_model(), shapes.preprocess(images), ["rollout"],
                            masks=shapes.patch_masks(masks), metrics=["mass", "iou"],
                            method_options={"rollout": {"alpha": 0.9}})
    assert float(rows[0]["mass"]) == pytest.approx(want.values["rollout"]["mass"], rel=1e-5)
    assert sorted(os.listdir(tmp_path)) == ["evaluation.csv", "evaluation.json"]  # no curves to draw


@pytest.mark.slow
def test_evaluate_fill_mean_and_number(tmp_path):
    images, labels, _ = shapes.make_dataset(3, 4)
    model, x = shapes.load_shapes_model(), shapes.preprocess(images)
    for fill, value in (("mean", 0.0), ("0.25", 0.25)):
        res = run("evaluate", "--n", 3, "--seed", 4, "--methods", "rollout", "--metrics", "positive", "--fill", fill,
                  "--out", tmp_path / fill)
        assert res.exit_code == 0, res.output
        rows = list(csv.DictReader(io.StringIO((tmp_path / fill / "evaluation.csv").read_text())))
        want = evaluate_methods(model, x, ["rollout"], metrics=["positive"], fill=value)
        assert float(rows[0]["positive"]) == pytest.approx(want.values["rollout"]["positive"])


@pytest.mark.parametrize("args, code, words", [
    (("--fill", "grey"), 2, "--fill must be"),
    (("--methods", "rollout,nope"), 2, "unknown"),
    (("--metrics", "speed"), 2, "speed"),
    (("-o", "per_head_rollout.alpha=1"), 2, "not among the evaluated"),
    (("--methods", "rollout,gae", "-o", "gae.alpha=1"), 2, "makes no sense for method 'gae'"),
    (("--methods", "rollout", "-o", "n_steps=3"), 2, "takes n_steps"),
    (("--data", "no/such/folder"), 2, "neither a folder"),
])
def test_evaluate_usage_errors(tmp_path, args, code, words):
    line = one_line_error(run("evaluate", "--n", 2, "--out", tmp_path / "o", *args), code)
    assert words in line
    assert not (tmp_path / "o" / "evaluation.csv").exists()


@pytest.mark.slow
def test_evaluate_folder_has_no_masks(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    images, _, _ = shapes.make_dataset(3, 5)
    for i, im in enumerate(images):
        Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(d / f"s{i}.png")
    line = one_line_error(run("evaluate", "--data", d, "--metrics", "pointing", "--out", tmp_path / "o"), 2)
    assert "masks" in line
    res = run("evaluate", "--data", d, "--methods", "rollout", "--steps", 2, "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO((tmp_path / "o" / "evaluation.csv").read_text())))
    assert "pointing" not in rows[0] and float(rows[0]["deletion"]) >= 0


def test_evaluate_method_that_cannot_serve_the_model(tmp_path):
    line = one_line_error(run("evaluate", "--n", 2, "--methods", "rollout,encdec_rollout", "--out", tmp_path), 1)
    assert "'encdec_rollout' cannot explain this model" in line and "encoder-decoder" in line
    assert os.listdir(tmp_path) == []


def test_evaluate_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    line = one_line_error(run("evaluate", "--data", tmp_path / "empty", "--out", tmp_path / "o"), 1)
    assert "no images" in line


@pytest.mark.slow
def test_audit_identical_models_flag_nothing(tmp_path):
    res = run("audit", "shapes", "shapes", "--n", 12, "--format", "png", "--fail-if-flagged", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path)) == ["audit.json", "audit.png", "audit.view.html"]
    rec = json.loads((tmp_path / "audit.json").read_text())
    assert rec["flagged"] is False


@pytest.mark.slow
def test_audit_flags_the_spurious_cue(tmp_path):
    res = run("audit", "shapes", "shapes-marker", "--n", 24, "--fail-if-flagged", "--out", tmp_path)
    assert res.exit_code == 3, res.output
    assert "marker" in res.output
    rec = json.loads((tmp_path / "audit.json").read_text())
    assert rec["flagged"] is True and rec["shift"]["marker"] > 0.05
    page = (tmp_path / "audit.html").read_text()
    assert "<img" in page and "marker" in page
    from attnroll.viz.viewer import read_payload

    shown = read_payload((tmp_path / "audit.view.html").read_text(encoding="utf-8"))["examples"]
    order = sorted(range(24), key=lambda i: (-rec["js"][i], i))[:8]  # the most-changed examples, first first
    assert len(shown) == 8 and all(len(ex["panels"]) == 3 and ex["outline"] for ex in shown)
    assert [int(ex["label"].split(" · ")[0].split()[1]) for ex in shown] == order
    # without --fail-if-flagged the same finding is a report, not a failure
    assert run("audit", "shapes", "shapes-marker", "--n", 8, "--out", tmp_path / "b").exit_code == 0
    # thresholds above every observed value flag nothing
    res = run("audit", "shapes", "shapes-marker", "--n", 24, "--js-threshold", 1, "--shift-threshold", 1,
              "--fail-if-flagged", "--out", tmp_path / "c")
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "c" / "audit.json").read_text())
    assert rec["flagged"] is False and rec["settings"]["js_threshold"] == 1.0


def test_audit_errors(tmp_path):
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=64, patch_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, num_labels=4)
    vit = tmp_path / "vit16"
    T.ViTForImageClassification(cfg).eval().save_pretrained(vit)
    line = one_line_error(run("audit", "shapes", vit, "--n", 2, "--out", tmp_path / "o"), 1)
    assert "grid" in line and "(8, 8)" in line and "(4, 4)" in line
    assert not (tmp_path / "o" / "audit.html").exists()
    line = one_line_error(run("audit", "shapes", "shapes", "--method", "nope", "--out", tmp_path / "o"), 2)
    assert "nope" in line
    (tmp_path / "empty").mkdir()
    line = one_line_error(run("audit", "shapes", "shapes", "--data", tmp_path / "empty", "--out", tmp_path / "o"), 1)
    assert "no images" in line


TEXTS = ["the cat sat on the mat", "a dog ran", "", "the dog sat on a cat mat", "a cat ran on the mat"]


@pytest.mark.slow
def test_evaluate_text_classifier_matches_the_library(bert_dir, tmp_path):
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(TEXTS) + "\n")
    res = run("evaluate", "--model", bert_dir, "--data", f, "--methods", "rollout,random", "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path / "o")) == ["curves.png", "evaluation.csv", "evaluation.json"]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "o" / "evaluation.csv").read_text())))
    from attnroll.evaluate import comprehensiveness, sufficiency
    from attnroll.evaluate.suite import explain_scores

    tok = T.AutoTokenizer.from_pretrained(bert_dir)
    model = T.AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    enc = tok([t for t in TEXTS if t], padding=True, return_tensors="pt", return_special_tokens_mask=True)
    plain = {k: v for k, v in enc.items() if k != "special_tokens_mask"}
    for r in rows:
        s, _ = explain_scores(model, plain, r["method"])
        assert float(r["comprehensiveness"]) == pytest.approx(comprehensiveness(model, enc, s).value, abs=1e-6)
        assert float(r["sufficiency"]) == pytest.approx(sufficiency(model, enc, s).value, abs=1e-6)


def test_evaluate_text_errors(bert_dir, tmp_path):
    f = tmp_path / "texts.txt"
    f.write_text("the cat\n")
    line = one_line_error(run("evaluate", "--model", bert_dir, "--out", tmp_path / "o"), 2)  # default data: shapes
    assert "text file" in line
    line = one_line_error(run("evaluate", "--model", bert_dir, "--data", f, "--metrics", "deletion",
                              "--out", tmp_path / "o"), 2)
    assert "do not apply" in line
    (tmp_path / "blank.txt").write_text("\n  \n")
    line = one_line_error(run("evaluate", "--model", bert_dir, "--data", tmp_path / "blank.txt", "--out", tmp_path / "o"), 1)
    assert "no text" in line
    line = one_line_error(run("evaluate", "--metrics", "sufficiency", "--n", 2, "--out", tmp_path / "o"), 2)
    assert "do not apply" in line


@pytest.mark.slow
def test_shipped_weights_load_as_a_classifier_folder(tmp_path):
    # config.json names the architecture, so a plain transformers folder load builds the classifier (with its
    # head), and the audit against the embedded model sees the same model
    res = run("audit", "shapes", shapes.WEIGHTS_DIR, "--n", 6, "--fail-if-flagged", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "audit.json").read_text())
    assert rec["flagged"] is False and max(rec["js"]) < 1e-6


@pytest.mark.slow
def test_console_script_passes_the_exit_code_to_the_shell():
    import subprocess
    import sys

    want = {("methods",): 0, ("evaluate", "--methods", "nope"): 2, ("audit", "shapes", "no/such/model"): 1}
    # The three processes run at once: each spends most of its time importing, so together they take the
    # time of the slowest rather than the sum.
    procs = {args: subprocess.Popen([sys.executable, "-c", "from attnroll._entry import main; main()", *args],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for args in want}
    try:
        assert {args: p.wait(timeout=120) for args, p in procs.items()} == want
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


@pytest.mark.slow
def test_sanity_matches_the_library(tmp_path):
    from attnroll.evaluate import cascading_randomization

    res = run("sanity", "--n", 4, "--methods", "rollout,gae", "--components", "value", "--seeds", "0,1",
              "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path)) == ["sanity.csv", "sanity.json", "sanity.png"]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "sanity.csv").read_text())))
    x = shapes.preprocess(shapes.make_dataset(4, 12345)[0])
    runs = [cascading_randomization(shapes.load_shapes_model(), x, ["rollout", "gae"], component="value", seed=s)
            for s in (0, 1)]
    for r in rows:
        i = runs[0].steps.index(r["step"])
        vals = [run_.correlations[r["method"]][i] for run_ in runs]
        assert float(r["mean"]) == pytest.approx(np.mean(vals), abs=1e-5)
        assert float(r["min_over_seeds"]) == pytest.approx(min(vals), abs=1e-5)
    top = {r["method"]: float(r["mean"]) for r in rows if r["step"] == "classifier"}
    assert top["rollout"] == pytest.approx(1.0) and top["gae"] < 0.99  # rollout never reads the head


@pytest.mark.parametrize("args, words", [
    (("--components", "heads"), "--components"),
    (("--seeds", "a,b"), "--seeds"),
    (("--methods", "nope"), "unknown"),
])
def test_sanity_usage_errors(tmp_path, args, words):
    line = one_line_error(run("sanity", "--n", 2, "--out", tmp_path / "o", *args), 2)
    assert words in line
