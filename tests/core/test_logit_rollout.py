"""core.logit_rollout against naive products and the linear-head identity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnroll.core.logit_rollout import (direct_logit, head_direction, head_linear, layer_directions, logit_rollout,
                                         pooled_head_linear)
from attnroll.core.value_aware import Block, Mlp, Norm, apply_norm


def test_logit_rollout_is_the_sum_of_rows_times_the_products_below():
    g = torch.Generator().manual_seed(0)
    L, B, n = 4, 2, 5
    deltas = [torch.randn(B, n, generator=g, dtype=torch.float64) for _ in range(L)]
    mixing = [torch.rand(B, n, n, generator=g, dtype=torch.float64) for _ in range(L)]
    got = logit_rollout(deltas, mixing).numpy()
    for b in range(B):
        want, below = np.zeros(n), np.eye(n)
        for l in range(L):
            want += deltas[l][b].numpy() @ below
            below = mixing[l][b].numpy() @ below
        np.testing.assert_allclose(got[b], want, rtol=1e-12)
    with pytest.raises(ValueError, match="one entry per layer"):
        logit_rollout(deltas, mixing[:2])


@pytest.mark.parametrize("rms", [False, True])
def test_head_direction_reproduces_the_linearised_norm_and_classifier(rms):
    g = torch.Generator().manual_seed(1)
    d = 6
    norm = Norm(1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64),
                None if rms else torch.randn(d, generator=g, dtype=torch.float64), 1e-6, rms)
    actual, w = torch.randn(3, d, generator=g, dtype=torch.float64), torch.randn(3, d, generator=g, dtype=torch.float64)
    parts = torch.randn(4, 3, d, generator=g, dtype=torch.float64)
    parts[-1] = actual - parts[:-1].sum(0)  # shares of the actual vector
    omega = head_direction(w, norm, actual)
    beta = 0 if norm.bias is None else norm.bias
    # the shares' projections add up to the head applied to the actual vector (β's projection apart)
    torch.testing.assert_close((parts * omega).sum(-1).sum(0),
                               ((apply_norm(actual, norm) - beta) * w).sum(-1))
    torch.testing.assert_close(head_direction(w, None, actual), w)


# ------------------------------------------------------------------------------------------- post-LN
def _rand(g, *shape, scale=0.5):
    return scale * torch.randn(*shape, generator=g, dtype=torch.float64)


def _post_ln_block(g, d, f, gated):
    def norm():
        return Norm(1 + _rand(g, d, scale=0.3), _rand(g, d), 1e-6)
    mlp = Mlp(_rand(g, f, d), _rand(g, f), _rand(g, d, f), _rand(g, d), torch.nn.functional.gelu,
              _rand(g, f, d) if gated else None, _rand(g, f) if gated else None)
    return Block(False, norm(), norm(), _rand(g, d, d), _rand(g, d), _rand(g, d, d), _rand(g, d), 2, 2, mlp)


def _frozen(v, norm, actual):
    """The norm with its σ frozen at the actual vector (the test's own, not core's)."""
    sigma = actual.var(-1, unbiased=False, keepdim=True).add(norm.eps).sqrt()
    return (v - v.mean(-1, keepdim=True)) / sigma * norm.weight + norm.bias


@pytest.mark.parametrize("rule", ["linearised", "update"])
@pytest.mark.parametrize("gated", [False, True])
def test_layer_directions_are_the_gradients_of_the_frozen_stack(rule, gated):
    """A stack whose stream before block l is a^l = x^l + u_l + b_O^l (x^0 the embedding, u_l an attention
    update): ω^l = ∂y/∂a^l by autograd with σ, the activation slopes (or the gate) and, for "update", the
    MLP outputs held at their actual values; ω^0 · x^0 + Σ_l ω^l · u_l + the bias terms (b_O's included) +
    the MLP terms + the head's constant = the logit of the actual (unfrozen) stack."""
    g = torch.Generator().manual_seed(3)
    B, d, f, L = 3, 6, 9, 3
    blocks = [_post_ln_block(g, d, f, gated) for _ in range(L)]
    Wp, bp, Wc, bc = _rand(g, d, d), _rand(g, d), _rand(g, 2, d), _rand(g, 2)
    cls = torch.tensor([0, 1, 1])
    x0 = _rand(g, B, d, scale=1.0)
    updates = [_rand(g, B, d, scale=1.0) for _ in range(L)]

    def stack(frozen):
        """(logit (B,), the streams a^l) of the actual stack (frozen=None) or the frozen one at ``frozen``."""
        x, streams, seen = (x0 if frozen is None else x0.clone().requires_grad_(True)), [], []
        for l, blk in enumerate(blocks):
            m = blk.mlp
            a = x + updates[l] + blk.bo
            if frozen is not None:
                a.retain_grad()
            streams.append(a)
            n1 = a if frozen is None else frozen[l][0]
            h = apply_norm(a, blk.norm1) if frozen is None else _frozen(a, blk.norm1, n1)
            z = h @ m.w1.T + m.b1
            if frozen is None:
                out = (m.act(z) if m.wg is None else m.act(h @ m.wg.T + m.bg) * z) @ m.w2.T + m.b2
            elif rule == "linearised":
                out = (frozen[l][2] * z) @ m.w2.T + m.b2
            else:
                out = frozen[l][3]
            seen.append((a.detach(), h + out, None, out))
            x = apply_norm(h + out, blk.norm2) if frozen is None else _frozen(h + out, blk.norm2, frozen[l][1])
        zp = x @ Wp.T + bp
        pooled = torch.tanh(zp) if frozen is None else torch.tanh(zp.detach()) / zp.detach() * zp
        return (pooled * Wc[cls]).sum(-1) + bc[cls], streams, seen, x

    y, _, seen, top = stack(None)
    coefs = []
    for (n1, _, _, _), blk in zip(seen, blocks):  # the actual slopes (or gates) of each MLP
        m, h = blk.mlp, apply_norm(n1, blk.norm1)
        za = h @ m.w1.T + m.b1
        coefs.append(m.act(za) / za if m.wg is None else m.act(h @ m.wg.T + m.bg))
    frozen = [(n1, n2, c, out) for (n1, n2, _, out), c in zip(seen, coefs)]
    with torch.enable_grad():
        yf, streams, _, _ = stack(frozen)
        yf.sum().backward()
    torch.testing.assert_close(yf.detach(), y, rtol=1e-10, atol=1e-10)  # frozen = actual at the actual point
    omega, const = head_linear(Wc[cls], bc[cls], final_norm=None, pooler=(Wp, bp, torch.tanh), actual=top)
    dirs, bias, mlp_terms = layer_directions(omega, blocks, [s[0] for s in seen], [s[1] for s in seen], mlp=rule)
    for l in range(L):
        torch.testing.assert_close(dirs[l], streams[l].grad, rtol=1e-10, atol=1e-12)
    total = (dirs[0] * x0).sum(-1) + sum((dirs[l] * updates[l]).sum(-1) for l in range(L))
    torch.testing.assert_close(total + bias.sum(-1) + mlp_terms.sum(-1) + const, y, rtol=1e-10, atol=1e-10)
    assert bool((mlp_terms == 0).all()) if rule == "linearised" else bool((mlp_terms.abs() > 1e-6).all())
    with pytest.raises(ValueError, match="mlp must be one of"):
        layer_directions(omega, blocks, [s[0] for s in seen], [s[1] for s in seen], mlp="bypass")


# ------------------------------------------------------------------------------------------- pooled heads
@pytest.mark.parametrize("layout", ["cls_and_mean", "mean_then_fc_norm", "norm_then_mean"])
def test_pooled_head_linear_is_the_gradient_of_the_frozen_pooled_head(layout):
    """y = Σ_r ω_r · x_r + c at the actual rows, ω_r = ∂y/∂x_r by autograd through the pooled head written
    here with every divisor frozen (each row's own before pooling, the pooled vector's after): DINOv2's
    [row 0 ; mean of rows 2..] (a register at row 1), timm's mean of rows 1.. then fc_norm, or norm then mean."""
    g = torch.Generator().manual_seed(3)
    B, n, d = 2, 5, 4
    x = _rand(g, B, n, d, scale=1.0)
    norm = Norm(1 + _rand(g, d, scale=0.3), _rand(g, d), 1e-6)
    parts = 2 if layout == "cls_and_mean" else 1
    w, b = _rand(g, B, parts * d), _rand(g, B)
    start = 2 if layout == "cls_and_mean" else 1
    mean = torch.zeros(B, n, dtype=torch.float64)
    mean[:, start:] = 1 / (n - start)
    pools = [torch.eye(n, dtype=torch.float64)[0].expand(B, n), mean] if parts == 2 else [mean]
    token_norm, final_norm = (None, norm) if layout == "mean_then_fc_norm" else (norm, None)
    omega, c = pooled_head_linear(w, b, pools=pools, token_norm=token_norm, final_norm=final_norm, pooler=None,
                                  actual=x)

    def head(v):
        h = v if token_norm is None else _frozen(v, norm, x)
        pooled = torch.cat([h[:, 0], h[:, start:].mean(1)], -1) if parts == 2 else h[:, start:].mean(1)
        if final_norm is not None:
            pooled = _frozen(pooled, norm, x[:, start:].mean(1))
        return (w * pooled).sum(-1) + b

    v = x.clone().requires_grad_(True)
    y = head(v)
    (grad,) = torch.autograd.grad(y.sum(), v)
    torch.testing.assert_close(omega, grad, atol=1e-12, rtol=0)
    torch.testing.assert_close((omega * x).sum((1, 2)) + c, y.detach(), atol=1e-12, rtol=0)
    assert bool((omega[:, 1:start] == 0).all())  # rows no part reads have no direction


def test_direct_logit_sums_the_read_rows_updates():
    g = torch.Generator().manual_seed(4)
    B, H, R, n, d = 2, 3, 2, 5, 4
    alpha, F, omega = _rand(g, B, H, R, n), _rand(g, B, n, H, d), _rand(g, B, R, d)
    want = torch.zeros(B, n, dtype=torch.float64)
    for r in range(R):
        for h in range(H):
            want += alpha[:, h, r] * (F[:, :, h] * omega[:, r, None]).sum(-1)
    torch.testing.assert_close(direct_logit(alpha, F, omega), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(direct_logit(alpha[:, :, 0], F, omega[:, 0]),  # one readout row
                               direct_logit(alpha[:, :, :1], F, omega[:, :1]), atol=1e-12, rtol=0)
