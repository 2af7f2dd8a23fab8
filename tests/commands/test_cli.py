"""The attnroll command through click's test runner: outputs match attnroll.explain, every error path is one
line with the right exit code, nothing half-written."""

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("click")
pytest.importorskip("matplotlib")
T = pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from PIL import Image  # noqa: E402

import attnroll  # noqa: E402
from attnroll.commands import cli  # noqa: E402
from attnroll.explain.explanation import Explanation  # noqa: E402


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, num_labels=3, initializer_range=0.3,
                      id2label={0: "cat", 1: "dog", 2: "fish"}, label2id={"cat": 0, "dog": 1, "fish": 2})
    d = tmp_path_factory.mktemp("vit")
    T.ViTForImageClassification(cfg).eval().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(d / f"im{i}.png")
    return d


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(res, code):
    assert res.exit_code == code, (res.exit_code, res.output)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


def pixels(path):
    arr = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    return ((torch.from_numpy(arr).permute(2, 0, 1) - 0.5) / 0.5)[None]


# -------------------------------------------------------------------------------------------- commands
def test_help_everywhere():
    for args in ([], ["--help"], ["explain", "--help"], ["demo", "--help"], ["methods", "--help"], ["view", "--help"]):
        res = run(*args)
        assert res.exit_code == 0 and "Usage:" in res.output


def test_methods_lists_every_registered_method():
    res = run("methods")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    names = list(attnroll.methods())
    assert len(lines) == len(names)
    for name, line in zip(names, lines):
        assert line.split()[0] == name
    assert "Abnar & Zuidema" in res.output and "Chefer" in res.output


def test_explain_image_outputs_match_the_api(vit_dir, pictures, tmp_path):
    img = pictures / "im0.png"
    res = run("explain", img, "--model", vit_dir, "-m", "gae", "--format", "png,json,npz,html", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path)) == ["im0.gae.html", "im0.gae.json", "im0.gae.npz", "im0.gae.png"]
    model = T.ViTForImageClassification.from_pretrained(vit_dir).eval()
    want = attnroll.explain(model, pixels(img), method="gae")
    got = Explanation.load(tmp_path / "im0.gae.npz")
    torch.testing.assert_close(got.scores, want.scores)
    rec = json.loads((tmp_path / "im0.gae.json").read_text())
    assert rec["method"] == "gae" and rec["grid"] == [4, 4] and rec["target"] == want.target
    np.testing.assert_allclose(rec["scores"], want.scores[0].numpy(), rtol=1e-6)
    assert Image.open(tmp_path / "im0.gae.png").size == (32, 32)
    page = (tmp_path / "im0.gae.html").read_text()
    assert "data:image/png;base64," in page and "http" not in page
    label = rec["target_label"]
    assert f"target={label}" in res.output and "top patches" in res.output


def test_explain_options_target_and_size(vit_dir, pictures, tmp_path):
    img = pictures / "im1.png"
    res = run("explain", img, "--model", vit_dir, "-m", "rollout", "-o", "alpha=0.9", "-o", "head_fusion=max", "--target", "fish",
              "--format", "npz,png", "--size", "96", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    model = T.ViTForImageClassification.from_pretrained(vit_dir).eval()
    want = attnroll.explain(model, pixels(img), method="rollout", target=2, alpha=0.9, head_fusion="max")
    got = Explanation.load(tmp_path / "im1.rollout.npz")
    torch.testing.assert_close(got.scores, want.scores)
    assert got.options["alpha"] == 0.9 and got.target == [2]
    assert Image.open(tmp_path / "im1.rollout.png").size == (96, 96)


def test_explain_folder(vit_dir, pictures, tmp_path):
    res = run("explain", pictures, "--model", vit_dir, "-m", "rollout", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path)) == [f"im{i}.rollout.png" for i in range(3)]
    assert "wrote 3 files" in res.output


def test_explain_text_classifier(bert_dir, tmp_path):
    res = run("explain", "--text", "the cat sat on the mat", "--pair", "a dog ran", "--model", bert_dir,
              "-m", "rollout", "--format", "html,npz,json", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    tok = T.AutoTokenizer.from_pretrained(bert_dir)
    model = T.BertForSequenceClassification.from_pretrained(bert_dir).eval()
    want = attnroll.explain(model, tok(["the cat sat on the mat"], ["a dog ran"], return_tensors="pt"),
                            tokenizer=tok)
    stem = "the-cat-sat-on-the.rollout"
    got = Explanation.load(tmp_path / f"{stem}.npz")
    torch.testing.assert_close(got.scores, want.scores)
    page = (tmp_path / f"{stem}.html").read_text()
    for t in want.tokens[0]:
        assert f">{t}</span>" in page
    assert "http" not in page and "<script" not in page
    assert "top tokens:" in res.output


# ---------------------------------------------------------------------------------------------- errors
def test_corrupt_image(vit_dir, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    out = tmp_path / "out"
    line = one_line_error(run("explain", bad, "--model", vit_dir, "--out", out), 1)
    assert "cannot read image" in line and not out.exists()


def test_truncated_image_among_good_ones_writes_nothing(vit_dir, pictures, tmp_path):
    data = (pictures / "im0.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    line = one_line_error(run("explain", pictures / "im1.png", tmp_path / "cut.png", "--model", vit_dir,
                              "--out", out), 1)
    assert "cut.png" in line and not out.exists()


def test_unsupported_format(vit_dir, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hi")
    assert "unsupported image format" in one_line_error(run("explain", f, "--model", vit_dir), 1)


def test_folder_without_images(vit_dir, tmp_path):
    (tmp_path / "a.txt").write_text("x")
    assert "no images" in one_line_error(run("explain", tmp_path, "--model", vit_dir), 1)


def test_unwritable_output_folder(vit_dir, pictures, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(run("explain", pictures / "im0.png", "--model", vit_dir, "--out", blocker / "sub"), 1)
    assert "cannot write to output folder" in line
    assert "not a folder" in one_line_error(run("explain", pictures / "im0.png", "--model", vit_dir,
                                                "--out", blocker), 1)


def test_model_path_that_is_not_a_model(pictures, tmp_path):
    assert "not a model folder" in one_line_error(run("explain", pictures / "im0.png", "--model", tmp_path), 1)
    f = tmp_path / "w.bin"
    f.write_bytes(b"junk")
    assert "not a model" in one_line_error(run("explain", pictures / "im0.png", "--model", f), 1)
    (tmp_path / "config.json").write_text("{not json")
    assert "cannot load a model" in one_line_error(run("explain", pictures / "im0.png", "--model", tmp_path), 1)
    assert "--weights" in one_line_error(run("explain", pictures / "im0.png", "--model", "vit_tiny_patch16_224"), 2)


@pytest.mark.parametrize(
    "args, words",
    [
        (["explain", "--text", "   "], "empty"),
        (["explain"], "nothing to explain"),
        (["explain", "no/such/file.png"], "does not exist"),
        (["explain", "--pair", "x"], "--pair needs --text"),
        (["explain", "--text", "a", "-m", "nope"], "unknown method"),
        (["explain", "--text", "a", "-o", "alpha"], "KEY=VALUE"),
        (["explain", "--text", "a", "-o", "no_such_option=1"], "no_such_option"),
        (["explain", "--text", "a", "--format", "gif"], "gif"),
        (["explain", "--text", "a", "--format", "png"], "png is for images"),
        (["nosuchcommand"], "nosuchcommand"),
    ],
)
def test_usage_errors_exit_2(args, words):
    assert words in one_line_error(run(*args), 2)


def test_debug_shows_the_exception(tmp_path):
    res = CliRunner().invoke(cli, ["--debug", "explain", str(tmp_path), "--model", str(tmp_path)])
    assert res.exit_code != 0 and res.exception is not None


def test_failed_write_leaves_no_partial_file(vit_dir, pictures, tmp_path, monkeypatch):
    real_save = Image.Image.save

    def broken(self, fp, *a, **k):
        if hasattr(fp, "write"):
            fp.write(b"\x89PNG partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", broken)
    out = tmp_path / "out"
    line = one_line_error(run("explain", pictures / "im0.png", "--model", vit_dir, "--out", out), 1)
    monkeypatch.setattr(Image.Image, "save", real_save)
    assert "No space left" in line and os.listdir(out) == []


# ------------------------------------------------------------------------------------------------ demo
@pytest.mark.slow
def test_demo(tmp_path):
    from attnroll.models import shapes

    if not (shapes.WEIGHTS_DIR / "model.safetensors").is_file():
        pytest.skip("the shapes model weights are not shipped yet")
    res = run("demo", "--out", tmp_path, "--images", "2", "--methods", "rollout,raw", "--no-text")
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path)) == ["shapes_heads.png", "shapes_layers.png", "shapes_panel.png", "viewer.html"]
    for f in os.listdir(tmp_path):
        assert f"wrote {tmp_path / f}" in res.output
        if f.endswith(".png"):
            Image.open(tmp_path / f).verify()
    from attnroll.viz.viewer import read_payload

    data = read_payload((tmp_path / "viewer.html").read_text(encoding="utf-8"))
    assert data["methods"] == ["rollout", "raw", "per_head_rollout"] and len(data["examples"]) == 2
    assert all(ex["outline"] and ex["maps"]["per_head_rollout"]["heads"] for ex in data["examples"])


@pytest.mark.slow
def test_demo_pipeline_on_an_untrained_shapes_model(tmp_path, monkeypatch):
    """The demo's pictures and messages, with a random-weight model standing in for the shipped one."""
    from attnroll.models import shapes

    torch.manual_seed(0)
    model = shapes.build_model(shapes.shapes_config(hidden_size=32, num_layers=2, num_heads=4)).eval()
    monkeypatch.setattr(shapes, "load_shapes_model", lambda *a, **k: model)
    res = run("demo", "--out", tmp_path, "--images", "2", "--methods", "rollout,gae,raw", "--no-text")
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path)) == ["shapes_heads.png", "shapes_layers.png", "shapes_panel.png", "viewer.html"]
    w, h = Image.open(tmp_path / "shapes_panel.png").size
    assert w >= 4 * 150 and h >= 2 * 150  # input + 3 methods, 2 images, 150 px cells
    assert "ground-truth" in res.output
    assert "unknown" in one_line_error(run("demo", "--methods", "rollout,nope", "--out", tmp_path), 2)


def test_demo_without_weights_is_one_line(tmp_path, monkeypatch):
    from attnroll.models import shapes

    def missing(*a, **k):
        raise FileNotFoundError("load_shapes_model: model.safetensors not found; rebuild it with ...")

    monkeypatch.setattr(shapes, "load_shapes_model", missing)
    assert "rebuild" in one_line_error(run("demo", "--out", tmp_path / "d", "--no-text"), 1)
