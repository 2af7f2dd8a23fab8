"""timm CaiT: talking-heads self-attention and class attention in one [CLS + patches] token space.

Compared against the softmax recomputed here from each block's own projections (talking heads: proj_l
before the softmax, proj_w after it), the block's own output (A·v), gradients taken by hand through the
model's tensors, and hand-composed class-attention rows."""

import pytest
import torch

import attnroll

timm = pytest.importorskip("timm")

X = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
DEPTH = 2


def cait(**kw):
    torch.manual_seed(0)
    cfg = dict(pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=DEPTH, num_heads=2,
               depth_token_only=2, num_classes=3)
    return timm.create_model("cait_xxs24_224", **{**cfg, **kw}).eval()


def _seen(model, x):
    """Per attention module: its input, its attn_drop output and its proj input (one plain forward)."""
    seen, hooks = {}, []
    mods = [m for m in model.modules() if type(m).__name__ in ("TalkingHeadAttn", "ClassAttn")]
    for i, m in enumerate(mods):
        def pre(mod, a, i=i):
            seen.setdefault(i, {})["x"] = a[0].detach()

        def drop(mod, a, o, i=i):
            seen[i]["attn"] = o.detach()

        def proj(mod, a, i=i):
            seen[i]["out"] = a[0].detach()

        hooks += [m.register_forward_pre_hook(pre), m.attn_drop.register_forward_hook(drop),
                  m.proj.register_forward_pre_hook(proj)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return mods, seen


def naive_talking_heads(m, x):
    B, N, C = x.shape
    qkv = m.qkv(x).reshape(B, N, 3, m.num_heads, -1).permute(2, 0, 3, 1, 4)
    logits = (qkv[0] * m.scale) @ qkv[1].transpose(-2, -1)  # (B, H, N, N)
    mixed = torch.einsum("gh,bhij->bgij", m.proj_l.weight, logits) + m.proj_l.bias[None, :, None, None]
    p = mixed.softmax(-1)
    return torch.einsum("gh,bhij->bgij", m.proj_w.weight, p) + m.proj_w.bias[None, :, None, None], qkv[2]


def naive_class_attention(m, u):
    B, N, C = u.shape
    q = m.q(u[:, :1]).reshape(B, 1, m.num_heads, -1).transpose(1, 2)
    k = m.k(u).reshape(B, N, m.num_heads, -1).transpose(1, 2)
    return ((q * m.scale) @ k.transpose(-2, -1)).softmax(-1)  # (B, H, 1, N)


def test_captured_layers_equal_the_blocks_recomputed_from_their_projections():
    model = cait()
    rec = attnroll.capture(model, X)
    mods, seen = _seen(model, X)
    n = 1 + 16
    assert [tuple(t.shape) for t in rec.attentions] == [(2, 2, n, n)] * 4
    assert rec.info["self"].prefix == 1 and rec.info["self"].grid == (4, 4)
    eye = torch.eye(n)
    with torch.no_grad():
        for i, m in enumerate(mods):
            A = rec.attentions[i]
            if i < DEPTH:  # talking heads over the patches: what multiplies v, after the head mixing
                want, v = naive_talking_heads(m, seen[i]["x"])
                assert torch.allclose(A[:, :, 1:, 1:], want, atol=1e-5)
                assert torch.allclose(A[:, :, 0], eye[0].expand(2, 2, n))  # no class token in these blocks
                assert bool((A[:, :, 1:, 0] == 0).all())
            else:  # class attention: the CLS row as the block computes it; the patches pass unchanged
                want = naive_class_attention(m, seen[i]["x"])
                assert torch.allclose(A[:, :, :1], want, atol=1e-5)
                assert torch.allclose(A[:, :, 1:], eye[1:].expand(2, 2, n - 1, n))
                v = m.v(seen[i]["x"]).reshape(2, n, m.num_heads, -1).transpose(1, 2)
            # and the block really uses it: (A · v) is what its output projection receives
            a = A[:, :, 1:, 1:] if i < DEPTH else A[:, :, :1]
            mixed = (a @ v).transpose(1, 2).reshape(2, a.shape[-2], -1)
            assert torch.allclose(mixed, seen[i]["out"], atol=1e-5)


def test_talking_heads_layers_are_flagged_and_rollout_refuses_them_with_the_reason():
    model = cait()
    rec = attnroll.capture(model, X)
    info = rec.info["self"]
    assert info.nonstochastic == (0, 1) and "talking-heads" in info.stochastic_reason
    with pytest.raises(ValueError, match="talking-heads.*start_layer=2"):
        attnroll.explain(model, X, method="rollout")
    with pytest.raises(ValueError, match="talking-heads"):
        attnroll.explain(model, X, method="flow")


def test_rollout_of_the_class_attention_layers_composes_them_as_the_final_layers_of_the_cls_readout():
    model = cait()
    rec = attnroll.capture(model, X)
    e = attnroll.explain(model, X, method="rollout", start_layer=DEPTH)
    assert e.readout["kind"] == "cls"
    a1 = rec.attentions[DEPTH][:, :, 0].mean(1)  # (B, 1+N): the first class-attention block's CLS row
    a2 = rec.attentions[DEPTH + 1][:, :, 0].mean(1)
    e0 = torch.zeros_like(a1)
    e0[:, 0] = 1
    # CLS row of Ã2·Ã1 with Ã = ½(A + I); the patch rows of both are the identity, so only the class
    # token's own share goes through the first block again.
    first = 0.5 * a1 + 0.5 * e0
    r = 0.5 * (a2[:, :1] * first + torch.cat([torch.zeros_like(a2[:, :1]), a2[:, 1:]], dim=1)) + 0.5 * first
    assert torch.allclose(e.full_row, r, atol=1e-6)


def test_with_stochastic_head_mixing_rollout_runs_over_all_layers_and_equals_the_naive_product():
    model = cait()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "TalkingHeadAttn":  # mixing after the softmax that keeps rows stochastic
                m.proj_w.weight.copy_(torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
                m.proj_w.bias.zero_()
    rec = attnroll.capture(model, X)
    assert rec.info["self"].nonstochastic == ()
    e = attnroll.explain(model, X, method="rollout")
    R = None
    for A in rec.attentions:
        At = 0.5 * A.mean(1) + 0.5 * torch.eye(A.shape[-1])
        R = At if R is None else At @ R
    assert torch.allclose(e.full_row, R[:, 0], atol=1e-6)


def test_gradients_are_the_models_own_lifted_into_the_token_space():
    model = cait()
    kept = []
    hooks = [m.attn_drop.register_forward_hook(lambda mod, a, o: kept.append(o))
             for m in model.modules() if type(m).__name__ in ("TalkingHeadAttn", "ClassAttn")]
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    y = model(X)[:, 1].sum()
    own = torch.autograd.grad(y, kept)
    for h in hooks:
        h.remove()
    rec = attnroll.capture(model, X, keep_grad=True)
    rec.outputs[:, 1].sum().backward()
    grads = rec.gradients()
    for i, g in enumerate(grads):
        if i < DEPTH:
            assert torch.allclose(g[:, :, 1:, 1:], own[i], atol=1e-6) and bool((g[:, :, 0] == 0).all())
        else:
            assert torch.allclose(g[:, :, :1], own[i], atol=1e-6) and bool((g[:, :, 1:] == 0).all())


@pytest.mark.parametrize("method", ["grad_rollout", "gae", "raw"])
def test_a_batch_equals_its_examples(method):
    model = cait()
    both = attnroll.explain(model, X, method=method, target=2)
    for b in range(2):
        one = attnroll.explain(model, X[b:b + 1], method=method, target=2)
        assert torch.allclose(both.full_row[b], one.full_row[0], atol=1e-5)


def test_raw_reads_the_last_class_attention_row_and_avg_pooling_reads_the_patches():
    model = cait()
    rec = attnroll.capture(model, X)
    e = attnroll.explain(model, X, method="raw")
    assert torch.allclose(e.full_row, rec.attentions[-1][:, :, 0].mean(1), atol=1e-6)
    avg = cait(global_pool="avg")
    assert attnroll.capture(avg, X).info["self"].readout.kind == "mean"


def test_the_models_state_is_unchanged():
    model = cait()
    model.train()
    before = ([getattr(m, "fused_attn", None) for m in model.modules()], [m.training for m in model.modules()],
              [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
              [p.requires_grad for p in model.parameters()])
    for method in ("grad_rollout", "raw"):
        attnroll.explain(model, X, method=method)
    after = ([getattr(m, "fused_attn", None) for m in model.modules()], [m.training for m in model.modules()],
             [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
             [p.requires_grad for p in model.parameters()])
    assert after == before
