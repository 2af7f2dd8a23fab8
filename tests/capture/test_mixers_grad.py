"""Gradient-weighted token mixers (capture/mixers.py ``mixer_reading``; ``grad_rollout`` and ``gae`` through state-space
and hybrid stacks): each mixer layer's Ā = mean_c((K_c ⊙ ∂y/∂K_c)^+) against autograd of the target through the
model with every channel's matrix K_c an explicit leaf of the graph (float64), and the methods' maps against the
core rollout of those reference matrices."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.capture import mixers as cm
from attnroll.core import mixers as ops
from attnroll.core.gradients import gradient_weighted
from attnroll.core.rollout import rollout

from ..zoo import decoder

TARGET = 7


def _inputs(n: int = 6) -> dict:
    ids = torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _channels(p: cm.MixerParts) -> torch.Tensor:
    """Every channel's matrix K_c of x_in -> y, (b, C, n, n), built explicitly (no fold)."""
    C, n = p.y.shape[-1], p.y.shape[1]
    M = p.M[:, torch.arange(C) // p.heads_of]
    if p.weight is None:
        return M
    return (M * p.gate_in.transpose(1, 2)[:, :, None, :]) @ ops.conv_matrix(p.weight.to(M.dtype), n)[0]


def _reference(model, inputs, attention: bool):
    """One forward of ``model`` in which every composed mixer's output is post(Σ_s K_c[t, s] x_in[s, c] + rest) with
    a zero leaf added to each K_c (values and every other gradient path unchanged): returns the per-layer
    [(kind, A or K, dy/dA or dy/dK)] in execution order (attention: the eager probabilities of output_attentions)."""
    leaves: list = []

    def hook(m, a, k, o):
        hidden = a[0] if a else k["hidden_states"]
        p = cm._PARTS[type(m).__name__](m, hidden, None, o[0] if isinstance(o, tuple) else o)
        K = _channels(p)
        leaf = torch.zeros_like(K, requires_grad=True)
        leaves.append((K.detach(), leaf))
        y = torch.einsum("bcts,bsc->btc", K + leaf, p.x_in) + (p.y - torch.einsum("bcts,bsc->btc", K, p.x_in))
        out = p.post(y)
        return (out, *o[1:]) if isinstance(o, tuple) else out

    hooks = [m.register_forward_hook(hook, with_kwargs=True) for _, m in cm.composable_mixers(model)]
    try:
        out = model(**inputs, **({"output_attentions": True} if attention else {}))
    finally:
        for h in hooks:
            h.remove()
    score = out.logits[:, -1, TARGET].sum()
    atts = [a for a in (getattr(out, "attentions", None) or ()) if a is not None] if attention else []
    grads = torch.autograd.grad(score, [leaf for _, leaf in leaves] + atts)
    return leaves, grads[: len(leaves)], atts, grads[len(leaves):]


def _double(model_type: str) -> torch.nn.Module:
    """The tiny decoder in float64 (experts through the eager loop: grouped products take no float64)."""
    model = decoder(model_type).double()
    for cfg in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        cfg._experts_implementation = "eager"
        cfg._attn_implementation = "eager"  # output_attentions: the probabilities the layer multiplies by
    return model


def _weighted(K: torch.Tensor, G: torch.Tensor, clamp: str) -> torch.Tensor:
    Q = K * G
    return Q.clamp(min=0).mean(1) if clamp == "per_head" else Q.mean(1).clamp(min=0)


@pytest.mark.parametrize("model_type", ["mamba2", "jamba", "mamba", "lfm2", "qwen3_next", "nemotron_h", "falcon_mamba",
                                        "bamba", "granitemoehybrid", "lfm3"])
@pytest.mark.parametrize("clamp", ["per_head", "after_mean"])
def test_mixer_weighting_is_autograd_through_explicit_channel_matrices(model_type, clamp):
    model, inputs = _double(model_type), _inputs()
    rec = attnroll.capture(model, inputs, keep_grad=True)
    mixed = rec.extra["mixer_weighted"]
    score = rec.outputs.logits[:, -1, TARGET].sum()
    keys = sorted(mixed)
    g_outs = torch.autograd.grad(score, [mixed[key][0] for key in keys])
    leaves, grads, _, _ = _reference(model, inputs, attention=False)
    assert len(keys) == len(leaves) >= 1
    for key, g, (K, _), G in zip(keys, g_outs, leaves, grads):
        got = mixed[key][1](g, clamp)
        want = _weighted(K, G, clamp)
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("model_type", ["mamba2", "jamba", "bamba"])
def test_grad_rollout_and_gae_roll_out_the_reference_matrices(model_type):
    model, inputs = _double(model_type), _inputs()
    leaves, grads, atts, agrads = _reference(model, inputs, attention=True)
    Ws = iter([_weighted(K, G, "per_head") for (K, _), G in zip(leaves, grads)])
    As = iter(gradient_weighted([a.detach() for a in atts], agrads, "per_head", dtype=torch.float64))
    rec = attnroll.capture(model, inputs)
    kinds = [bool((a == a[:, :1]).all()) and a.shape[1] in (1, getattr(model.config, "num_attention_heads", 1))
             for a in rec.streams["self"]]
    layers = [next(Ws) if mixer else next(As) for mixer in kinds]
    assert sum(kinds) == len(leaves) and len(layers) - sum(kinds) == len(atts)
    for method, opts in (("grad_rollout", dict(residual_mode="renorm")), ("gae", dict(residual_mode="add"))):
        e = attnroll.explain(model, inputs, method=method, target=TARGET)
        R = rollout(layers, head_fusion=None, check_stochastic=False, alpha=0.5, **opts)
        want = R[:, -1].to(torch.float32)
        torch.testing.assert_close(e.full_row, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


def test_hybrid_maps_follow_the_mixer_layers():
    inputs = _inputs()
    model = decoder("bamba")  # a Mamba-2 layer, then attention
    before = {m: attnroll.explain(model, inputs, method=m, target=TARGET).full_row for m in ("grad_rollout", "gae")}
    mixer = cm.composable_mixers(model)[0][1]
    with torch.no_grad():
        mixer.out_proj.weight.mul_(100.0)  # the mixer's share of the residual stream, and its gradient, x100
    for m, row in before.items():
        after = attnroll.explain(model, inputs, method=m, target=TARGET).full_row
        off = (after - row)[:, :-1].abs().max()  # the readout token's own entry is mostly the residual
        assert off > 0.05 * row[:, :-1].abs().max(), m


@pytest.mark.parametrize("model_type", ["mamba2", "jamba"])
def test_other_gradient_methods_still_refuse_naming_the_mixer(model_type):
    with pytest.raises(attnroll.UnsupportedModelError, match="Mixer.*grad_rollout, gae"):
        attnroll.explain(decoder(model_type), _inputs(), method="attn_gradcam")
