"""A text longer than the model reads (``explain --text``, ``view --text``): cut to the model's maximum length
with a note, as ``attnroll batch`` encodes its texts, instead of the model's tensor-size error."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("click")
T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll.commands._text import max_tokens  # noqa: E402

from .test_cli import run  # noqa: E402

LONG = "the cat sat on the mat " * 4400  # 101,200 characters, 26,400 words
LIMIT = 64  # the tiny BERT's max_position_embeddings (its tokenizer gives no limit)


def _loaded(bert_dir):
    from attnroll.models import load_model

    return load_model(str(bert_dir), want="text")


def test_the_limit_is_the_tokenizer_s_else_the_config_s(bert_dir):
    lm = _loaded(bert_dir)
    assert lm.tokenizer.model_max_length > 10**9 and max_tokens(lm) == LIMIT
    lm.tokenizer.model_max_length = 32
    assert max_tokens(lm) == 32


@pytest.mark.parametrize("pair", [None, "a dog ran"])
def test_explain_cuts_a_long_text_to_the_model_s_length_with_a_note(bert_dir, tmp_path, pair):
    args = ["explain", "--text", LONG, "--model", bert_dir, "-m", "rollout", "--format", "json", "--out", tmp_path]
    res = run(*args, *(["--pair", pair] if pair else []))
    assert res.exit_code == 0, res.output
    assert len(LONG) > 100_000
    tok = T.AutoTokenizer.from_pretrained(bert_dir)
    full = len(tok(LONG, pair, verbose=False)["input_ids"])
    assert f"reads at most {LIMIT}: explaining the first {LIMIT} tokens" in res.stderr
    assert f"{full:,} tokens long" in res.stderr
    model = T.BertForSequenceClassification.from_pretrained(bert_dir).eval()
    enc = tok([LONG], None if pair is None else [pair], truncation=True, max_length=LIMIT, return_tensors="pt")
    want = attnroll.explain(model, enc, tokenizer=tok)
    (path,) = tmp_path.glob("*.json")
    got = next(iter(json.loads(path.read_text()).values()))
    assert len(got["tokens"]) == LIMIT
    torch.testing.assert_close(torch.tensor(got["scores"], dtype=torch.float32).reshape(want.scores.shape),
                               want.scores, atol=1e-5, rtol=1e-4)


def test_view_cuts_a_long_text_too(bert_dir, tmp_path):
    res = run("view", "--text", LONG, "--model", bert_dir, "-m", "rollout", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert f"explaining the first {LIMIT} tokens" in res.stderr
    (page,) = tmp_path.glob("*.view.html")
    html = page.read_text(encoding="utf-8")
    assert LONG[:300] in html and LONG[:301] not in html  # the notes show the text's start, not all of it
    assert f"(+{len(LONG) - 300:,} characters)" in html


def test_a_short_text_gets_no_note(bert_dir, tmp_path):
    res = run("explain", "--text", "the cat sat on the mat", "--model", bert_dir, "-m", "rollout", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert "note:" not in res.stderr
