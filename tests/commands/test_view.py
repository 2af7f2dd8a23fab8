"""``attnroll view``: the page it writes carries what attnroll.explain computes for the same inputs, with the
same input and model options as ``explain``; errors are one line and write nothing."""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("click")
T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll.viz.viewer import decode_rows, read_payload  # noqa: E402
from attnroll.viz.viewer.quant import error_bound  # noqa: E402

from .test_cli import one_line_error, pictures, pixels, run, vit_dir  # noqa: E402,F401


def _close(packed, want):
    want = np.atleast_2d(np.asarray(want, dtype=np.float64))
    assert np.all(np.abs(decode_rows(packed) - want) <= error_bound(packed, want))


def test_view_images_carries_every_method_and_its_layers(vit_dir, pictures, tmp_path):
    res = run("view", pictures, "--model", vit_dir, "-m", "rollout,gae,flow", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert os.listdir(tmp_path) == ["im0+2.view.html"]
    data = read_payload((tmp_path / "im0+2.view.html").read_text(encoding="utf-8"))
    assert data["methods"] == ["rollout", "gae", "flow"] and len(data["examples"]) == 3
    model = T.ViTForImageClassification.from_pretrained(vit_dir).eval()
    x = torch.cat([pixels(pictures / f"im{i}.png") for i in range(3)])
    for m in ("rollout", "gae", "flow"):
        e = attnroll.explain(model, x, m, **({} if m == "flow" else {"return_layers": True}))
        for b, ex in enumerate(data["examples"]):
            assert ex["label"].startswith(f"im{b}.png · target ")
            _close(ex["maps"][m]["final"], e.scores[b].double())
            if m == "flow":
                assert ex["maps"][m]["layers"] is None
            else:
                _close(ex["maps"][m]["layers"], e.layers[:, b, e.prefix:].double())
    assert data["examples"][0]["image"].startswith("data:image/png;base64,")


def test_view_text_pair_with_options_and_name(bert_dir, tmp_path):
    res = run("view", "--text", "the cat sat", "--pair", "a dog ran", "--model", bert_dir, "-m", "rollout,raw",
              "-o", "raw.layer=0", "--out", tmp_path, "--name", "pair")
    assert res.exit_code == 0, res.output
    data = read_payload((tmp_path / "pair.html").read_text(encoding="utf-8"))
    tok = T.AutoTokenizer.from_pretrained(bert_dir)
    model = T.AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    enc = tok(["the cat sat"], ["a dog ran"], return_tensors="pt")
    ex = data["examples"][0]
    assert ex["tokens"] == tok.convert_ids_to_tokens(enc["input_ids"][0])
    assert [ex["tokens"][i] for i in ex["skip"]] == ["[CLS]", "[SEP]", "[SEP]"]
    raw = attnroll.explain(model, enc, "raw", layer=0, tokenizer=tok)  # the command's: [CLS] / [SEP] left out
    _close(ex["maps"]["raw"]["final"], raw.scores[0].double())


@pytest.mark.parametrize("args,words", [
    ([], "nothing to explain"),
    (["--text", "a", "--pair", ""], "--pair is empty"),
    (["--pair", "b"], "--pair needs --text"),
    (["--text", "a", "-m", "rollout,nope"], "unknown ['nope']"),
    (["--text", "a", "-m", "rollout,gae", "-o", "nope=1"], "none of the methods"),
    (["--text", "a", "-o", "nope=1"], "no method takes nope="),
    (["--text", "a", "--name", "sub/page"], "--name must be a file name"),
])
def test_view_usage_errors_are_one_line_and_write_nothing(args, words, tmp_path):
    out = tmp_path / "out"
    assert words in one_line_error(run("view", *args, "--out", out), 2)
    assert not out.exists()


def test_view_a_corrupt_image_writes_nothing(vit_dir, pictures, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    out = tmp_path / "out"
    assert "bad.png" in one_line_error(run("view", pictures / "im0.png", bad, "--model", vit_dir, "--out", out), 1)
    assert not out.exists() or os.listdir(out) == []
