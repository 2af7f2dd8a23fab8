"""Gradient-weighted layers of the hybrid layouts (capture/hybrids.py; ``grad_rollout`` and ``gae``): each layer's
matrix against a reference built here in float64 from one forward of the model in which every composed mixer's
output is recomputed as post(Σ_s K_c[t, s] x_in[s, c]) with a zero leaf added to each channel's dense matrix K_c
(so autograd of the target through the model's real output gives ∂y/∂K_c), the attention's probabilities taken
from the model's own attention modules; the parallel (Falcon-H1) and shared-attention (Zamba, Zamba2) layers joined
as docs/methods.md states; and the methods' maps against the rollout of those reference layers."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.capture import hybrids
from attnroll.capture import mixers as cm
from attnroll.core.rollout import rollout

from ..zoo import decoder
from .test_mixers_grad import TARGET, _channels, _weighted

# Tiny hybrids in float64, a forward with autograd each: left out of `make test-fast`.
pytestmark = pytest.mark.slow

SEVEN = ("zamba", "zamba2", "falcon_h1", "recurrent_gemma", "qwen3_5_text", "olmo_hybrid", "kimi_linear")


def _inputs(n: int = 6) -> dict:
    ids = torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _double(model_type: str) -> torch.nn.Module:
    """The tiny decoder in float64, eager attention (its probabilities are the tensor the layer multiplies by), the
    paths that meet in one sum made comparable (the tiny models' SSD branch / projected shared block is ~1e-3 /
    ~1e-2 of the other path, which would leave that path's weight ~0)."""
    model = decoder(model_type).double()
    for cfg in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        cfg._attn_implementation = "eager"
    return balance_paths(model, model_type)


def balance_paths(model: torch.nn.Module, model_type: str) -> torch.nn.Module:
    """Falcon-H1's SSD branch (×300) or Zamba's projected shared block (×100) brought to the size of the other path
    of each joined layer, in place; returns the model."""
    for layer in model.model.layers:
        if model_type == "falcon_h1":
            layer.ssm_out_multiplier *= 300.0
        elif hasattr(layer, "mamba_decoder"):
            with torch.no_grad():
                layer.linear.weight.mul_(100.0)
    return model


def _parts(m, a, k, o):
    name = type(m).__name__
    hidden, extra, out = hybrids._hook_reading(name, a, k, o)
    return (hybrids.PARTS.get(name) or cm._PARTS[name])(m, hidden, extra, out)


def _forward(model, inputs) -> dict:
    """One forward with each composed mixer's output rebuilt from its explicit channel matrices plus a zero leaf;
    returns the leaves' (K, leaf), the wired layers' attention probabilities and path outputs, and the target."""
    seen: dict = {"leaves": [], "attn": [], "paths": []}

    def mixer_hook(m, a, k, o):
        p = _parts(m, a, k, o)
        K = _channels(p)
        leaf = torch.zeros_like(K, requires_grad=True)
        seen["leaves"].append((K.detach(), leaf))
        y = torch.einsum("bcts,bsc->btc", K + leaf, p.x_in) + (p.y - torch.einsum("bcts,bsc->btc", K, p.x_in))
        out = p.post(y)
        return (out, *o[1:]) if isinstance(o, tuple) else out

    handles = [m.register_forward_hook(mixer_hook, with_kwargs=True) for _, m in cm.composable_mixers(model)]
    for layer in model.model.layers:
        if type(layer).__name__ == "FalconH1DecoderLayer":
            handles.append(layer.mamba.register_forward_hook(lambda m, a, k, o, layer=layer: seen["paths"].append(
                o.detach() * layer.ssm_out_multiplier), with_kwargs=True))
            handles.append(layer.self_attn.register_forward_hook(lambda m, a, o, layer=layer: seen["paths"].append(
                o[0].detach() * layer.attn_out_multiplier) or seen["attn"].append(o[1])))
        elif hasattr(layer, "mamba_decoder"):
            block = getattr(layer, "shared_transf", None) or layer.shared_transformer
            handles.append(layer.mamba_decoder.register_forward_pre_hook(lambda m, a, k: seen["paths"].append(
                (a[0] if a else k["hidden_states"], k["transformer_hidden_states"])), with_kwargs=True))
            handles.append(block.self_attn.register_forward_hook(lambda m, a, o: seen["attn"].append(o[1])))
    try:
        out = model(**inputs, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    seen["score"] = out.logits[:, -1, TARGET].sum()
    seen["attentions"] = [a for a in (out.attentions or ()) if a is not None]
    return seen


def _share(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a's share of a + b per token (b, n, 1): ‖a_t‖ / (‖a_t‖ + ‖b_t‖)."""
    na, nb = (x.detach().double().norm(dim=-1, keepdim=True) for x in (a, b))
    return na / (na + nb)


def _reference_layers(model_type: str, model, inputs, clamp: str) -> tuple[list, list]:
    """Per mixer / wired layer (execution order) its gradient-weighted matrix (b, n, n) from the explicit leaves:
    Ā_M = mean_c((K_c ⊙ ∂y/∂K_c)^+); Falcon-H1 w_a·Ā_A + w_m·Ā_M; Zamba's hybrid layers Ā_M·(w_h·I + w_T·Ā_A); and
    the gradient-weighted matrices of the model's attention outputs (output_attentions), for the end-to-end maps."""
    seen = _forward(model, inputs)
    leaves, attn, atts = seen["leaves"], seen["attn"], seen["attentions"]
    grads = torch.autograd.grad(seen["score"], [leaf for _, leaf in leaves] + attn + atts, allow_unused=True)
    cut = len(leaves) + len(attn)
    g_leaves, g_attn, g_atts = grads[:len(leaves)], grads[len(leaves):cut], grads[cut:]
    mix = [_weighted(K, G, clamp) for (K, _), G in zip(leaves, g_leaves)]
    wired = [_weighted(A.detach(), G, clamp) for A, G in zip(attn, g_attn)]
    plain = [_weighted(A.detach(), G, clamp) for A, G in zip(atts, g_atts) if G is not None] if atts else []
    if model_type == "falcon_h1":
        paths = seen["paths"]
        layers = []
        for i, (Wm, Wa) in enumerate(zip(mix, wired)):
            w_a = _share(paths[2 * i + 1], paths[2 * i])
            layers.append(w_a * Wa + (1 - w_a) * Wm)
        return layers, []
    if model_type in ("zamba", "zamba2"):
        layers, Was, hybrid_paths = [], iter(wired), iter(seen["paths"])
        assert len(mix) == len(model.model.layers)  # one mixer per layer
        for layer, Wm in zip(model.model.layers, mix):
            if not hasattr(layer, "mamba_decoder"):
                layers.append(Wm)
                continue
            h, T = next(hybrid_paths)
            w_T = _share(T, h)
            eye = torch.eye(Wm.shape[-1], dtype=Wm.dtype)
            layers.append(Wm @ ((1 - w_T) * eye + w_T * next(Was)))
        return layers, []
    return mix, plain


def _attnroll_layers(model, inputs, clamp: str) -> list[torch.Tensor]:
    """attnroll's gradient-weighted matrix of each composed mixer / wired layer (``record.extra["mixer_weighted"]``),
    from the gradient of the same target at the tensors each entry names."""
    rec = attnroll.capture(model, inputs, keep_grad=True)
    mixed = rec.extra["mixer_weighted"]
    keys = sorted(mixed)
    tensors = [list(mixed[k][0]) if isinstance(mixed[k][0], tuple) else [mixed[k][0]] for k in keys]
    grads = iter(torch.autograd.grad(rec.outputs.logits[:, -1, TARGET].sum(), [t for ts in tensors for t in ts]))
    out = []
    for key, ts in zip(keys, tensors):
        gs = [next(grads) for _ in ts]
        out.append(mixed[key][1](gs if len(gs) > 1 else gs[0], clamp))
    return out


@pytest.mark.parametrize("model_type", SEVEN)
@pytest.mark.parametrize("clamp", ["per_head", "after_mean"])
def test_each_layer_is_the_gradient_weighted_matrix_of_its_paths(model_type, clamp):
    model, inputs = _double(model_type), _inputs()
    want, _ = _reference_layers(model_type, model, inputs, clamp)
    got = _attnroll_layers(model, inputs, clamp)
    assert len(got) == len(want) >= 1
    for g, w in zip(got, want):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, atol=1e-5 * float(w.abs().max()), rtol=0)


@pytest.mark.parametrize("model_type", ["falcon_h1", "zamba2", "recurrent_gemma", "kimi_linear"])
def test_grad_rollout_and_gae_roll_out_the_reference_layers(model_type):
    """(Zamba: its tiny random gradient-weighted layers are ~1e-6 beside the residual; checked layer by layer.)"""
    model, inputs = _double(model_type), _inputs()
    mixer_layers, plain = _reference_layers(model_type, model, inputs, "per_head")
    rec = attnroll.capture(model, inputs)
    n_layers = len(rec.streams["self"])
    if plain:  # a hybrid with attention layers of its own: which record layers are mixers (one matrix on every head)
        kinds = [bool((a == a[:, :1]).all()) for a in rec.streams["self"]]
        mixers, attns = iter(mixer_layers), iter(plain)
        layers = [next(mixers) if k else next(attns) for k in kinds]
        assert sum(kinds) == len(mixer_layers) and n_layers - sum(kinds) == len(plain)
    else:  # every layer is a mixer or a wired layer
        layers = mixer_layers
    assert len(layers) == n_layers
    for method, opts in (("grad_rollout", dict(residual_mode="renorm")), ("gae", dict(residual_mode="add"))):
        e = attnroll.explain(model, inputs, method=method, target=TARGET)
        R = rollout(layers, head_fusion=None, check_stochastic=False, alpha=0.5, **opts)
        want = R[:, -1].to(torch.float32)
        assert (want[:, :-1].abs().max() > 1e-4), method  # the layers move some relevance off the last token
        torch.testing.assert_close(e.full_row, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("model_type", SEVEN)
def test_padding_on_the_right_changes_nothing_on_the_real_tokens(model_type):
    model = decoder(model_type)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    for method in ("grad_rollout", "gae"):
        e = attnroll.explain(model, inputs, method=method, sinks="keep", target=TARGET)
        alone = attnroll.explain(model, {k: v[1:, :5] for k, v in inputs.items()}, method=method, sinks="keep",
                                 target=TARGET)
        assert e.full_row[1, -2:].abs().max() == 0
        torch.testing.assert_close(alone.full_row[0], e.full_row[1, :5], atol=1e-6, rtol=1e-5)
