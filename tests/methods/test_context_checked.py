"""Context attribution's "checked": the base's top-r units carry their exact leave-one-out drops, computed here
independently by running the model on the prompt without the unit; the other units stay below them in the base's
order; r >= the number of units is exact leave-one-out; bad r is refused; the default resolves to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll
from attnroll.explain import checked

from .test_context import PROMPT, llama, word_tokenizer

T = pytest.importorskip("transformers")

ANSWER = "paris is capital"
SEGMENTS = ["the cat sat on the mat .", "a dog ran in the park .", "paris is the capital of france ."]
WORDY = "the cat sat . the mat . a dog ran . in the park . paris is the capital . of france ."
PIECES = ["the cat sat .", "the mat .", "a dog ran .", "in the park .", "paris is the capital .", "of france ."]


def setup(impl="sdpa"):
    m, tok = llama().double(), word_tokenizer()
    m.config._attn_implementation = impl
    return m, tok


def logp(m, tok, text):
    """log p(ANSWER | text) by a plain forward over every position (no gates, no logits_to_keep)."""
    p = tok(text)["input_ids"]
    a = tok(ANSWER, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        lp = m(input_ids=torch.tensor([p + a])).logits[0].log_softmax(-1)
    return float(sum(lp[len(p) - 1 + t, a[t]] for t in range(len(a))))


def loo(m, tok, prompt, pieces):
    """Exact leave-one-out drops: the prompt re-assembled without piece j (joined by single spaces)."""
    full = logp(m, tok, prompt)
    return np.array([full - logp(m, tok, " ".join(p for i, p in enumerate(pieces) if i != j))
                     for j in range(len(pieces))])


@pytest.mark.parametrize("base,r", [("gate_grad", 2), ("attn_grad", 3), ("gate_grad", 1)])
def test_checked_units_carry_exact_leave_one_out_and_the_rest_stay_below(base, r):
    m, tok = setup("eager")
    drops = loo(m, tok, WORDY, PIECES)
    plain = attnroll.context_attribution(m, tok, WORDY, answer=ANSWER, segments=PIECES, method=base, sinks="keep")
    g = np.array([u["score"] for u in plain.units[:len(PIECES)]])
    ca = attnroll.context_attribution(m, tok, WORDY, answer=ANSWER, segments=PIECES, method="checked", base=base,
                                      r=r, sinks="keep")
    s = np.array([u["score"] for u in ca.units[:len(PIECES)]])
    top = list(np.argsort(-g, kind="stable")[:r])
    rest = [j for j in range(len(PIECES)) if j not in top]
    np.testing.assert_allclose(s[top], drops[top], rtol=1e-6, atol=1e-8)
    assert s[rest].max() < s[top].min()  # every unchecked unit below every checked one
    assert list(np.argsort(-s[rest], kind="stable")) == list(np.argsort(-g[rest], kind="stable"))
    for u in ca.units:  # the token scores still add up to the units' scores
        own = [i for i, o in enumerate(ca.token_units) if ca.units[o] is u]
        assert float(ca.token_scores[own].sum()) == pytest.approx(u["score"], rel=1e-5, abs=1e-6)


def test_r_at_least_the_units_is_exact_leave_one_out():
    m, tok = setup()
    drops = loo(m, tok, PROMPT, SEGMENTS)
    for r in (len(SEGMENTS), 10):
        ca = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="checked", r=r,
                                          sinks="keep")
        s = np.array([u["score"] for u in ca.units[:len(SEGMENTS)]])
        np.testing.assert_allclose(s, drops, rtol=1e-6, atol=1e-8)
        assert [u["text"] for u in ca.ranked()[:3]] == [SEGMENTS[j] for j in np.argsort(-drops)]


@pytest.mark.parametrize("r,err,match", [(0, ValueError, "r >= 1"), (-2, ValueError, "r >= 1"),
                                         (1.5, TypeError, "positive integer"), ("2", TypeError, "positive integer"),
                                         (True, TypeError, "positive integer")])
def test_bad_r_is_refused(r, err, match):
    m, tok = setup()
    with pytest.raises(err, match=match):
        attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="checked", r=r)


def test_bad_base_and_generation_attribution_are_refused():
    m, tok = setup()
    with pytest.raises(ValueError, match="option 'base'"):
        attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="checked",
                                     base="rollout")
    with pytest.raises(ValueError, match="no option 'alpha'"):
        attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="checked", alpha=0.5)
    with pytest.raises(ValueError, match="use context_attribution"):
        attnroll.generation_attribution(m, tok, PROMPT, answer=ANSWER, method="checked")


def test_the_default_is_checked_where_the_gates_apply_else_attn_grad_warned():
    m, tok = setup()
    ca = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS)
    want = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="checked")
    assert ca.method == "checked"
    torch.testing.assert_close(ca.token_scores, want.token_scores)
    m.config.sliding_window = 4
    with pytest.warns(UserWarning, match="default method 'checked'.*sliding window.*'attn_grad' is used instead"):
        ca = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS)
    assert ca.method == "attn_grad"


def test_combine_rule():
    base = [0.5, 3.0, 2.0, 1.0]
    s = checked.combine(base, {1: 0.2, 2: 1.5})  # c = 1.7 / 5; unchecked 0.17, 0.34 stay under 0.2 after a shift
    assert s[1] == 0.2 and s[2] == 1.5 and s[3] < 0.2 and s[0] < s[3]
    assert checked.combine(base, {}) == base
    assert checked.without("a b.\n\nc d.\n\ne.", (6, 10)) == "a b.\n\ne."


def test_ablations_start_from_the_full_forward_keys_and_values():
    """The probe keeps f(all) and the keys / values of the plain forward; an ablation computed from the first
    changed token on equals the whole forward of the ablated prompt."""
    m, tok = setup()
    p = tok(PROMPT)["input_ids"]
    a = tok(ANSWER, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + a])
    with checked.FullProbe(m, ids, a) as probe:
        with torch.no_grad():
            m(input_ids=ids)
    assert probe.full == pytest.approx(logp(m, tok, PROMPT), abs=1e-10) and probe.kv is not None
    text = checked.without(PROMPT, (PROMPT.index("a dog"), PROMPT.index("paris") - 1))
    short = torch.tensor([tok(text)["input_ids"]])
    assert checked.prefixed_logprob(m, short, a, ids, probe.kv) == pytest.approx(logp(m, tok, text), abs=1e-10)


def test_a_unit_that_is_the_whole_prompt_keeps_its_base_score():
    m, tok = setup()
    ca = attnroll.context_attribution(m, tok, "paris is the capital of france .", answer=ANSWER, method="checked")
    base = attnroll.context_attribution(m, tok, "paris is the capital of france .", answer=ANSWER, method="gate_grad")
    assert ca.units[0]["score"] == pytest.approx(base.units[0]["score"], rel=1e-6)
