"""``alti_logit`` on heads that pool rows (DINOv2's [CLS ; mean of the patch rows], timm ``global_pool='avg'``
with and without ``fc_norm``, timm's CLS row through ``fc_norm``), against an independent computation that
never reads attnroll: the model's own modules run with forward hooks, and

* each layer's per-token attention updates z_{ij} = Σ_h α^h_ij f^h(x̃_j) by value zeroing: scaling token j's
  value vectors (b_V included) by 1 in one forward and by 0 in another changes only row i's attention output,
  by exactly z_{ij} (the probabilities do not read the values; the layers below are untouched);
* each read row's direction ω_r = ∂y/∂x^L_r by autograd through the model's own head modules with every
  norm's divisor detached (per row before pooling, of the pooled vector after);
* Δ^l_j = Σ_r ω^l_r · z^l_{rj}: ω^l_r = ω_r with mlp="update" (pre-norm: the update reaches the head
  unchanged besides the MLP updates, not attributed); with mlp="linearised" ω_r carried down by
  vector-Jacobian products through each MLP branch above l (the model's modules, norm2's divisor frozen,
  the activation as θ = act(ζ)/ζ at the actual ζ); ALTI's
  pre-norm matrices from the same z (T_i(x_j) = z_ij + δ_ij x_j, y_i = x_i + Attn_i, c_ij = max(0, ‖y_i‖₁ −
  ‖y_i − T_i(x_j)‖₁), rows normalised), score = Σ_l Δ^l C_{l−1} ⋯ C_0.

The reference head is checked against the model's own logits first, so it stands on the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll
from attnroll._checks import UnsupportedModelError

from ..capture.test_layer_anatomy import _pooled
from . import value_aware_reference as R

T = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
F64 = torch.float64
POOLED = ["dinov2", "dinov2_registers", "timm_avg_fc_norm", "timm_avg", "timm_token_fc_norm", "timm_avg_no_prefix"]


def _model(kind: str, dtype=F64):
    """A tiny random float64 model with a pooling head (layer scales, registers; the layer-anatomy tests'
    models) and two images; "timm_avg_no_prefix": no class or register token, the mean of every row."""
    if kind != "timm_avg_no_prefix":
        m, x = _pooled(kind)
        return m.to(dtype), x.to(dtype)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, depth=2, img_size=32,
                          patch_size=16, embed_dim=16, num_heads=2, init_values=0.5, global_pool="avg",
                          class_token=False)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5), dtype=F64)
    return R._randomise(m, 22).to(dtype), x.to(dtype)


def _parts(m):
    """(blocks, the module whose output is token values (and which columns), the attention branch's output
    module per block) of either family, by the model's own attribute names."""
    if hasattr(m, "blocks"):  # timm: qkv's last third are the values; ls1 the layer scale after proj
        return list(m.blocks), [(b.attn.qkv, slice(2 * m.embed_dim, None)) for b in m.blocks], [b.ls1 for b in m.blocks]
    layers = list(m.base_model.encoder.layer)
    return layers, [(lay.attention.v_proj, slice(None)) for lay in layers], [lay.layer_scale1 for lay in layers]


def _run(m, x, at=None, scale=None):
    """One forward with hooks: (block inputs x^l, attention-branch outputs a^l, top stream x^L, logits); with
    ``at`` = l the values of block l are multiplied per token by ``scale`` (B, n)."""
    blocks, values, branch = _parts(m)
    xs, attn, hs = [], [], []
    for l, blk in enumerate(blocks):
        hs.append(blk.register_forward_pre_hook(lambda mod, args: xs.append(args[0].detach())))
        hs.append(branch[l].register_forward_hook(lambda mod, args, out: attn.append(out.detach())))
        if l == at:
            mod, cols = values[l]

            def scaled(mod, args, out, cols=cols):
                out = out.clone()
                out[..., cols] = out[..., cols] * scale.unsqueeze(-1).to(out.dtype)
                return out

            hs.append(mod.register_forward_hook(scaled))
    top = []
    hs.append(blocks[-1].register_forward_hook(
        lambda mod, args, out: top.append((out[0] if isinstance(out, tuple) else out).detach())))
    try:
        with torch.no_grad():
            out = m(x)
    finally:
        for h in hs:
            h.remove()
    return xs, attn, top[0], getattr(out, "logits", out)


def _frozen(norm, v):
    """The model's own LayerNorm with its divisor detached (identity modules pass through)."""
    if not isinstance(norm, torch.nn.LayerNorm):
        return v
    sigma = (v.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt().detach()
    return (v - v.mean(-1, keepdim=True)) / sigma * norm.weight + norm.bias


def _head_logits(m, xL):
    """The model's head on the top stream (B, n, d), every norm's divisor frozen: (B, classes)."""
    if hasattr(m, "blocks"):
        return m.head(_frozen(m.fc_norm, m.pool(_frozen(m.norm, xL))))
    h = _frozen(m.base_model.layernorm, xL)
    start = 1 + int(getattr(m.config, "num_register_tokens", 0) or 0)
    return m.classifier(torch.cat([h[:, 0], h[:, start:].mean(1)], dim=-1))


def _mlp_branch(m, l, u, actual):
    """Block l's MLP branch plus its skip, u + ls2(fc2(θ ⊙ fc1(norm2(u)))), by the model's own modules, with
    norm2's divisor frozen and the activation linearised at the actual stream ``actual``: θ = act(ζ)/ζ."""
    blk = _parts(m)[0][l]
    mlp = blk.mlp
    act = getattr(mlp, "act", None) or mlp.activation_fn
    zeta = mlp.fc1(_frozen(blk.norm2, actual)).detach()
    theta = torch.where(zeta == 0, torch.zeros_like(zeta), act(zeta) / zeta)
    ls2 = blk.ls2 if hasattr(blk, "ls2") else blk.layer_scale2
    return u + ls2(mlp.fc2(theta * mlp.fc1(_frozen(blk.norm2, u))))


def _reference(m, x, classes, mlp="update"):
    """(score (B, n), per-layer Σ_j Δ^l_j (B, L), ω (B, n, d)) by the module docstring's computation; with
    mlp="linearised" each row's direction is carried down through the MLP branches above the layer by
    vector-Jacobian products of :func:`_mlp_branch` (row-wise: each row through its own norm and MLP)."""
    xs, attn, xL, logits = _run(m, x)
    B, n, _ = xL.shape
    v = xL.clone().requires_grad_(True)
    with torch.enable_grad():
        y = _head_logits(m, v)
        torch.testing.assert_close(y.detach(), logits, atol=1e-12, rtol=0)  # the reference head is the model's
        (omega,) = torch.autograd.grad(y[torch.arange(B), classes].sum(), v)
    head_omega = omega
    omegas = [omega] * len(xs)
    if mlp == "linearised":
        for l in reversed(range(len(xs))):
            s_ = xs[l] + attn[l]  # the stream after block l's attention
            u = s_.clone().requires_grad_(True)
            with torch.enable_grad():
                (omega,) = torch.autograd.grad(_mlp_branch(m, l, u, s_), u, grad_outputs=omega)
            omegas[l] = omega
    score, per_layer, below = torch.zeros(B, n, dtype=F64), [], torch.eye(n, dtype=F64).expand(B, n, n)
    for l in range(len(xs)):
        omega = omegas[l]
        base = _run(m, x, at=l, scale=torch.zeros(B, n))[1][l]
        z = torch.stack([_run(m, x, at=l, scale=torch.eye(n)[j].expand(B, n))[1][l] - base for j in range(n)],
                        dim=2)  # (B, i, j, d)
        delta = torch.einsum("bid,bijd->bj", omega, z)
        score += torch.einsum("bj,bjk->bk", delta, below)
        per_layer.append(delta.sum(-1))
        Tz = z + torch.diag_embed(torch.ones(B, n, dtype=F64)).unsqueeze(-1) * xs[l].unsqueeze(1)
        yv = (xs[l] + attn[l]).unsqueeze(2)
        C = (yv.abs().sum(-1) - (yv - Tz).abs().sum(-1)).clamp(min=0)
        C = C / C.sum(-1, keepdim=True)
        below = torch.einsum("bij,bjk->bik", C, below)
    return score, torch.stack(per_layer, 1), head_omega


@pytest.mark.parametrize("kind", POOLED)
@pytest.mark.parametrize("mlp", ["update", "linearised"])
def test_pooled_map_equals_the_hooked_model_computation(kind, mlp):
    m, x = _model(kind)
    e = attnroll.explain(m, x, "alti_logit", target=[2, 1], dtype=F64, mlp=mlp)
    score, per_layer, omega = _reference(m, x, torch.tensor(e.target), mlp)
    torch.testing.assert_close(e.full_row.double(), score, atol=1e-6, rtol=1e-6)  # scores are stored in float32
    torch.testing.assert_close(e.extra["layer_logit"], per_layer, atol=1e-10, rtol=1e-10)
    # the rows the head reads: DINOv2 every row but the registers, timm avg the patches, timm token the CLS row
    want = {"dinov2": [0, 1, 2, 3, 4], "dinov2_registers": [0, 3, 4, 5, 6], "timm_avg_no_prefix": [0, 1, 2, 3],
            "timm_token_fc_norm": [0]}.get(kind, [2, 3, 4, 5])
    assert (omega.abs().sum(-1) > 0).nonzero()[:, 1].tolist() == want * 2


@pytest.mark.parametrize("kind", POOLED)
@pytest.mark.parametrize("mlp", ["update", "linearised"])
def test_pooled_terms_add_up_to_the_models_logit(kind, mlp):
    m, x = _model(kind)
    with torch.no_grad():
        out = m(x)
    logits = getattr(out, "logits", out)
    e = attnroll.explain(m, x, "alti_logit", target=[0, 2], mlp=mlp)
    X = e.extra
    total = X["direct_logit"] + X["embedding_logit"] + X["bias_logit"] + X["mlp_logit"]
    torch.testing.assert_close(total, logits[[0, 1], [0, 2]], atol=1e-12, rtol=0)
    assert e.options["mlp"] == mlp and (float(X["mlp_logit"].abs().min()) > 1e-3) == (mlp == "update")
    np.testing.assert_allclose(e.full_row.double().sum(-1).numpy(), X["direct_logit"].numpy(), rtol=1e-5, atol=1e-6)


def test_pooled_terms_add_up_in_float32():
    m, x = _model("dinov2", torch.float32)
    with torch.no_grad():
        logits = m(x).logits
    X = attnroll.explain(m, x, "alti_logit", target=[1, 1]).extra
    total = X["direct_logit"] + X["embedding_logit"] + X["bias_logit"] + X["mlp_logit"]
    torch.testing.assert_close(total, logits[:, 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["dinov2", "timm_avg_fc_norm"])
def test_pooled_map_is_class_specific_and_linear_in_the_classifier_row(kind):
    """A class whose classifier row (both halves, for DINOv2) is the sum of two others' rows: the scores add."""
    m, x = _model(kind)
    rows = [attnroll.explain(m, x, "alti_logit", target=c).full_row.double() for c in range(3)]
    assert not torch.allclose(rows[0], rows[1], atol=1e-3)
    head = m.head if hasattr(m, "blocks") else m.classifier
    with torch.no_grad():
        head.weight[2] = head.weight[0] + head.weight[1]
    summed = attnroll.explain(m, x, "alti_logit", target=2).full_row.double()
    torch.testing.assert_close(summed, rows[0] + rows[1], atol=1e-6, rtol=1e-6)  # float32 scores


def test_pooled_refusals_name_the_reason():
    from attnroll.methods import alti_logit as A
    from attnroll.capture import model_facts
    import dataclasses

    m, x = _model("timm_avg")
    m.global_pool = "max"  # a maximum over rows is no fixed weighting of them
    with pytest.raises(UnsupportedModelError, match="global_pool='max'"):
        attnroll.explain(m, x, "alti_logit")
    dino, x = _model("dinov2")
    with pytest.raises(ValueError, match="readout"):
        attnroll.explain(dino, x, "alti_logit", readout="mean")
    # no post-LN model the anatomy knows pools rows; the rule refuses one all the same
    bert = R.build("bert")
    anat = dataclasses.replace(model_facts(bert).anatomy, pool=(("mean", 1),))
    ctx = type("Ctx", (), {"model": bert})()
    with pytest.raises(UnsupportedModelError, match="post-LN and its head pools rows"):
        A._rule(ctx, anat, {"pooler": None}, None)
    # a pooled head with fixed row weights would average padded rows: refused rather than answered
    anat = model_facts(dino).anatomy
    states = type("S", (), {"inputs": [torch.zeros(2, 5, 8)]})()
    with pytest.raises(ValueError, match="padded rows"):
        A._read_rows(type("Ctx", (), {"model": dino})(), anat, None, states, torch.tensor([0, 0]),
                     torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), F64)
