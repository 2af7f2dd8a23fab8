"""Attention sinks in explanations (attnroll.explain.sinks): a tiny Llama whose every layer parks most of its
attention on token 0 by construction; the sink is found, dropped from the map by default (its share
recorded), kept with sinks="keep", the same on both routes; a model without sinks is left as it was."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnroll
from attnroll.core.rollout import rollout as core_rollout

from ..zoo import T, sharp

inputs_for, model = sharp.inputs_for, sharp.model

IDS = torch.tensor([[0, 5, 17, 23, 42, 8, 9, 61, 33, 12], [0, 7, 3, 23, 42, 80, 9, 61, 3, 2]])


def sink_llama(strength: float = 1.3) -> torch.nn.Module:
    """A 3-layer Llama whose queries all meet token 0's key: a constant query bias and a key read from an
    embedding feature only token id 0 has, on the slowest rotary pair (rope_theta 1e12: it never turns)."""
    torch.manual_seed(0)
    cfg = T.LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=37, vocab_size=99, max_position_embeddings=64, bos_token_id=0,
                        eos_token_id=0, attention_bias=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e12})
    m = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        emb = m.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[0, 0] = 10.0
        for layer in m.model.layers:
            a = layer.self_attn
            a.q_proj.bias.zero_()
            a.k_proj.bias.zero_()
            a.q_proj.weight.mul_(0.1)
            a.k_proj.weight.mul_(0.1)
            for h in range(4):
                a.q_proj.bias[h * 8 + 3] = strength
            for h in range(2):
                a.k_proj.weight[h * 8 + 3, 0] = strength
    return m


@pytest.fixture(scope="module")
def sinking():
    return sink_llama()


def _eager_rows(m, ids):
    """Head-mean rollout of the last row from the model's own eager attention (no attnroll capture)."""
    m.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = m(input_ids=ids, output_attentions=True).attentions
    finally:
        m.set_attn_implementation("sdpa")
    return core_rollout([a for a in att], rows=[ids.shape[1] - 1])[:, 0], att


@pytest.mark.parametrize("attention", ["dense", "recompute"])
def test_rollout_drops_the_sink_by_default_and_keeps_it_on_request(sinking, attention):
    ref, att = _eager_rows(sinking, IDS)
    assert float(torch.stack([a.mean(1)[:, 3:, 0] for a in att]).min()) > 0.6  # a sink by construction
    kept = attnroll.explain(sinking, {"input_ids": IDS}, "rollout", attention=attention, sinks="keep")
    torch.testing.assert_close(kept.full_row, ref, atol=1e-5, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the sink is taken out: nothing to warn about
        e = attnroll.explain(sinking, {"input_ids": IDS}, "rollout", attention=attention)
    assert e.extra["sinks"] == [[0], [0]] and kept.extra["sinks"] == [[0], [0]]
    torch.testing.assert_close(e.extra["sink_share"], ref[:, 0] / ref.sum(-1), atol=1e-5, rtol=0)
    assert float(e.extra["sink_share"].min()) > 0.6
    expect = ref.clone()
    expect[:, 0] = 0
    expect = expect * (ref.sum(-1, keepdim=True) / expect.sum(-1, keepdim=True))  # renormalised to the row's mass
    torch.testing.assert_close(e.full_row, expect, atol=1e-5, rtol=0)
    torch.testing.assert_close(e.scores, e.full_row)
    assert e.options["sinks"] == "drop" and kept.options["sinks"] == "keep"


@pytest.mark.parametrize("method", ["gae", "grad_rollout", "raw"])
def test_other_row_methods_drop_it_too(sinking, method):
    e = attnroll.explain(sinking, {"input_ids": IDS}, method)
    k = attnroll.explain(sinking, {"input_ids": IDS}, method, sinks="keep")
    assert e.extra["sinks"] == [[0], [0]]
    assert not e.full_row[:, 0].any()
    total = k.full_row.abs().sum(-1)
    torch.testing.assert_close(e.extra["sink_share"], k.full_row[:, 0].abs() / total)
    scale = total / (total - k.full_row[:, 0].abs())
    torch.testing.assert_close(e.full_row[:, 1:], k.full_row[:, 1:] * scale[:, None])


def test_return_layers_are_dropped_alike(sinking):
    e = attnroll.explain(sinking, {"input_ids": IDS}, "rollout", return_layers=True, attention="dense")
    assert e.layers is not None and not e.layers[..., 0].any()
    torch.testing.assert_close(e.layers[-1], e.full_row)


def test_kept_sink_over_90_percent_warns_naming_it():
    strong = sink_llama(strength=3.0)
    with pytest.warns(UserWarning, match=r"\d+\.\d% of the map of example 0 is on token 0 at position 0.*sinks='keep'"):
        attnroll.explain(strong, {"input_ids": IDS}, "raw", sinks="keep")


def test_a_model_without_sinks_is_unchanged():
    m = model("llama")
    x = inputs_for("llama", batch=2, n=9, pad=False)
    e = attnroll.explain(m, x, "rollout")
    k = attnroll.explain(m, x, "rollout", sinks="keep")
    assert e.extra["sinks"] == [[], []]
    torch.testing.assert_close(e.full_row, k.full_row, atol=0, rtol=0)


def test_encoders_are_left_alone():
    m = model("bert")
    x = inputs_for("bert", batch=2, n=7)
    e = attnroll.explain(m, x, "rollout")
    assert "sinks" not in e.extra and "sink_share" not in e.extra


def test_bad_sinks_value():
    with pytest.raises(ValueError, match="sinks"):
        attnroll.explain(model("llama"), inputs_for("llama", batch=1), "rollout", sinks="remove")


def test_context_attribution_drops_the_sink(sinking):
    class Tok:  # a minimal fast-tokenizer stand-in: one token per character, offsets included
        def __call__(self, text, return_offsets_mapping=False, return_tensors=None, add_special_tokens=True):
            ids = [0] + [3 + (ord(c) % 90) for c in text[1:]]
            out = {"input_ids": torch.tensor([ids]) if return_tensors else ids}
            if return_offsets_mapping:
                out["offset_mapping"] = torch.tensor([[(i, i + 1) for i in range(len(text))]])
            return out

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    from attnroll.explain.context_attribution import context_attribution

    prompt = "Ab cd. Ef gh. Ij kl."
    segs = ["Ab cd.", " Ef gh.", " Ij kl."]
    d = context_attribution(sinking, Tok(), prompt, answer="xy", segments=segs, method="rollout")
    k = context_attribution(sinking, Tok(), prompt, answer="xy", segments=segs, sinks="keep", method="rollout")
    assert d.sinks == [0] and k.sinks == [0]
    assert float(d.token_scores[0]) == 0.0 and float(k.token_scores[0]) > 0
    assert abs(d.sink_share - float(k.token_scores[0] / k.token_scores.sum())) < 1e-5
    t0 = float(k.token_scores[0])  # the first unit holds token 0: it loses that score, the shares renormalise
    expect = (k.units[0]["score"] - t0) / (k.total - t0)
    assert abs(d.units[0]["share"] - expect) < 1e-5 and d.units[0]["share"] < k.units[0]["share"]
    for u, v in zip(d.units[1:], k.units[1:]):
        assert abs(u["share"] - v["score"] / (k.total - t0)) < 1e-5
