"""Token mixers other than softmax attention (capture/mixers.py): a hybrid stack whose mixer attnroll does not compose
is refused by default naming the mixer (shown here by taking each tiny hybrid's mixer class out of the composed ones),
``mixers="attention_only"`` rolls out through their attention layers alone, warned about and recorded; models
without such mixers are unaffected; methods that read no layer ignore them."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnroll
from attnroll.core.rollout import rollout
from attnroll.capture import mixers as _mixers
from attnroll.capture.mixers import find_mixers

from ..zoo import HYBRIDS, decoder, sharp

# Tiny multi-part models (VLMs, hybrids, token mixers, mixtures of experts): left out of `make test-fast`.
pytestmark = pytest.mark.slow

FAST = ("jamba", "qwen3_next", "lfm2", "recurrent_gemma")
#: Hybrids whose mixers attnroll composes (capture/mixers.py COMPOSED, capture/hybrids.py): every tiny hybrid.
COMPOSED = ("jamba", "bamba", "nemotron_h", "granitemoehybrid", "lfm2", "lfm3", "qwen3_next", "qwen3_5_text",
            "olmo_hybrid", "kimi_linear", "recurrent_gemma", "falcon_h1", "zamba", "zamba2")
#: Hybrids whose mixer is not one layer of its own (capture/hybrids.py Wiring: Falcon-H1's parallel branches,
#: Zamba's shared attention block), tested in tests/capture/test_hybrids_capture.py.
WIRED = ("falcon_h1", "zamba", "zamba2")
#: The class each tiny hybrid's layer-0 mixer has (read off transformers' modeling files).
MIXER_CLASS = {
    "jamba": "JambaMambaMixer", "bamba": "BambaMixer", "zamba": "ZambaMambaMixer", "zamba2": "Zamba2MambaMixer",
    "falcon_h1": "FalconH1Mixer", "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "nemotron_h": "NemotronHMamba2Mixer", "lfm2": "Lfm2ShortConv", "lfm3": "Lfm3ShortConv",
    "recurrent_gemma": "RecurrentGemmaRecurrentBlock", "kimi_linear": "KimiLinearDeltaAttention",
    "qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
}


def _hybrids(composed: bool = False) -> list:
    """Every tiny hybrid (``composed=False``: each made uncomposed by :func:`_uncompose`), or the composed ones
    whose mixer is a layer of its own."""
    return [pytest.param(t, marks=() if t in FAST else (pytest.mark.slow,)) for t in HYBRIDS
            if not composed or (t in COMPOSED and t not in WIRED)]


def _uncompose(monkeypatch, model_type: str) -> None:
    """Take ``model_type``'s mixer class out of the composed ones: the model's mixer is then one attnroll does not
    compose (as a new family's would be)."""
    import attnroll.capture.mixers as mixers

    monkeypatch.setattr(mixers, "COMPOSED", tuple(c for c in mixers.COMPOSED if c != MIXER_CLASS[model_type]))


def _inputs(n: int = 6) -> dict:
    ids = torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_every_hybrid_is_listed():
    from attnroll.capture.mixers import COMPOSED as CLASSES

    assert set(MIXER_CLASS) == set(HYBRIDS) and set(COMPOSED) == set(HYBRIDS)
    assert {MIXER_CLASS[t] for t in COMPOSED} <= set(CLASSES)


@pytest.mark.parametrize("model_type", _hybrids())
def test_hybrid_refused_by_default_naming_its_mixer(model_type, monkeypatch):
    _uncompose(monkeypatch, model_type)
    model = decoder(model_type)
    with pytest.raises(attnroll.UnsupportedModelError) as err:
        attnroll.explain(model, _inputs(), method="rollout")
    msg = str(err.value)
    assert MIXER_CLASS[model_type] in msg and "layer 0" in msg and "mixers='attention_only'" in msg
    assert type(model).__name__ in msg


@pytest.mark.parametrize("model_type", _hybrids())
def test_attention_only_rolls_out_the_attention_layers_and_warns(model_type, monkeypatch):
    _uncompose(monkeypatch, model_type)
    model, inputs = decoder(model_type), _inputs()
    with pytest.warns(UserWarning, match="attention_only.*partial map"):
        e = attnroll.explain(model, inputs, method="rollout", mixers="attention_only", sinks="keep")
    assert e.extra["mixers"] == "attention_only"
    assert any(MIXER_CLASS[model_type] in line for line in e.extra["mixers_left_out"])
    assert e.options["mixers"] == "attention_only"
    # the same map as rolling out the captured attention layers by hand (core maths, independent of the method)
    rec = attnroll.capture(model, inputs)
    layers = rec.streams["self"]
    assert len(layers) == sum(1 for _ in layers) and len(layers) >= 1
    R = rollout([a.to(torch.float64) for a in layers], attention_mask=inputs["attention_mask"])
    last = inputs["attention_mask"].sum(-1) - 1
    want = torch.stack([R[b, int(last[b])] for b in range(2)]).to(torch.float32)
    torch.testing.assert_close(e.full_row, want * inputs["attention_mask"], atol=1e-5, rtol=1e-5)


def test_gradient_methods_refused_too_and_input_gradients_are_not(monkeypatch):
    model, inputs = decoder("recurrent_gemma"), _inputs()
    # composed mixers: methods that read heads' gradients refuse them (grad_rollout and gae compose their
    # gradient-weighted matrices: test_hybrids_grad.py)
    for method in ("attn_gradcam", "alti"):
        with pytest.raises(attnroll.UnsupportedModelError, match="RecurrentGemmaRecurrentBlock"):
            attnroll.explain(model, inputs, method=method)
    _uncompose(monkeypatch, "recurrent_gemma")
    for method in ("grad_rollout", "gae", "raw", "flow"):
        with pytest.raises(attnroll.UnsupportedModelError, match="RecurrentGemmaRecurrentBlock"):
            attnroll.explain(model, inputs, method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no mixer warning for a method that reads no layer
        e = attnroll.explain(model, inputs, method="saliency")
    assert "mixers" not in e.extra


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "vit", "t5", "clip", "timm_vit", "torch_mha"])
def test_models_without_other_mixers_have_none(family):
    assert find_mixers(sharp.model(family)) == []


class _Block(torch.nn.Module):
    """A block with no attention whose unnamed sub-module convolves over the sequence (a custom mixer)."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Module()
        self.mix.conv = torch.nn.Conv1d(8, 8, 3, groups=8, padding=2)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        self.pointwise = torch.nn.Conv1d(8, 8, 1)  # kernel 1: no token mixing


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])


def test_generic_detection_by_structure():
    found = find_mixers(_Net())
    assert [(m.layer, m.path) for m in found] == [(0, "layers.0.mix"), (1, "layers.1.mix")]
    assert "convolution over the sequence" in found[0].kind


def test_minimax_refused_as_an_obstacle():
    T = pytest.importorskip("transformers")
    from ..zoo import shrink

    cfg = shrink(T.AutoConfig.for_model("minimax"))
    cfg.num_hidden_layers, cfg.layer_types, cfg.block_size = 2, ["linear_attention", "full_attention"], 4
    cfg.num_local_experts, cfg.num_experts_per_tok = 2, 1
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(attnroll.UnsupportedModelError, match="lightning"):
        attnroll.explain(model, _inputs(), method="rollout", mixers="attention_only")


def test_bad_mixers_option():
    with pytest.raises(ValueError, match="mixers"):
        attnroll.explain(sharp.model("gpt2"), _inputs(), method="rollout", mixers="all")


# ------------------------------------------------------------------------------- composed state-space stacks
def _scan_jacobian_fused(model, inputs, monkeypatch):
    """Per layer, the fused matrix of x_in -> y from transformers' own convolution and scan functions (their
    Jacobian per channel, the SiLU's sigmoid held), independent of attnroll's reading of the mixer."""
    import importlib

    import torch.nn.functional as F
    from torch.autograd.functional import jacobian

    mod = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    real_scan, real_conv, calls = mod.mamba2_chunk_scan, mod.causal_conv1d_fn, []
    monkeypatch.setattr(mod, "mamba2_chunk_scan", lambda *a, **k: calls.append(("scan", a, k)) or real_scan(*a, **k))
    monkeypatch.setattr(mod, "causal_conv1d_fn", lambda *a, **k: calls.append(("conv", a, k)) or real_conv(*a, **k))
    with torch.no_grad():
        model(**inputs)
    out = []
    for layer, (conv, scan) in enumerate(zip(calls[0::2], calls[1::2])):
        mixer = model.backbone.layers[layer].mixer
        I, H, P = mixer.intermediate_size, mixer.num_heads, mixer.head_dim
        xbc, w, bias = conv[1]
        _, dt, A, B, C = scan[1]
        sig = torch.sigmoid(real_conv(xbc, w, bias, activation=None))[:, :I].detach()

        def conv_stage(x_in, xbc=xbc, w=w, bias=bias, sig=sig):  # (b, I, n) -> x (b, n, I)
            full = torch.cat([x_in, xbc[:, I:]], 1)
            return (real_conv(full, w, bias, activation=None)[:, :I] * sig).transpose(1, 2)

        def scan_stage(x, dt=dt, A=A, B=B, C=C, kw=scan[2]):  # (b, n, I) -> y (b, n, I)
            y = real_scan(x.reshape(*x.shape[:2], H, P), dt, A, B, C, **kw)
            return (y[0] if isinstance(y, tuple) else y).reshape(*x.shape[:2], I)

        x_in = xbc[:, :I].contiguous()
        x = conv_stage(x_in).detach()
        out.append(fused_apart(_per_channel(jacobian(scan_stage, x), True), _per_channel(jacobian(conv_stage, x_in))))
    return out


def _per_channel(J: torch.Tensor, both_tokens_first: bool = False) -> torch.Tensor:
    """A jacobian (b, n, c, b, c, n) of a map (b, c, n) -> (b, n, c), or (b, n, c, b, n, c) of (b, n, c) ->
    (b, n, c) with ``both_tokens_first``, as per-channel matrices (b, c, n, n): [b, c, t, s] = ∂y[b, t, c]/∂x[b, s, c]."""
    b, c = J.shape[0], J.shape[2]
    if both_tokens_first:
        return torch.stack([torch.stack([J[i, :, k, i, :, k] for k in range(c)]) for i in range(b)])
    return torch.stack([torch.stack([J[i, :, k, i, k, :] for k in range(c)]) for i in range(b)])


def fused_apart(J_scan: torch.Tensor, J_conv: torch.Tensor) -> torch.Tensor:
    """The layer with the convolution composed apart (capture.mixers.CONVOLUTION "apart"): Σ_c |J_scan_c| ·
    |J_conv_c| from per-channel Jacobians (b, c, n, n), rows divided by their sums."""
    total = (J_scan.abs() @ J_conv.abs()).sum(1)
    return total / total.sum(-1, keepdim=True)


def test_mamba2_layers_are_the_fused_jacobians_of_its_scan(monkeypatch):
    model = decoder("mamba2").double()
    inputs = _inputs()
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    rec = attnroll.capture(model, inputs)
    want = _scan_jacobian_fused(model, inputs, monkeypatch)
    assert len(rec.streams["self"]) == len(want) == 2
    for got, ref in zip(rec.streams["self"], want):
        torch.testing.assert_close(got[:, 0], ref, atol=1e-8, rtol=0)


@pytest.mark.parametrize("model_type", ["mamba2", "mamba", "falcon_mamba"])
def test_state_space_stacks_compose(model_type):
    model, inputs = decoder(model_type), _inputs()
    e = attnroll.explain(model, inputs, method="rollout", sinks="keep")
    rec = attnroll.capture(model, inputs)
    assert len(rec.streams["self"]) == 2 and rec.streams["self"][0].shape[1] == 1
    R = rollout([a.to(torch.float64) for a in rec.streams["self"]], attention_mask=inputs["attention_mask"])
    last = inputs["attention_mask"].sum(-1) - 1
    want = torch.stack([R[b, int(last[b])] for b in range(2)]).to(torch.float32)
    torch.testing.assert_close(e.full_row, want * inputs["attention_mask"], atol=1e-5, rtol=1e-5)
    assert e.full_row[1, -2:].abs().max() == 0
    # padding on the right of a causal stack changes nothing on the real tokens
    alone = attnroll.explain(model, {k: v[1:, :4] for k, v in inputs.items()}, method="rollout", sinks="keep")
    torch.testing.assert_close(alone.full_row[0], e.full_row[1, :4], atol=1e-5, rtol=1e-5)
    for method in ("attn_gradcam", "alti"):  # grad_rollout and gae compose it: test_mixers_grad.py
        with pytest.raises(attnroll.UnsupportedModelError, match="Mixer"):
            attnroll.explain(model, inputs, method=method)
    for method in ("grad_rollout", "gae"):
        assert torch.isfinite(attnroll.explain(model, inputs, method=method).full_row).all()


def test_xlstm_still_refused():
    T = pytest.importorskip("transformers")
    from ..zoo import shrink

    model = T.AutoModelForCausalLM.from_config(shrink(T.AutoConfig.for_model("xlstm")))
    with pytest.raises(attnroll.UnsupportedModelError, match="recurrent"):
        attnroll.explain(model, _inputs(), method="rollout")


@pytest.mark.parametrize("model_type", _hybrids(composed=True))
def test_composed_hybrids_interleave_mixers_and_attention_in_execution_order(model_type):
    model, inputs = decoder(model_type), _inputs()
    fired: list = []
    hooks = [m.register_forward_hook(lambda mod, a, o: fired.append(type(mod).__name__ == MIXER_CLASS[model_type]))
             for m in model.modules() if type(m).__name__ == MIXER_CLASS[model_type] or (
                 type(m).__name__.endswith("Attention") and "Delta" not in type(m).__name__)]
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    rec = attnroll.capture(model, inputs)
    is_mixer = [bool((a == a[:, :1]).all()) and a.shape[1] == model.config.num_attention_heads
                for a in rec.streams["self"]]
    assert is_mixer == fired == [True, False]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        e = attnroll.explain(model, inputs, method="rollout", sinks="keep")
    assert "mixers" not in e.extra
    R = rollout([a.to(torch.float64).mean(1) for a in rec.streams["self"]], head_fusion=None,
                attention_mask=inputs["attention_mask"])
    last = inputs["attention_mask"].sum(-1) - 1
    want = torch.stack([R[b, int(last[b])] for b in range(2)]).to(torch.float32)
    torch.testing.assert_close(e.full_row, want * inputs["attention_mask"], atol=1e-5, rtol=1e-5)
    weighted = all(type(m).__name__ in _mixers.WEIGHTED for m in model.modules()
                   if type(m).__name__ in _mixers.COMPOSED)
    for method in ("raw", "flow") + (("grad_rollout", "gae") if weighted else ()):
        assert torch.isfinite(attnroll.explain(model, inputs, method=method).full_row).all()
    if not weighted:  # a mixer whose gradient-weighted matrix is not written: refused naming it
        with pytest.raises(attnroll.UnsupportedModelError, match="grad_rollout' does not compose"):
            attnroll.explain(model, inputs, method="grad_rollout")
    with pytest.raises(attnroll.UnsupportedModelError, match=MIXER_CLASS[model_type]):
        attnroll.explain(model, inputs, method="attn_gradcam")


def test_lfm2_layer_is_the_fused_jacobian_of_its_gated_convolution():
    import importlib

    from torch.autograd.functional import jacobian

    mod = importlib.import_module("transformers.models.lfm2.modeling_lfm2")
    model = decoder("lfm2").double()
    inputs = _inputs()
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    conv, seen = model.model.layers[0].conv, {}
    handle = conv.register_forward_hook(lambda m, a, k, o: seen.update(h=a[0] if a else k["hidden_states"]),
                                        with_kwargs=True)
    rec = attnroll.capture(model, inputs)
    handle.remove()
    Bg, Cg, x = conv.in_proj(seen["h"]).transpose(1, 2).chunk(3, dim=1)
    Bg, Cg = Bg.detach(), Cg.detach()

    def path(xx):  # transformers' own causal convolution, B and C held
        return Cg * mod.causal_conv1d_fn(Bg * xx, conv.conv.weight.squeeze(1), conv.conv.bias)

    J = jacobian(path, x.detach())  # (b, d, n, b, d, n)
    b, d, n = x.shape
    per = torch.stack([torch.stack([J[i, c, :, i, c, :] for c in range(d)]) for i in range(b)])
    total = per.abs().sum(1)
    torch.testing.assert_close(rec.streams["self"][0][:, 0], total / total.sum(-1, keepdim=True), atol=1e-8, rtol=0)


def test_mamba2_gates_are_what_the_scan_reads(monkeypatch):
    import importlib

    from attnroll.capture.mixers import mamba2_gates

    mod = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    real, calls = mod.mamba2_chunk_scan, []
    monkeypatch.setattr(mod, "mamba2_chunk_scan", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    model, seen = decoder("mamba2").double(), []
    mixer = model.backbone.layers[0].mixer
    handle = mixer.register_forward_hook(lambda m, a, k, o: seen.append(mamba2_gates(m, a[0] if a else
                                                                                    k["hidden_states"])),
                                         with_kwargs=True)
    with torch.no_grad():
        model(input_ids=_inputs()["input_ids"])
    handle.remove()
    (x, dt, A, B, C), kw = calls[0]
    g = seen[0]
    torch.testing.assert_close(g.x, x.to(g.x.dtype), atol=1e-12, rtol=0)
    torch.testing.assert_close(g.A, A.to(g.A.dtype))
    import torch.nn.functional as F

    torch.testing.assert_close(g.dt, torch.clamp(F.softplus(dt + kw["dt_bias"]), *kw["dt_limit"]))
    torch.testing.assert_close(g.C[:, :, 0], C[:, :, 0].to(g.C.dtype))


def test_qwen3_next_layer_is_the_fused_jacobian_of_its_delta_rule(monkeypatch):
    import importlib

    from torch.autograd.functional import jacobian

    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    real_rule, real_conv, calls = mod.torch_chunk_gated_delta_rule, mod.causal_conv1d_fn, []
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule",
                        lambda *a, **k: calls.append(("rule", a, k)) or real_rule(*a, **k))
    monkeypatch.setattr(mod, "causal_conv1d_fn", lambda *a, **k: calls.append(("conv", a, k)) or real_conv(*a, **k))
    model = decoder("qwen3_next")  # float32: its experts' grouped product takes no float64
    inputs = _inputs()
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    rec = attnroll.capture(model, inputs)
    (_, (mixed, w, bias), ckw), (_, (q, k, _v), kw) = calls[0], calls[1]
    net = model.model.layers[0].linear_attn
    start = 2 * net.key_dim
    sig = torch.sigmoid(real_conv(mixed, w, bias, activation=None))[:, start:].detach()

    def conv_stage(v_in):  # transformers' own convolution, σ held: (b, dv_all, n) -> v (b, n, dv_all)
        full = torch.cat([mixed[:, :start], v_in], 1)
        return (real_conv(full, w, bias, activation=None)[:, start:] * sig).transpose(1, 2)

    def rule_stage(v):  # its chunked delta rule, q, k, β and g held: (b, n, dv_all) -> (b, n, dv_all)
        out = real_rule(q, k, v.reshape(*v.shape[:2], net.num_v_heads, net.head_v_dim), **kw)[0]
        return out.reshape(*v.shape[:2], -1)

    v_in = mixed[:, start:].detach().contiguous()
    v = conv_stage(v_in).detach()
    want = fused_apart(_per_channel(jacobian(rule_stage, v), True), _per_channel(jacobian(conv_stage, v_in)))
    torch.testing.assert_close(rec.streams["self"][0][:, 0], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["bamba", "jamba", "qwen3_next"])
def test_attention_only_leaves_out_composed_mixers_too(model_type):
    """mixers="attention_only" on a hybrid whose mixers attnroll composes rolls out through the attention layers
    alone (recorded, warned): equal to the rollout of the captured record's attention layers, not the full stack."""
    model, inputs = decoder(model_type), _inputs()
    rec = attnroll.capture(model, inputs)
    mixer_layers = {i for s, i in rec.extra["mixer_layers"]}
    attention = [a.to(torch.float64).mean(1) for i, a in enumerate(rec.streams["self"]) if i not in mixer_layers]
    assert mixer_layers and attention
    R = rollout(attention, head_fusion=None, attention_mask=inputs["attention_mask"])
    last = inputs["attention_mask"].sum(-1) - 1
    want = torch.stack([R[b, int(last[b])] for b in range(2)]).to(torch.float32) * inputs["attention_mask"]
    with pytest.warns(UserWarning, match="attention_only.*partial map"):
        e = attnroll.explain(model, inputs, method="rollout", mixers="attention_only", sinks="keep",
                             attention="dense")
    torch.testing.assert_close(e.full_row, want, atol=1e-5, rtol=1e-5)
    with pytest.warns(UserWarning, match="attention_only"):  # the default route (rows-only for Mamba-2) as well
        default = attnroll.explain(model, inputs, method="rollout", mixers="attention_only", sinks="keep")
    torch.testing.assert_close(default.full_row, want, atol=1e-5, rtol=1e-5)
    assert e.extra["mixers"] == "attention_only" and len(e.extra["mixers_left_out"]) == len(mixer_layers)
    full = attnroll.explain(model, inputs, method="rollout", sinks="keep", attention="dense")
    assert "mixers" not in full.extra and not torch.allclose(full.full_row, e.full_row, atol=1e-4)
    with pytest.warns(UserWarning, match="attention_only"):  # the gradient path drops them as well
        g = attnroll.explain(model, inputs, method="attn_gradcam", mixers="attention_only")
    assert torch.isfinite(g.full_row).all()


def test_attention_only_refuses_layers_that_join_mixer_and_attention():
    model = decoder("falcon_h1")
    with pytest.raises(attnroll.UnsupportedModelError, match="attention_only.*one matrix"):
        attnroll.explain(model, _inputs(), method="rollout", mixers="attention_only")
