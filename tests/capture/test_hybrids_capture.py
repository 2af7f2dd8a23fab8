"""The hybrid layouts of capture/hybrids.py: each mixer's fused matrix is the fused Jacobian (gates held) of its
value path through transformers' own convolution and scan functions, float64; the parallel (Falcon-H1) and
shared-attention (Zamba, Zamba2) layers are the norm-weighted sums of their paths as wired in the model's code; the
composed rollout equals a naive product of those layers computed here from the model's own tensors."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.autograd.functional import jacobian

import attnroll
from attnroll.capture.hybrids import mixer_matrix

from ..zoo import decoder

# Tiny multi-part models (VLMs, hybrids, token mixers, mixtures of experts): left out of `make test-fast`.
pytestmark = pytest.mark.slow

#: The seven families of capture/hybrids.py (zoo model types) and the class of their mixers.
SEVEN = {
    "zamba": "ZambaMambaMixer", "zamba2": "Zamba2MambaMixer", "falcon_h1": "FalconH1Mixer",
    "recurrent_gemma": "RecurrentGemmaRecurrentBlock", "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet", "kimi_linear": "KimiLinearDeltaAttention",
}
#: Modeling module of each family and the scan / delta-rule function its mixer calls there (None: RG-LRU's method).
RULE = {"zamba": "mamba_selective_scan", "zamba2": "mamba2_chunk_scan", "falcon_h1": "mamba2_chunk_scan",
        "qwen3_5_text": "torch_chunk_gated_delta_rule", "olmo_hybrid": "torch_chunk_gated_delta_rule",
        "kimi_linear": "chunk_kimi_delta_attention", "recurrent_gemma": None}
FAST = ("zamba2", "falcon_h1", "kimi_linear", "recurrent_gemma")


def _params() -> list:
    return [pytest.param(t, marks=() if t in FAST else (pytest.mark.slow,)) for t in SEVEN]


def _inputs(n: int = 7, pad: bool = True) -> dict:
    ids = torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if pad:
        mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _module(model_type: str):
    name = {"qwen3_5_text": "qwen3_5"}.get(model_type, model_type)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _fused_apart(J_scan: torch.Tensor, J_conv: torch.Tensor) -> torch.Tensor:
    """The convolution composed apart (capture.mixers.CONVOLUTION "apart"): per-channel Jacobians of the scan
    stage (x -> y) and the convolution stage (x_in -> x), (b, c, n, n) each -> Σ_c |J_scan_c| · |J_conv_c|, rows
    divided by their sums."""
    total = (J_scan.abs() @ J_conv.abs()).sum(1)
    return total / total.sum(-1, keepdim=True)


def _diag_jacobian(path, x: torch.Tensor) -> torch.Tensor:
    """x (b, c, n) -> y (b, n, c) per channel: J[b, c, t, s] = ∂y[b, t, c] / ∂x[b, c, s]."""
    J = jacobian(path, x.detach().contiguous())  # (b, n, c, b, c, n)
    b, c = x.shape[0], x.shape[1]
    return torch.stack([torch.stack([J[i, :, k, i, k, :] for k in range(c)]) for i in range(b)])


def _references(model_type: str, calls: list, mixers: list) -> list[torch.Tensor]:
    """Per mixer layer, the fused Jacobian of its value input -> scan output, gates held at the recorded values."""
    mod = _module(model_type)
    conv, rule = mod.causal_conv1d_fn.__wrapped_real__, getattr(mod, RULE[model_type]).__wrapped_real__
    convs = [c for c in calls if c[0] == "conv"]
    rules = [c for c in calls if c[0] == "rule"]
    per_layer = len(rules) // len(convs)
    out = []
    for i, mixer in enumerate(mixers):
        (_, a, k), layer_rules = convs[i], rules[i * per_layer:(i + 1) * per_layer]
        xbc, w, bias = a[0], a[1] if len(a) > 1 else k["weight"], a[2] if len(a) > 2 else k.get("bias")
        if model_type == "zamba":
            start, stop = 0, mixer.intermediate_size
        elif RULE[model_type] == "mamba2_chunk_scan":
            start, stop = 0, mixer.intermediate_size
        else:
            start, stop = xbc.shape[1] - (mixer.value_dim if hasattr(mixer, "value_dim") else mixer.qkv_dim), None
        sig = torch.sigmoid(conv(xbc, w, bias, activation=None))[:, start:stop].detach()

        def conv_stage(v_in, xbc=xbc, w=w, bias=bias, sig=sig, start=start, stop=stop):  # (b, c, n) -> (b, n, c)
            full = torch.cat([xbc[:, :start], v_in, xbc[:, stop:] if stop else xbc[:, :0]], 1)
            return (conv(full, w, bias, activation=None)[:, start:stop] * sig).transpose(1, 2)

        def scan_stage(x, layer_rules=layer_rules, mixer=mixer):  # (b, c, n) -> (b, n, c)
            return _scan(model_type, rule, x, layer_rules, mixer)

        v0 = xbc[:, start:stop]
        x0 = conv_stage(v0).transpose(1, 2)
        out.append(_fused_apart(_diag_jacobian(scan_stage, x0), _diag_jacobian(conv_stage, v0)))
    return out


def _scan(model_type: str, rule, x: torch.Tensor, layer_rules: list, mixer) -> torch.Tensor:
    """The recorded scan(s) of one layer applied to a new value x (b, c, n); returns (b, n, c)."""
    b, c, n = x.shape
    if model_type == "zamba":  # one selective scan per Mamba head, its output gate held
        P = mixer.mamba_head_dim
        ys = [rule(x[:, h * P:(h + 1) * P], *a[1:], **k) for h, (_, a, k) in enumerate(layer_rules)]
        return torch.cat([y[0] if isinstance(y, tuple) else y for y in ys], 1).transpose(1, 2)
    (_, a, k), = layer_rules
    if RULE[model_type] == "mamba2_chunk_scan":
        y = rule(x.transpose(1, 2).reshape(b, n, mixer.num_heads, -1), *a[1:], **k)
    else:  # delta rules: (q, k, v, ...) with v (b, n, H, dv)
        y = rule(a[0], a[1], x.transpose(1, 2).reshape(*a[2].shape), *a[3:], **k)
    return (y[0] if isinstance(y, tuple) else y).reshape(b, n, c)


def _record_calls(monkeypatch, model_type: str) -> list:
    mod, calls = _module(model_type), []
    for kind, name in (("conv", "causal_conv1d_fn"), ("rule", RULE[model_type])):
        real = getattr(mod, name)
        spy = (lambda *a, real=real, kind=kind, **k: calls.append((kind, a, k)) or real(*a, **k))
        spy.__wrapped_real__ = real
        monkeypatch.setattr(mod, name, spy)
    return calls


def _readers(model, cls: str) -> tuple[list, list]:
    """Hooks computing capture/hybrids.mixer_matrix on every mixer of class ``cls``: (modules, matrices)."""
    mixers = [m for m in model.modules() if type(m).__name__ == cls]
    got: list = []
    handles = [m.register_forward_hook(lambda mod, a, k, o: got.append(mixer_matrix(mod, a, k, o)), with_kwargs=True)
               for m in mixers]
    return mixers, got, handles


def _rg_lru_references(model, inputs) -> tuple[list, list]:
    """RecurrentGemma: the fused Jacobian of linear_x(h) -> RG-LRU(conv(·)) · GeLU(linear_y(h)) through the block's
    own convolution and the RG-LRU's own scan, the gates (and √(1 − a²) normalisation) held as recorded."""
    mixers, got, handles = _readers(model, SEVEN["recurrent_gemma"])
    seen: dict = {}
    for i, m in enumerate(mixers):
        handles.append(m.linear_x.register_forward_hook(lambda mod, a, o, i=i: seen.__setitem__(("x", i), o)))
        handles.append(m.linear_y.register_forward_hook(lambda mod, a, o, i=i: seen.__setitem__(("y", i), o)))
        handles.append(m.conv_1d.register_forward_hook(lambda mod, a, o, i=i: seen.__setitem__(("c", i), o)))
        real = m.rg_lru._rnn_scan
        m.rg_lru._rnn_scan = lambda *a, i=i, real=real, **k: seen.__setitem__(("scan", i), k) or real(*a, **k)
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    refs = []
    for i, m in enumerate(mixers):
        k, n = seen[("scan", i)], seen[("x", i)].shape[1]
        conv_out = seen[("c", i)][..., :n].transpose(1, 2)
        scale = (k["hidden_states"] / conv_out).detach()
        y = m.act_fn(seen[("y", i)]).detach()
        real = type(m.rg_lru)._rnn_scan

        def conv_stage(x_in, m=m, n=n):  # (b, c, n) -> (b, n, c)
            return m.conv_1d(x_in)[..., :n].transpose(1, 2)

        def scan_stage(x, m=m, k=k, scale=scale, y=y, real=real):  # (b, c, n) -> (b, n, c)
            return real(m.rg_lru, x.transpose(1, 2) * scale, k["recurrent_gate"], k["reset"], None)[0] * y

        x_in = seen[("x", i)].transpose(1, 2)
        refs.append(_fused_apart(_diag_jacobian(scan_stage, conv_stage(x_in).transpose(1, 2)),
                                 _diag_jacobian(conv_stage, x_in)))
        del m.rg_lru._rnn_scan
    return refs, got


@pytest.mark.parametrize("model_type", _params())
def test_each_mixer_is_the_fused_jacobian_of_its_layer(model_type, monkeypatch):
    model = decoder(model_type).double()
    inputs = _inputs(pad=False)
    if model_type == "recurrent_gemma":
        refs, got = _rg_lru_references(model, inputs)
    else:
        calls = _record_calls(monkeypatch, model_type)
        mixers, got, handles = _readers(model, SEVEN[model_type])
        with torch.no_grad():
            model(**inputs)
        for h in handles:
            h.remove()
        refs = _references(model_type, calls, mixers)
    assert len(got) == len(refs) >= 1
    for mine, ref in zip(got, refs):
        torch.testing.assert_close(mine[:, 0], ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------- parallel and shared layers
def _norm_share(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a's share of a + b per token (b, n, 1): ‖a_t‖ / (‖a_t‖ + ‖b_t‖)."""
    na, nb = a.double().norm(dim=-1, keepdim=True), b.double().norm(dim=-1, keepdim=True)
    return na / (na + nb)


def _wired_layers(model_type: str, model, inputs) -> tuple[list, attnroll.AttentionRecord, list]:
    """The record of ``model`` and, from hooks of this test on the same pass, each layer's matrix (b, H, n, n) as the
    model's code wires its paths: Falcon-H1 w_a·A + w_m·M, Zamba M·(w_h·I + w_T·A) on hybrid layers, M alone on
    the others (M: capture/hybrids.mixer_matrix of the layer's mixer, checked above against its Jacobian); also the
    weight of the attention path of each layer that has one."""
    seen: list = []
    shares: list = []
    handles = []
    if model_type == "falcon_h1":
        for layer in model.model.layers:
            layer.ssm_out_multiplier *= 300.0  # the tiny model's SSD branch is ~1e-3 of its attention branch
            handles.append(layer.mamba.register_forward_hook(lambda m, a, k, o, layer=layer: seen.append(
                ("m", mixer_matrix(m, a, k, o), o * layer.ssm_out_multiplier)), with_kwargs=True))
            handles.append(layer.self_attn.register_forward_hook(lambda m, a, o, layer=layer: seen.append(
                ("a", o[1], o[0] * layer.attn_out_multiplier))))
    else:
        for layer in model.model.layers:
            if hasattr(layer, "mamba_decoder"):
                with torch.no_grad():  # the tiny model's projected shared-block output is ~1e-2 of the hidden state
                    layer.linear.weight.mul_(100.0)
            mamba = getattr(layer, "mamba_decoder", layer)
            handles.append(mamba.register_forward_pre_hook(lambda m, a, k: seen.append(
                ("paths", a[0] if a else k["hidden_states"], k.get("transformer_hidden_states"))), with_kwargs=True))
            handles.append(mamba.mamba.register_forward_hook(
                lambda m, a, k, o: seen.append(("m", mixer_matrix(m, a, k, o))), with_kwargs=True))
        shared = {id(m): m for layer in model.model.layers if hasattr(layer, "mamba_decoder")
                  for m in [getattr(layer, "shared_transf", None) or layer.shared_transformer]}
        for block in shared.values():
            handles.append(block.self_attn.register_forward_hook(lambda m, a, o: seen.append(("a", o[1]))))
    rec = attnroll.capture(model, inputs)
    for h in handles:
        h.remove()
    layers = []
    if model_type == "falcon_h1":
        for (_, M, y_m), (_, A, y_a) in zip(seen[0::2], seen[1::2]):
            w_a = _norm_share(y_a, y_m)[:, None]
            layers.append(w_a * A.double() + (1 - w_a) * M.double())
            shares.append(w_a)
        return layers, rec, shares
    attn = iter([s[1] for s in seen if s[0] == "a"])
    for (_, h, T), (_, M) in zip([s for s in seen if s[0] == "paths"], [s for s in seen if s[0] == "m"]):
        if T is None:
            layers.append(M.double())
            continue
        w_h = _norm_share(h, T)[:, None]
        eye = torch.eye(M.shape[-1], dtype=torch.float64)
        layers.append(M.double() @ (w_h * eye + (1 - w_h) * next(attn).double()))
        shares.append(1 - w_h)
    return layers, rec, shares


@pytest.mark.parametrize("model_type", ["falcon_h1", "zamba", "zamba2"])
def test_parallel_and_shared_layers_are_their_paths_weighted_by_norm(model_type):
    model, inputs = decoder(model_type), _inputs(pad=False)
    want, rec, shares = _wired_layers(model_type, model, inputs)
    got = rec.streams["self"]
    assert len(got) == len(want) == len(model.model.layers)
    H = model.config.num_attention_heads
    for g, w in zip(got, want):
        assert g.shape[1] == H
        torch.testing.assert_close(g.double(), w.expand(-1, H, -1, -1), atol=1e-5, rtol=0)
        torch.testing.assert_close(g.sum(-1).double(), torch.ones(g.shape[:-1], dtype=torch.float64), atol=1e-5,
                                   rtol=0)
    # the attention path really enters: a weight strictly between 0 and 1 on every token of every such layer
    assert shares and all(bool(((w > 0.01) & (w < 0.99)).all()) for w in shares), [float(w.min()) for w in shares]
    # the composed rollout is the naive product of (I + mean_h L) / 2 over the layers, first layer first
    e = attnroll.explain(model, inputs, method="rollout", sinks="keep")
    n = inputs["input_ids"].shape[1]
    R = torch.eye(n, dtype=torch.float64).expand(2, n, n)
    for w in want:
        R = (0.5 * w.mean(1) + 0.5 * torch.eye(n, dtype=torch.float64)) @ R
    torch.testing.assert_close(e.full_row.double(), R[:, -1], atol=1e-5, rtol=0)
    for method in ("raw", "flow", "grad_rollout", "gae"):  # the gradient methods: tests/capture/test_hybrids_grad.py
        assert torch.isfinite(attnroll.explain(model, inputs, method=method).full_row).all()
    with pytest.raises(attnroll.UnsupportedModelError, match=SEVEN[model_type]):
        attnroll.explain(model, inputs, method="attn_gradcam")


@pytest.mark.parametrize("model_type", _params())
def test_padding_on_the_right_changes_nothing_on_the_real_tokens(model_type):
    model, inputs = decoder(model_type), _inputs()
    for method in ("rollout", "raw", "flow"):
        e = attnroll.explain(model, inputs, method=method, sinks="keep")
        alone = attnroll.explain(model, {k: v[1:, :5] for k, v in inputs.items()}, method=method, sinks="keep")
        assert e.full_row[1, -2:].abs().max() == 0
        torch.testing.assert_close(alone.full_row[0], e.full_row[1, :5], atol=1e-5, rtol=1e-5)
