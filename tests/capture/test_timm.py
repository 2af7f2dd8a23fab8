"""timm VisionTransformer adapter: against softmax(q kᵀ·scale) recomputed from each block's qkv weights."""

from __future__ import annotations

import pytest
import torch

timm = pytest.importorskip("timm")

import attnroll  # noqa: E402
from attnroll.capture import CaptureError  # noqa: E402

from ..zoo import TIMM_SMALL  # noqa: E402
from .helpers import snapshot  # noqa: E402

SMALL = TIMM_SMALL


def build(name="vit_tiny_patch16_224", **kw):
    torch.manual_seed(0)
    return timm.create_model(name, **{**SMALL, **kw})


def manual(model, x):
    """Per-block softmax(q·scale kᵀ) from the block's own qkv projection, with fused attention left on
    (the model's default path), so nothing of attnroll is involved."""
    seen = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: seen.append((m, a[0]))) for b in model.blocks]
    try:
        with torch.no_grad():
            logits = model.eval()(x)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for attn, inp in seen:
        B, N, C = inp.shape
        qkv = attn.qkv(inp).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k, _ = qkv.unbind(0)
        out.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(-1))
    return out, logits


@pytest.mark.parametrize(
    "name, kw, prefix",
    [
        ("vit_tiny_patch16_224", {}, 1),
        ("deit_tiny_distilled_patch16_224", {}, 2),
        ("vit_tiny_patch16_224", {"reg_tokens": 4, "no_embed_class": True}, 5),
    ],
)
def test_timm_vits_against_manual_softmax(name, kw, prefix):
    model = build(name, **kw)
    assert all(b.attn.fused_attn for b in model.blocks)  # the path with nothing to hook
    before = snapshot(model)
    x = torch.randn(2, 3, 32, 32)
    rec = attnroll.capture(model, x)
    assert snapshot(model) == before
    expect, logits = manual(model, x)
    assert rec.family == "timm:vit" and rec.prefix == prefix and rec.grid == (4, 4)
    assert len(rec.attentions) == 2
    for a, e in zip(rec.attentions, expect):
        assert a.shape == (2, 4, prefix + 16, prefix + 16)
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)
    # Same predictions as the fused path the model takes by default.
    torch.testing.assert_close(rec.outputs, logits, atol=1e-5, rtol=1e-5)


def test_non_square_dynamic_image_size():
    model = build(dynamic_img_size=True)
    rec = attnroll.capture(model, torch.randn(1, 3, 32, 48))
    assert rec.grid == (4, 6) and rec.attentions[0].shape[-1] == 1 + 24


def test_wrong_image_size_is_a_clear_error():
    with pytest.raises(AssertionError) as info:
        attnroll.capture(build(), torch.randn(1, 3, 32, 48))
    assert "doesn't match model" in str(info.value) and "attnroll.capture" in " ".join(info.value.__notes__)


def test_fused_flags_restored_after_an_exception():
    model = build()
    h = model.blocks[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        attnroll.capture(model, torch.randn(1, 3, 32, 32))
    assert snapshot(model) == before and model.blocks[0].attn.fused_attn is True
    h.remove()


def test_keep_grad_and_fusion():
    model = build()
    x = torch.randn(2, 3, 32, 32)
    rec = attnroll.capture(model, x, keep_grad=True)
    rec.outputs[:, 0].sum().backward()
    grads = rec.gradients()
    # Independent: the same attention as outputs of an unfused, hooked-by-hand forward, then autograd.grad.
    ref = build()
    for b in ref.blocks:
        b.attn.fused_attn = False
    kept = []
    hooks = [b.attn.attn_drop.register_forward_hook(lambda m, a, o: kept.append(o)) for b in ref.blocks]
    out = ref.eval()(x)
    for h in hooks:
        h.remove()
    expect = torch.autograd.grad(out[:, 0].sum(), kept)
    for g, e in zip(grads, expect):
        assert float(e.abs().max()) > 0
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
    fused = attnroll.capture(model, x, fuse_heads="mean")
    for f, a in zip(fused.attentions, rec.attentions):
        torch.testing.assert_close(f, a.detach().mean(1), atol=1e-6, rtol=0)


def test_timm_swinv2_cr_is_refused():
    # swin_* / swinv2_* are captured by capture/swin.py (tests/capture/test_swin.py); the "cr" variant is not.
    model = timm.create_model(
        "swinv2_cr_tiny_ns_224", pretrained=False, img_size=32, window_size=4, depths=(1, 1), embed_dim=16,
        num_heads=(2, 2), num_classes=3,
    )
    with pytest.raises(attnroll.UnsupportedModelError, match="shifted local windows"):
        attnroll.capture(model, torch.randn(1, 3, 32, 32))


def test_context_manager_sees_unfused_path():
    model = build()
    with attnroll.capture(model) as rec:
        assert all(b.attn.fused_attn is False for b in model.blocks)
        model(torch.randn(1, 3, 32, 32))
    assert all(b.attn.fused_attn is True for b in model.blocks)
    assert len(rec.attentions) == 2
    # With fused attention forced back on inside the block, attn_drop never runs: a clear error.
    with pytest.raises(CaptureError, match="no attention was captured"):
        with attnroll.capture(model):
            for b in model.blocks:
                b.attn.fused_attn = True
            model(torch.randn(1, 3, 32, 32))
