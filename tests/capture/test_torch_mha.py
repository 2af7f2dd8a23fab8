"""nn.MultiheadAttention adapter: per-head weights against a manual softmax(q kᵀ/√d) from the weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnroll

from .helpers import snapshot

E, H = 16, 4


def manual_probs(mha: nn.MultiheadAttention, x: torch.Tensor, pad: torch.Tensor | None = None, causal=False):
    """softmax(q kᵀ / √d) per head from the module's own projection weights; x is (B, n, E) batch-first.
    ``pad`` (B, n) True = padding key. Returns (B, H, n, n)."""
    B, n, _ = x.shape
    w_q, w_k, _ = mha.in_proj_weight.chunk(3)
    b_q, b_k, _ = mha.in_proj_bias.chunk(3)
    d = E // H
    q = (x @ w_q.T + b_q).view(B, n, H, d).transpose(1, 2)
    k = (x @ w_k.T + b_k).view(B, n, H, d).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if pad is not None:
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1)


def encoder(layers=2, norm_first=False):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=24, dropout=0.1, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=not norm_first)


def layer_inputs(model: nn.TransformerEncoder, x, pad=None):
    """The input each layer's self-attention sees (post-LN layers: the layer input itself)."""
    seen = []
    hooks = [l.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for l in model.layers]
    torch.backends.mha.set_fastpath_enabled(False)  # so that the pre-hooks and the slow path agree
    try:
        with torch.no_grad():
            model.eval()(x, src_key_padding_mask=pad)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_transformer_encoder_in_eval_fast_path_and_padding():
    model = encoder()
    x = torch.randn(2, 6, E)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    before = snapshot(model)
    assert before[""][0] is True  # built in training mode
    rec = attnroll.capture(model, {"src": x, "src_key_padding_mask": pad})
    assert snapshot(model) == before
    assert rec.family == "torch:mha" and list(rec.streams) == ["self"]
    inputs = layer_inputs(model, x, pad)
    for i, a in enumerate(rec.attentions):
        assert a.shape == (2, H, 6, 6)
        expect = manual_probs(model.layers[i].self_attn, inputs[i], pad)
        torch.testing.assert_close(a, expect, atol=1e-6, rtol=1e-5)
    assert torch.equal(rec.attention_mask, (~pad).long())
    # The model computed what it computes without capture (the eval fast path included).
    model.eval()
    with torch.no_grad():
        plain = model(x, src_key_padding_mask=pad)
    # The fast path returns zeros at padded positions (nested tensors); compare the real tokens.
    torch.testing.assert_close(rec.outputs[~pad], plain[~pad], atol=1e-5, rtol=1e-5)


def test_callers_still_get_what_they_asked_for():
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(1, 5, E)
    expect = manual_probs(mha, x)
    with attnroll.capture(mha) as rec:
        out_avg, w_avg = mha(x, x, x)  # defaults: need_weights=True, averaged
        out_none, w_none = mha(x, x, x, need_weights=False)
        _, w_heads = mha(x, x, x, average_attn_weights=False)
    assert w_none is None
    torch.testing.assert_close(w_avg, expect.mean(1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w_heads, expect, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rec.attentions[0], expect, atol=1e-6, rtol=1e-5)
    assert "forward" not in mha.__dict__
    torch.testing.assert_close(out_none, mha(x, x, x)[0])


def test_unbatched_and_sequence_first():
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(E, H)  # (n, B, E) layout
    x = torch.randn(5, E)  # unbatched
    rec = attnroll.capture(mha, (x, x, x))
    torch.testing.assert_close(rec.attentions[0], manual_probs(mha, x[None]), atol=1e-6, rtol=1e-5)
    xb = torch.randn(5, 3, E)
    rec = attnroll.capture(mha, (xb, xb, xb))
    torch.testing.assert_close(rec.attentions[0], manual_probs(mha, xb.transpose(0, 1)), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_keep_grad_matches_the_gradient_of_a_manual_forward(causal):
    """d(output)/d(attention) from the record equals autograd through a hand-written layer whose attention
    matrix is a leaf tensor."""
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 5, E)
    mask = nn.Transformer.generate_square_subsequent_mask(5) if causal else None
    rec = attnroll.capture(mha, {"query": x, "key": x, "value": x, "attn_mask": mask}, keep_grad=True)
    out = rec.outputs[0]
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    grad = rec.gradients()[0]

    a = manual_probs(mha, x, causal=causal).detach().requires_grad_(True)
    _, _, w_v = mha.in_proj_weight.chunk(3)
    _, _, b_v = mha.in_proj_bias.chunk(3)
    v = (x @ w_v.T + b_v).view(2, 5, H, E // H).transpose(1, 2)
    manual_out = mha.out_proj((a @ v).transpose(1, 2).reshape(2, 5, E))
    torch.testing.assert_close(manual_out, out, atol=1e-5, rtol=1e-5)
    (expect,) = torch.autograd.grad((manual_out * weights).sum(), a)
    torch.testing.assert_close(rec.attentions[0].detach(), a.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, expect, atol=1e-5, rtol=1e-5)


def test_nn_transformer_streams():
    torch.manual_seed(4)
    model = nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=24, batch_first=True)
    src, tgt = torch.randn(1, 6, E), torch.randn(1, 4, E)
    rec = attnroll.capture(model, (src, tgt))
    assert {k: [tuple(t.shape) for t in v] for k, v in rec.streams.items()} == {
        "encoder": [(1, H, 6, 6)] * 2,
        "decoder": [(1, H, 4, 4)] * 2,
        "cross": [(1, H, 4, 6)] * 2,
    }
    assert rec.layer_names["cross"] == ["decoder.layers.0.multihead_attn", "decoder.layers.1.multihead_attn"]
    for layers in rec.streams.values():
        for a in layers:
            torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-5, rtol=0)


def test_fastpath_flag_and_forward_restored_after_an_exception():
    model = encoder(norm_first=True)
    torch.backends.mha.set_fastpath_enabled(True)

    def boom(module, args, kwargs):
        raise RuntimeError("boom")

    h = model.layers[1].register_forward_pre_hook(boom, with_kwargs=True)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        attnroll.capture(model, torch.randn(1, 3, E))
    after = snapshot(model)
    h.remove()
    assert after == before and after["__fastpath__"] is True
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_fused_capture_keeps_only_fused_matrices():
    model = encoder()
    x = torch.randn(2, 6, E)
    full = attnroll.capture(model, x)
    fused = attnroll.capture(model, x, fuse_heads="max")
    for f, a in zip(fused.attentions, full.attentions):
        torch.testing.assert_close(f, a.amax(dim=1))
        assert f.untyped_storage().nbytes() == f.numel() * f.element_size()
