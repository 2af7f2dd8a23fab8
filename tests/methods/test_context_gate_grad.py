"""Context attribution's "gate_grad": the derivative of the answer's log-probability with respect to gates on the
attention paid to each unit's tokens, against central finite differences of the gated log-probability, and the
gate's m = 0 end against the model run without the unit's tokens (at their original positions)."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.explain import key_gates

from .test_context import PROMPT, llama, word_tokenizer

T = pytest.importorskip("transformers")

ANSWER = "paris is capital"
SEGMENTS = ["the cat sat on the mat .", "a dog ran in the park .", "paris is the capital of france ."]


def setup(impl="sdpa"):
    m, tok = llama().double(), word_tokenizer()
    m.config._attn_implementation = impl
    p = tok(PROMPT)["input_ids"]
    a = tok(ANSWER, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + a])
    rows = [len(p) - 1 + t for t in range(len(a))]
    own = torch.tensor(attnroll.explain.context_attribution.token_units(
        PROMPT, [tuple(o) for o in tok(PROMPT, return_offsets_mapping=True)["offset_mapping"]], "segments",
        SEGMENTS) + [-1] * len(a))
    return m, tok, ids, rows, a, own


def logprob(m, ids, rows, a, own, m_of_unit):
    """f with unit j's tokens gated by m_of_unit[j] (an explicit per-unit gate, float64)."""
    log_g = torch.zeros(1, ids.shape[1], dtype=torch.float64)
    for j, v in enumerate(m_of_unit):
        log_g[0, own == j] = torch.log(torch.tensor(v, dtype=torch.float64))
    with torch.no_grad():
        return float(key_gates.answer_logprob(m, ids, rows, a, log_g)[0])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("scales", [(1.0,), (1.0, 0.5), (1.0, 0.25)])
def test_unit_scores_are_finite_differences_of_the_gated_logprob(impl, scales):
    m, tok, ids, rows, a, own = setup(impl)
    ca = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="gate_grad",
                                      sinks="keep", scales=scales)
    h = 1e-2  # the model keeps some float32 internals (its norms): a wider step, central differences
    for j in range(len(SEGMENTS)):
        fd = 0.0
        for s in scales:
            d = h * min(1.0, 2 * s)  # a narrower step at m = 0.25, where the log-gate curves more
            up = [s + d if i == j else s for i in range(len(SEGMENTS))]
            down = [s - d if i == j else s for i in range(len(SEGMENTS))]
            fd += (logprob(m, ids, rows, a, own, up) - logprob(m, ids, rows, a, own, down)) / (2 * d) / len(scales)
        assert abs(fd) > 1e-4
        assert ca.units[j]["score"] == pytest.approx(fd, rel=2e-3, abs=1e-5)


def test_token_scores_sum_to_the_unit_gate_derivative():
    """Per-token derivatives summed within a unit = the derivative of one shared gate on the unit."""
    m, tok, ids, rows, a, own = setup()
    g = key_gates.gate_gradients(m, ids, rows, a, own >= 0, scales=(1.0,))
    ca = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="gate_grad",
                                      sinks="keep", scales=(1.0,))
    for j in range(len(SEGMENTS)):
        assert float(g[own == j].sum()) == pytest.approx(ca.units[j]["score"], rel=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_closed_gate_equals_the_model_without_the_unit(impl):
    """m = 0 (log gate −10⁴) on unit j = the model run on the other tokens at their positions."""
    m, tok, ids, rows, a, own = setup(impl)
    for j in range(len(SEGMENTS) - 1):  # the last unit holds the row predicting the answer: its query stays
        log_g = torch.zeros(1, ids.shape[1], dtype=torch.float64)
        log_g[0, own == j] = -1e4  # exp(-1e4) is 0 in float64; finite, so a row with only gated keys stays finite
        with torch.no_grad():
            gated = float(key_gates.answer_logprob(m, ids, rows, a, log_g)[0])
            keep = torch.nonzero(own != j).reshape(-1)
            out = m(input_ids=ids[:, keep], position_ids=keep[None]).logits[0].log_softmax(-1)
            new_rows = [int((keep == r).nonzero()) for r in rows]
            ref = float(out[torch.tensor(new_rows), torch.tensor(a)].sum())
        assert gated == pytest.approx(ref, abs=1e-5)
        assert abs(gated - logprob(m, ids, rows, a, own, [1.0] * len(SEGMENTS))) > 1e-3


def test_gate_grad_refusals():
    m, tok = llama(), word_tokenizer()
    with pytest.raises(ValueError, match="no option 'clamp'"):
        attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, method="gate_grad", clamp="none")
    with pytest.raises(ValueError, match=r"scales must be numbers in \(0, 1\]"):
        attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, method="gate_grad", scales=(1.0, 0.0))
    m.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, method="gate_grad")
    m.config._attn_implementation = "sdpa"
    m.config.sliding_window = 4
    with pytest.raises(ValueError, match="sliding window"):
        attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, method="gate_grad")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generation_rows_are_the_gate_derivative_of_each_token_on_its_prefix(family):
    """generation_attribution's gate_grad row t = context_attribution's gate_grad of token t alone on the prompt
    + earlier tokens (at m = 1 the gated set does not matter); zero past the prefix."""
    from ..zoo import sharp
    from .test_generation_attribution import word_tokenizer as zoo_tokenizer

    m, tok = sharp.model(family), zoo_tokenizer()
    words = "paris is the capital".split()
    ga = attnroll.generation_attribution(m, tok, PROMPT, answer=" ".join(words), sinks="keep", batch_size=3,
                                         method="gate_grad", scales=1.0)
    for t, w in enumerate(words):
        prefix = " ".join([PROMPT, *words[:t]])
        ca = attnroll.context_attribution(m, tok, prefix, answer=w, unit="token", sinks="keep", scales=[1.0],
                                          method="gate_grad")
        n = ga.n_input + t
        assert ca.method == "gate_grad" and float(ca.token_scores.abs().max()) > 0
        torch.testing.assert_close(ga.matrix[t, :n], ca.token_scores, atol=1e-5, rtol=1e-4)
        assert float(ga.matrix[t, n:].abs().sum()) == 0.0


def test_the_default_is_checked_where_the_gates_apply_else_attn_grad_warned():
    m, tok = llama(), word_tokenizer()  # context attribution's default: gate_grad's ranking checked by LOO
    ca = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS)
    want = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="checked")
    assert ca.method == "checked"
    torch.testing.assert_close(ca.token_scores, want.token_scores)
    m.config.sliding_window = 4  # shorter than the input: the gates' one full mask would change the model
    with pytest.warns(UserWarning, match="sliding window.*'attn_grad' is used instead"):
        ca = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS)
    want = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, segments=SEGMENTS, method="attn_grad")
    assert ca.method == "attn_grad"
    torch.testing.assert_close(ca.token_scores, want.token_scores)
    with pytest.warns(UserWarning, match="'attn_grad' is used instead"):
        ga = attnroll.generation_attribution(m, tok, PROMPT, answer=ANSWER)
    assert ga.method == "attn_grad"
    torch.testing.assert_close(ga.matrix, attnroll.generation_attribution(m, tok, PROMPT, answer=ANSWER,
                                                                          method="attn_grad").matrix)


def _route_grad(m, ids, rows, a, own, route, scales=(1.0, 0.25)):
    """(S, n) ∂f/∂log m per copy through one gate route, copy i at m = scales[i] on the units' tokens."""
    point = torch.log(torch.tensor(scales, dtype=torch.float64))[:, None] * (own >= 0).double()[None]
    zero = torch.zeros(point.shape, dtype=torch.float64, requires_grad=True)
    f = key_gates.answer_logprob(m, ids, rows, a, zero + point, route=route)
    return f.detach(), torch.autograd.grad(f.sum(), zero)[0]


def test_key_route_equals_the_mask_route_and_finite_differences():
    """SDPA with the gates as one more key component: the same log-probabilities and gate gradients as the
    float-mask route on sdpa and on eager, and central finite differences of its own gated log-probability."""
    m, tok, ids, rows, a, own = setup("sdpa")
    f_keys, g_keys = _route_grad(m, ids, rows, a, own, "keys")
    assert m.config._attn_implementation == "sdpa"  # restored after the gated call
    f_mask, g_mask = _route_grad(m, ids, rows, a, own, "mask")
    m.config._attn_implementation = "eager"
    f_eager, g_eager = _route_grad(m, ids, rows, a, own, None)
    assert float(g_keys.abs().max()) > 1e-3
    torch.testing.assert_close(f_keys, f_mask, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_keys, g_mask, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f_keys, f_eager, rtol=1e-7, atol=1e-9)  # eager's softmax runs in float32
    torch.testing.assert_close(g_keys, g_eager, rtol=1e-5, atol=1e-5 * float(g_keys.abs().max()))
    m.config._attn_implementation = "sdpa"
    h, point = 1e-2, torch.log(torch.tensor([1.0, 0.25], dtype=torch.float64))[:, None] * (own >= 0).double()[None]
    for k in (0, int(own.eq(2).nonzero()[0]), ids.shape[1] - len(a) - 1):  # a sink, a unit token, the last prompt token
        step = torch.zeros_like(point)
        step[:, k] = h
        with torch.no_grad():
            up = key_gates.answer_logprob(m, ids, rows, a, point + step, route="keys")
            down = key_gates.answer_logprob(m, ids, rows, a, point - step, route="keys")
        torch.testing.assert_close(g_keys[:, k], (up - down) / (2 * h), rtol=2e-3, atol=1e-5)  # float32 norms


def test_key_route_keeps_sdpa_fused(monkeypatch):
    """The key route calls SDPA causal with no mask (the fused kernel: no n × n matrix), head size + 1 at the
    original scale; the mask route passes an n × n float mask that needs a gradient."""
    m, tok, ids, rows, a, own = setup("sdpa")
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, scale=None, **kw):
        seen.append((attn_mask, is_causal, q.shape[-1], scale))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    d = m.config.hidden_size // m.config.num_attention_heads
    _route_grad(m, ids, rows, a, own, "keys")
    assert len(seen) == m.config.num_hidden_layers
    assert all(mask is None and causal and size == d + 1 and scale == pytest.approx(d ** -0.5)
               for mask, causal, size, scale in seen)
    seen.clear()
    _route_grad(m, ids, rows, a, own, "mask")
    assert all(mask is not None and mask.requires_grad and mask.shape[-2:] == (ids.shape[1],) * 2
               for mask, *_ in seen)
    m.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="'keys' on an attn_implementation='sdpa' model"):
        _route_grad(m, ids, rows, a, own, "keys")
