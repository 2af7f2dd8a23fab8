"""timm's other global-attention ViTs (EVA / EVA02, RoPE ViT, BEiT, relpos ViT, NaFlexViT): the captured
probabilities must reproduce each block's own attention output on the model's default (fused SDPA) path —
(A @ v) with v from the block's own projection equals what the block feeds its output projection — and the
layout and readout follow the model (prefix from num_prefix_tokens, avg pooling = mean of the patch rows)."""

from __future__ import annotations

import pytest
import torch

import attnroll

from .helpers import snapshot

timm = pytest.importorskip("timm")

BASE = dict(pretrained=False, depth=2, embed_dim=32, num_heads=4, num_classes=3, img_size=32, patch_size=8)
FAMILIES = [
    ("eva02_tiny_patch14_224", 1), ("vit_medium_patch16_rope_reg1_gap_256", 1), ("beit_base_patch16_224", 1),
    ("vit_relpos_small_patch16_224", 0), ("naflexvit_base_patch16_gap", 4),
]


def values_and_outputs(model, x):
    """Per attention module: v (B, H, n, d) from its own projections and the tensor its output projection
    (or the norm before it) receives, on the model's default fused path."""
    mods = [m for m in model.modules() if hasattr(m, "fused_attn") and hasattr(m, "attn_drop")]
    seen = {}
    hooks = []
    for i, m in enumerate(mods):
        hooks.append(m.register_forward_pre_hook(lambda mod, a, i=i: seen.setdefault(i, {}).update(x=a[0])))
        after = m.norm if isinstance(getattr(m, "norm", None), torch.nn.LayerNorm) else m.proj
        hooks.append(after.register_forward_pre_hook(lambda mod, a, i=i: seen[i].update(out=a[0])))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    result = []
    for i, m in enumerate(mods):
        inp = seen[i]["x"]
        B, N, C = inp.shape
        if getattr(m, "qkv", None) is not None:
            v = m.qkv(inp).reshape(B, N, 3, m.num_heads, -1)[:, :, 2]
        else:
            v = m.v_proj(inp).reshape(B, N, m.num_heads, -1)
        result.append((v.transpose(1, 2), seen[i]["out"]))
    return result


@pytest.mark.parametrize("name, prefix", FAMILIES)
def test_timm_family_attention_reproduces_the_blocks_output(name, prefix):
    torch.manual_seed(0)
    model = timm.create_model(name, **BASE).eval()
    x = torch.randn(2, 3, 32, 32)
    before = snapshot(model)
    rec = attnroll.capture(model, x)
    assert snapshot(model) == before
    pairs = values_and_outputs(model, x)
    assert len(rec.attentions) == len(pairs) == 2
    for A, (v, out) in zip(rec.attentions, pairs):
        B, H, n, d = v.shape
        mixed = (A @ v).transpose(1, 2).reshape(B, n, H * d)
        torch.testing.assert_close(mixed, out, atol=1e-5, rtol=1e-4)
    info = rec.info["self"]
    assert (info.prefix, info.grid) == (prefix, (4, 4))
    assert info.readout.kind == "mean" and float(info.readout.weights[:, :prefix].sum()) == 0
