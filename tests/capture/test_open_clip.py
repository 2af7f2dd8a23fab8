"""open_clip CLIP models and their towers: two streams, the readouts open_clip pools, rollout equal to an
independent recomputation from the model's own nn.MultiheadAttention weights."""

from __future__ import annotations

import pytest
import torch

open_clip = pytest.importorskip("open_clip")
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg  # noqa: E402

import attnroll  # noqa: E402
from attnroll.capture.registry import family_of  # noqa: E402

CTX = 10
ROLLOUT_METHODS = ("rollout", "raw", "per_head_rollout", "flow", "grad_rollout", "gae", "attn_gradcam")


def tiny(vision: dict | None = None, text: dict | None = None, seed: int = 0, embed_dim: int = 16) -> CLIP:
    torch.manual_seed(seed)
    v = dict(layers=2, width=32, head_width=8, image_size=32, patch_size=8, **(vision or {}))
    t = dict(context_length=CTX, vocab_size=50, width=32, heads=4, layers=2, **(text or {}))
    m = CLIP(embed_dim, CLIPVisionCfg(**v), CLIPTextCfg(**t)).eval()
    with torch.no_grad():  # sharper attention than the default initialisation
        for p in m.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    return m


def pair(batch: int = 2, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (batch, CTX), generator=g)
    ids[0, 6], ids[1, 4] = 49, 49  # the end-of-text tokens (the largest id), then padding
    ids[0, 7:], ids[1, 5:] = 0, 0
    return {"image": torch.randn(batch, 3, 32, 32, generator=g), "text": ids}


def own_attention(model: torch.nn.Module, blocks, call) -> list[torch.Tensor]:
    """Each block's head-mean attention probabilities recomputed from its nn.MultiheadAttention weights on the
    input it got in a plain forward pass (no attnroll)."""
    seen = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a, k: seen.append((m, a[0], k.get("attn_mask"))),
                                              with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad():
            call()
    finally:
        for h in hooks:
            h.remove()
    out = []
    for m, x, mask in seen:
        B, n, E = x.shape
        H, d = m.num_heads, E // m.num_heads
        q, k, _ = torch.nn.functional.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
        q, k = (t.reshape(B, n, H, d).transpose(1, 2) for t in (q, k))
        s = q @ k.transpose(-1, -2) / d ** 0.5
        if mask is not None:
            s = s + mask
        out.append(s.softmax(-1).mean(1))
    return out


def pool_attention(pooler: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An AttentionalPooler's head-mean attention (B, queries, n) from its weights, on its input ``x``."""
    m = pooler.attn
    B, n, _ = x.shape
    kx, q = pooler.ln_k(x), pooler.ln_q(pooler.query)
    H, d = m.num_heads, m.embed_dim // m.num_heads
    E = m.embed_dim
    wq, wk = (m.in_proj_weight[:E], m.in_proj_weight[E:2 * E]) if m.in_proj_weight is not None else (
        m.q_proj_weight, m.k_proj_weight)
    qq = torch.nn.functional.linear(q, wq, m.in_proj_bias[:E]).reshape(-1, H, d).transpose(0, 1)
    kk = torch.nn.functional.linear(kx, wk, m.in_proj_bias[E:2 * E])
    kk = kk.reshape(B, n, H, d).transpose(1, 2)
    return (qq[None] @ kk.transpose(-1, -2) / d ** 0.5).softmax(-1).mean(1)


def rolled(atts: list[torch.Tensor]) -> torch.Tensor:
    n = atts[0].shape[-1]
    R = torch.eye(n)
    for a in atts:
        R = (0.5 * a + 0.5 * torch.eye(n)) @ R
    return R


def test_detected_as_open_clip_before_plain_multihead_attention():
    m = tiny()
    for model in (m, m.visual):
        assert family_of(model).name == "open_clip"
    text_tower = open_clip.transformer.TextTransformer(context_length=CTX, vocab_size=50, width=32, heads=4, layers=2)
    assert family_of(text_tower).name == "open_clip"
    assert family_of(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, batch_first=True), 2)).name == "torch"


def test_vision_and_text_rollout_equal_the_models_own_attention():
    m, x = tiny(), pair()
    with torch.no_grad():
        pooled_at = x["text"].argmax(-1)
    A_v = own_attention(m, m.visual.transformer.resblocks, lambda: m.encode_image(x["image"]))
    A_t = own_attention(m, m.transformer.resblocks, lambda: m.encode_text(x["text"]))
    Rv, Rt = rolled(A_v), rolled(A_t)
    ev = attnroll.explain(m, x, "rollout", stream="vision")
    et = attnroll.explain(m, x, "rollout", stream="text")
    torch.testing.assert_close(ev.full_row, Rv[:, 0], atol=1e-5, rtol=0)
    assert ev.grid == (4, 4) and ev.prefix == 1 and ev.readout["kind"] == "cls"
    torch.testing.assert_close(et.full_row, Rt[torch.arange(2), pooled_at], atol=1e-5, rtol=0)
    assert et.readout["kind"] == "eot" and et.positions == pooled_at.tolist()
    assert float(et.full_row[0, 7:].abs().max()) == 0  # causal: nothing after the end-of-text token
    # the towers alone and one tower's input give the same maps
    torch.testing.assert_close(attnroll.explain(m.visual, x["image"], "rollout").full_row, ev.full_row)
    torch.testing.assert_close(attnroll.explain(m, {"text": x["text"]}, "rollout").full_row, et.full_row)


@pytest.mark.parametrize("vision", [dict(pool_type="avg"), dict(attentional_pool=True, attn_pooler_queries=3,
                                                                  attn_pooler_heads=4),
                                    dict(attentional_pool=True, attn_pooler_queries=3, attn_pooler_heads=4,
                                         pool_type="avg"),
                                    dict(attentional_pool="parallel", attn_pooler_queries=3, attn_pooler_heads=4),
                                    dict(attentional_pool="cascade", attn_pooler_queries=3, attn_pooler_heads=4)],
                         ids=["avg", "attn_pool_tok", "attn_pool_avg", "parallel", "cascade"])
def test_vision_readouts(vision):
    m = tiny(vision, embed_dim=32)
    px = pair()["image"]
    vis = m.visual
    tokens = []
    h = vis.transformer.register_forward_hook(lambda mod, a, out: tokens.append(out))
    A = own_attention(m, vis.transformer.resblocks, lambda: m.encode_image(px))
    h.remove()
    R, x = rolled(A), tokens[0]
    if vis.attn_pool is None:
        w = torch.zeros(2, R.shape[-1])
        w[:, 1:] = 1 / (R.shape[-1] - 1)
    elif vis.attn_pool_contrastive is None:
        P = pool_attention(vis.attn_pool, x)
        w = P[:, 0] if vis.pool_type == "tok" else P[:, 1:].mean(1)
    else:
        xn = vis.ln_post(x)
        P = pool_attention(vis.attn_pool, xn)
        if vis.attn_pool_type == "parallel":
            w = pool_attention(vis.attn_pool_contrastive, xn)[:, 0]
        else:
            w = (pool_attention(vis.attn_pool_contrastive, vis.attn_pool(xn)) @ P)[:, 0]
    e = attnroll.explain(m.visual, px, "rollout")
    torch.testing.assert_close(e.readout_weights, w, atol=1e-5, rtol=0)
    torch.testing.assert_close(e.full_row, (w[:, None] @ R)[:, 0], atol=1e-5, rtol=0)


def test_eos_and_last_text_pooling():
    x = pair()
    m = tiny(text=dict(pool_type="eos", eos_id=7))
    ids = x["text"].clone()
    ids[0, 3], ids[1, 2] = 7, 7
    e = attnroll.explain(m, {"text": ids}, "rollout")
    assert e.positions == [3, 2]
    R = rolled(own_attention(m, m.transformer.resblocks, lambda: m.encode_text(ids)))
    torch.testing.assert_close(e.full_row, R[torch.arange(2), torch.tensor([3, 2])], atol=1e-5, rtol=0)
    last = tiny(text=dict(pool_type="last"))
    assert attnroll.explain(last, {"text": ids}, "rollout").positions == [CTX - 1, CTX - 1]


@pytest.mark.parametrize("method", ROLLOUT_METHODS)
def test_every_rollout_method_on_both_towers(method):
    m, x = tiny(), pair()
    target = {"target": 3} if method in ("grad_rollout", "gae", "attn_gradcam") else {}  # a feature of the embedding
    ev = attnroll.explain(m.visual, x["image"], method, **target)
    assert ev.scores.shape == (2, 16) and torch.isfinite(ev.scores).all()
    tt = {"target": lambda out: out[1].sum(-1)} if target else {}
    et = attnroll.explain(m, {"text": x["text"]}, method, **tt)
    assert et.scores.shape == (2, CTX) and torch.isfinite(et.scores).all()


def test_clip_pairs_and_the_model_left_as_it_was():
    m, x = tiny(), pair()
    before = {n: dict(mod.__dict__) for n, mod in m.named_modules()}
    fast = torch.backends.mha.get_fastpath_enabled()
    e = attnroll.explain(m, x, "clip")
    assert e.scores.shape == (2, 16) and e.extra["text_scores"].shape == (2, CTX)
    assert e.extra["text_positions"] == x["text"].argmax(-1).tolist()

    def sim(out):
        img, txt, scale = out
        return (scale * img @ txt.T).diagonal()

    same = attnroll.explain(m, x, "clip", target=sim)
    torch.testing.assert_close(same.scores, e.scores)
    assert float(e.scores.abs().sum()) > 0 and float(e.extra["text_scores"][0, 7:].abs().sum()) == 0
    assert torch.backends.mha.get_fastpath_enabled() == fast
    after = {n: dict(mod.__dict__) for n, mod in m.named_modules()}
    assert after.keys() == before.keys()
    for n in before:
        assert set(after[n]) == set(before[n]) and all(after[n][k] is before[n][k] for k in ("forward",)
                                                       if k in before[n]), n


def test_a_resnet_tower_is_refused_naming_it():
    m = CLIP(16, CLIPVisionCfg(layers=(1, 1, 1, 1), width=8, image_size=32),
             CLIPTextCfg(context_length=CTX, vocab_size=50, width=32, heads=4, layers=2))
    with pytest.raises(attnroll.UnsupportedModelError, match="vision tower visual of type ModifiedResNet"):
        attnroll.explain(m, pair(), "rollout", stream="text")
