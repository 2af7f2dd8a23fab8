"""Swin / SwinV2 (transformers and timm): window attention scattered into each stage's matrix, the stage chain.

Compared against the models' own attention weights (transformers ``output_attentions=True`` on eager), a
naive token-by-token recomputation with the cyclic shift and its mask written here, the models' own patch
merging fed with one-hot tokens, and naive matrix products for the composed maps."""

import math

import pytest
import torch
import transformers as T
from torch import nn

import attnroll
from attnroll.capture.swin import hf_window_ids

from ..zoo import SWIN_HF, SWIN_TIMM

# Left out of `make test-fast` (its 90 s budget on 2 cores); `make test` and CI run it.
pytestmark = pytest.mark.slow

timm = pytest.importorskip("timm")

X = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def hf_swin(**kw):
    torch.manual_seed(0)
    cfg = dict(SWIN_HF, num_labels=3)
    return T.SwinForImageClassification(T.SwinConfig(**{**cfg, **kw})).eval()


def timm_swin(name="swin_tiny_patch4_window7_224", **kw):
    torch.manual_seed(0)
    cfg = dict(SWIN_TIMM, pretrained=False, num_classes=3)
    return timm.create_model(name, **{**cfg, **kw}).eval()


def gather(dense, ids):
    """Window tensor (B·nW, H, w², w²) read back out of the stage matrix (B, H, n, n) at window positions."""
    B, H = dense.shape[:2]
    return dense[:, :, ids[:, :, None], ids[:, None, :]].permute(0, 2, 1, 3, 4).reshape(B * ids.shape[0], H, *ids.shape[1:], ids.shape[1])


# ------------------------------------------------------------------------------ against the model's own
def test_hf_swin_window_attention_equals_the_models_own_eager_attention():
    model = hf_swin()
    rec = attnroll.capture(model, {"pixel_values": X})
    assert [tuple(t.shape) for t in rec.attentions] == [(2, 2, 256, 256)] * 2 + [(2, 2, 64, 64)] * 2
    model.config._attn_implementation = "eager"
    own = model(pixel_values=X, output_attentions=True).attentions  # the last block of each stage
    layers = dict(_blocks(model))
    for stage, layer in enumerate((1, 3)):
        blk = layers[layer]
        H = W = 16 // 2 ** stage
        got = gather(rec.attentions[layer], hf_window_ids(blk, H, W))
        assert torch.allclose(got, own[stage], atol=1e-5)


def test_hf_swinv2_window_attention_equals_the_models_own():
    torch.manual_seed(0)
    model = T.Swinv2ForImageClassification(T.Swinv2Config(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4, num_labels=3)).eval()
    rec = attnroll.capture(model, {"pixel_values": X})
    own = model(pixel_values=X, output_attentions=True).attentions
    layers = dict(_blocks(model))
    for stage, layer in enumerate((1, 3)):
        H = W = 16 // 2 ** stage
        assert torch.allclose(gather(rec.attentions[layer], hf_window_ids(layers[layer], H, W)), own[stage], atol=1e-5)
    assert rec.family == "hf:swinv2" and rec.info["self"].grid == (16, 16)


def _blocks(model):
    from attnroll.capture.swin import _hf_layers, _timm_blocks

    found = _hf_layers(model) or _timm_blocks(model)
    return list(enumerate(m for _, m in found))


# ------------------------------------------------------------------------------ naive, token by token
def naive_window_attention(q, k, H, W, w, s, bias):
    """Attention (B, Hh, n, n) computed token by token: tokens p, t attend when they fall in one window of
    the grid cyclically shifted by −s; logits q·k (already scaled) + bias[h, pos_p, pos_t] − 100 across the
    shift's wrap-around regions; softmax over the window. q, k: (B, n, Hh, d) in raster order."""
    n = H * W
    B, _, Hh, _ = q.shape
    out = torch.zeros(B, Hh, n, n, dtype=q.dtype)

    def where(p):
        r, c = divmod(p, W)
        rs, cs = (r - s) % H, (c - s) % W  # the token's place on the shifted grid
        region = (0 if rs < H - w else 1 if rs < H - s else 2, 0 if cs < W - w else 1 if cs < W - s else 2)
        return (rs // w, cs // w), (rs % w) * w + cs % w, region

    info = [where(p) for p in range(n)]
    for p in range(n):
        win, pos, reg = info[p]
        keys = [t for t in range(n) if info[t][0] == win]
        logits = torch.stack([
            torch.einsum("bhd,bhd->bh", q[:, p], k[:, t]) + bias[:, pos, info[t][1]]
            + (-100.0 if s > 0 and info[t][2] != reg else 0.0) for t in keys
        ], dim=-1)
        out[:, :, p, keys] = logits.softmax(-1)
    return out


def _inputs_of(module, model, x, call):
    got = {}

    def keep(m, a, o):
        got.setdefault("x", o.detach())

    handle = module.register_forward_hook(keep)
    with torch.no_grad():
        call(model, x)
    handle.remove()
    return got["x"]


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_hf_swin_scattered_matrix_equals_naive_shifted_window_attention(layer):
    model = hf_swin()
    rec = attnroll.capture(model, {"pixel_values": X})
    blk = dict(_blocks(model))[layer]
    H = W = 16 if layer < 2 else 8
    x = _inputs_of(blk.layernorm_before, model, X, lambda m, v: m(pixel_values=v))  # (B, n, C), raster order
    att = blk.attention
    Hh, d = att.num_attention_heads, att.head_dim
    q = att.q_proj(x).reshape(2, H * W, Hh, d) * att.scaling
    k = att.k_proj(x).reshape(2, H * W, Hh, d)
    bias = att.relative_position_bias()[0]
    want = naive_window_attention(q.detach(), k.detach(), H, W, int(blk.window_size), int(blk.shift_size), bias.detach())
    assert (blk.shift_size > 0) == (layer % 2 == 1)  # the shifted layers are really tested
    assert torch.allclose(rec.attentions[layer], want, atol=1e-5)


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_timm_swin_scattered_matrix_equals_naive_softmax_from_the_blocks_qkv(layer):
    model = timm_swin()
    rec = attnroll.capture(model, X)
    blk = dict(_blocks(model))[layer]
    x = _inputs_of(blk.norm1, model, X, lambda m, v: m(v))  # (B, H, W, C)
    B, H, W, C = x.shape
    att = blk.attn
    qkv = att.qkv(x.reshape(B, H * W, C)).reshape(B, H * W, 3, att.num_heads, -1)
    q, k = qkv[:, :, 0] * att.scale, qkv[:, :, 1]
    want = naive_window_attention(q.detach(), k.detach(), H, W, blk.window_size[0], blk.shift_size[0],
                                  att._get_rel_pos_bias()[0].detach())
    assert torch.allclose(rec.attentions[layer], want, atol=1e-5)


def test_timm_swinv2_window_attention_equals_the_softmax_recomputed_from_the_attention_module():
    model = timm_swin("swinv2_tiny_window8_256")
    got = {}
    blocks = dict(_blocks(model))

    def keep(i):
        def hook(m, a, kw, o):
            got.setdefault(i, (a[0].detach(), kw.get("mask", a[1] if len(a) > 1 else None)))
        return hook

    hooks = [b.attn.register_forward_hook(keep(i), with_kwargs=True) for i, b in blocks.items()]
    rec = attnroll.capture(model, X)
    for h in hooks:
        h.remove()
    for i, blk in blocks.items():
        xw, mask = got[i]
        att = blk.attn
        qkv = nn.functional.linear(xw, att.qkv.weight, torch.cat((att.q_bias, att.k_bias, att.v_bias)))
        qkv = qkv.reshape(xw.shape[0], xw.shape[1], 3, att.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = qkv[0], qkv[1]
        logits = nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(k, dim=-1).transpose(-2, -1)
        logits = logits * torch.clamp(att.logit_scale, max=math.log(100.0)).exp()
        table = att.cpb_mlp(att.relative_coords_table).view(-1, att.num_heads)
        N = xw.shape[1]
        rpb = table[att.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
        logits = logits + 16 * torch.sigmoid(rpb)[None]
        if mask is not None:
            logits = (logits.view(-1, mask.shape[0], att.num_heads, N, N) + mask[None, :, None]).view(-1, att.num_heads, N, N)
        H = W = 16 if i < 2 else 8
        from attnroll.capture.swin import timm_window_ids

        assert torch.allclose(gather(rec.attentions[i], timm_window_ids(blk, H, W)), logits.softmax(-1).detach(), atol=1e-5)


# ------------------------------------------------------------------------------ patch merging
def _one_hot_merge(merge, rows, cols, hf):
    """What the model's own merge layer makes of one-hot tokens, its norm off and its reduction summing
    the four concatenated chunks: (n_out, n_in) 0/1, the sources of each merged token."""
    n = rows * cols
    C = n
    with torch.no_grad():
        merge.norm = nn.Identity()
        red = torch.zeros_like(merge.reduction.weight)  # (out, 4C)
        for j in range(4):
            red[:C, j * C:(j + 1) * C] = torch.eye(C)
        merge.reduction.weight.copy_(red)
        x = torch.eye(n)[None]  # token t carries e_t
        out = merge(x, (rows, cols)) if hf else merge(x.reshape(1, rows, cols, C))
    return out.reshape(-1, out.shape[-1])[:, :C]


@pytest.mark.parametrize("grid", [(4, 6), (3, 5)])
@pytest.mark.parametrize("which", ["hf_swin", "hf_swinv2", "timm_swin", "timm_swinv2"])
def test_merge_map_groups_the_tokens_the_models_patch_merging_concatenates(which, grid):
    from attnroll.core.stages import merge_2x2
    from timm.models import swin_transformer, swin_transformer_v2
    from transformers.models.swin import modeling_swin
    from transformers.models.swinv2 import modeling_swinv2

    rows, cols = grid
    C = rows * cols
    merge = {
        "hf_swin": lambda: modeling_swin.SwinPatchMerging(C),
        "hf_swinv2": lambda: modeling_swinv2.Swinv2PatchMerging(grid, C),
        "timm_swin": lambda: swin_transformer.PatchMerging(C, out_dim=4 * C),
        "timm_swinv2": lambda: swin_transformer_v2.PatchMerging(C, out_dim=4 * C),
    }[which]()
    sources = _one_hot_merge(merge, rows, cols, which.startswith("hf"))
    assert torch.equal(sources > 0.5, merge_2x2(rows, cols) > 0)
    assert torch.allclose(sources[sources > 0.5], torch.ones(1))  # each source once


# ------------------------------------------------------------------------------ composition
def test_one_window_over_the_whole_stage_and_one_stage_is_plain_rollout():
    model = hf_swin(image_size=16, depths=[2], num_heads=[2], window_size=8)  # 8x8 patches, one 8x8 window
    rec = attnroll.capture(model, {"pixel_values": X[:, :, :16, :16]})
    info = rec.info["self"]
    assert info.merges == {} and info.grid == (8, 8)
    assert all(bool((t > 0).all()) for t in rec.attentions)  # global: every token sees every token
    model.config._attn_implementation = "eager"
    own = model(pixel_values=X[:, :, :16, :16], output_attentions=True).attentions[-1]
    assert torch.allclose(rec.attentions[-1], own, atol=1e-5)  # one window = the stage matrix as it is
    e = attnroll.explain(model, {"pixel_values": X[:, :, :16, :16]}, method="rollout")
    plain = attnroll.rollout(rec.attentions)  # (B, 64, 64)
    assert torch.allclose(e.full_row, plain.mean(dim=1), atol=1e-5)  # the mean readout of plain rollout


def _naive_chain(rec, alpha=0.5):
    """R = Ã3·Ã2·M·Ã1·Ã0 by full matrix products, M written out here (¼ of each 2x2 source)."""
    M = torch.zeros(64, 256)
    for r in range(16):
        for c in range(16):
            M[(r // 2) * 8 + c // 2, r * 16 + c] = 0.25
    aug = [(1 - alpha) * t.mean(1) + alpha * torch.eye(t.shape[-1]) for t in rec.attentions]
    return aug[3] @ aug[2] @ M @ aug[1] @ aug[0], M


def test_default_rollout_is_the_mean_of_the_last_stage_rows_of_the_naive_chain():
    model = hf_swin()
    rec = attnroll.capture(model, {"pixel_values": X})
    R, _ = _naive_chain(rec)
    e = attnroll.explain(model, {"pixel_values": X}, method="rollout")
    assert e.readout["kind"] == "mean" and e.grid == (16, 16) and e.scores.shape == (2, 256)
    assert torch.allclose(e.full_row, R.mean(dim=1), atol=1e-6)
    assert torch.allclose(e.full_row.sum(-1), torch.ones(2), atol=1e-5)  # row-stochastic chain
    one = attnroll.explain(model, {"pixel_values": X}, method="rollout", readout=5)
    assert torch.allclose(one.full_row, R[:, 5], atol=1e-6)


def test_raw_is_the_last_layer_row_pulled_back_through_the_merge_map():
    model = timm_swin()
    rec = attnroll.capture(model, X)
    _, M = _naive_chain(rec)
    e = attnroll.explain(model, X, method="raw")
    want = (rec.attentions[3].mean(1).mean(dim=1)) @ M  # mean readout row of the last layer, then ¼ per source
    assert torch.allclose(e.full_row, want, atol=1e-6)
    first = attnroll.explain(model, X, method="raw", layer=0)
    w0 = torch.full((2, 64), 1 / 64) @ M  # the readout carried down to the first stage by structure
    assert torch.allclose(first.full_row, torch.einsum("bi,bij->bj", w0, rec.attentions[0].mean(1)), atol=1e-6)


def test_gradients_are_the_models_own_scattered_into_the_stage_matrix():
    model = hf_swin()
    model.config._attn_implementation = "eager"
    out = model(pixel_values=X, output_attentions=True)
    y = out.logits[:, 0].sum()
    own = torch.autograd.grad(y, list(out.attentions))
    rec = attnroll.capture(model, {"pixel_values": X}, keep_grad=True)
    rec.outputs.logits[:, 0].sum().backward()
    grads = rec.gradients()
    layers = dict(_blocks(model))
    for stage, layer in enumerate((1, 3)):
        H = W = 16 // 2 ** stage
        assert torch.allclose(gather(grads[layer], hf_window_ids(layers[layer], H, W)), own[stage], atol=1e-6)
        outside = torch.ones_like(grads[layer], dtype=torch.bool)
        outside[:, :, ] = rec.attentions[layer].detach() == 0
        assert bool((grads[layer][outside] == 0).all())  # no gradient between windows


@pytest.mark.parametrize("method", ["rollout", "grad_rollout", "gae", "raw"])
def test_a_batch_equals_its_examples(method):
    model = timm_swin()
    both = attnroll.explain(model, X, method=method, target=1)
    for b in range(2):
        one = attnroll.explain(model, X[b:b + 1], method=method, target=1)
        assert torch.allclose(both.full_row[b], one.full_row[0], atol=1e-5)


def test_windows_with_padding_are_renormalised_over_real_tokens():
    # 24 px / patch 2 = 12x12 tokens, window 5: the partition pads to 15x15 (then 6x6 to 10x10) with zeros
    # that carry no token.
    model = hf_swin(image_size=24, window_size=5)
    rec = attnroll.capture(model, {"pixel_values": X[:, :, :24, :24]})
    assert [tuple(t.shape[-2:]) for t in rec.attentions] == [(144, 144)] * 2 + [(36, 36)] * 2
    for t in rec.attentions:
        assert torch.allclose(t.sum(-1), torch.ones(()), atol=1e-5)
    assert rec.info["self"].merges[2].shape == (36, 144)


# ------------------------------------------------------------------------------ refusals and state
def test_methods_that_cannot_compose_a_stage_chain_say_so():
    model = hf_swin()
    inputs = {"pixel_values": X}
    with pytest.raises(attnroll.UnsupportedModelError, match="attention='dense'"):
        attnroll.explain(model, inputs, method="rollout", attention="recompute")
    with pytest.raises(ValueError, match="stage chain"):
        attnroll.explain(model, inputs, method="flow")
    with pytest.raises(ValueError, match="method='rollout'"):
        attnroll.explain(model, inputs, method="per_head_rollout")
    with pytest.raises(ValueError, match="return_layers"):
        attnroll.explain(model, inputs, method="rollout", return_layers=True)
    with pytest.raises(ValueError, match="stage chain"):
        attnroll.explain(model, inputs, method="attn_gradcam")
    with pytest.raises(attnroll.UnsupportedModelError, match="windows|stage chain"):
        attnroll.explain(model, inputs, method="norm_rollout")
    assert attnroll.explain(model, inputs, method="rollout", attention="dense").options["attention"] == "dense"


def test_timm_max_pooling_has_no_default_readout():
    model = timm_swin(global_pool="max")
    with pytest.raises(ValueError, match="readout="):
        attnroll.explain(model, X, method="rollout")
    assert attnroll.explain(model, X, method="rollout", readout="mean").scores.shape == (2, 256)


def _state(model):
    cfgs = [m.config for m in model.modules() if hasattr(m, "config")]
    return (
        [getattr(c, "_attn_implementation", None) for c in cfgs],
        [m.training for m in model.modules()],
        [p.requires_grad for p in model.parameters()],
        [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        [getattr(m, "fused_attn", None) for m in model.modules()],
        [p.grad is None for p in model.parameters()],
    )


@pytest.mark.parametrize("make", [hf_swin, timm_swin])
def test_the_models_state_is_unchanged(make):
    model = make()
    model.train()
    for p in list(model.parameters())[:3]:
        p.requires_grad_(False)
    before = _state(model)
    x = {"pixel_values": X} if make is hf_swin else X
    for method in ("rollout", "grad_rollout", "raw"):
        attnroll.explain(model, x, method=method)
    assert _state(model) == before
