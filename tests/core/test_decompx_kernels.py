"""DecompX's folded share kernels (norm folded into the next linear map, the MLP's biases carried past the
activation as rank-one terms) against a naive loop over rows and share slots written here from the
definitions: the norm share g(s) = (s − mean s) / σ_actual ⊙ γ, AbsDot |b · s_k| / Σ_k' |b · s_k'| (all of b
to the bias slot when every dot is 0), θ = act(ζ) / ζ with ζ the actual pre-activation. float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnroll.core.decompx import block_shares, mlp_shares, norm_linear_shares, norm_shares
from attnroll.core.value_aware import Block, Mlp, Norm

from ..methods.value_aware_reference import absdot_split

B, R, K, D, F = 2, 3, 5, 6, 10


def _t(rng, *shape):
    return torch.tensor(rng.standard_normal(shape))


def _norm(rng, kind):
    if kind == "ln":
        return Norm(_t(rng, D), _t(rng, D), 1e-5)
    if kind == "ln_bare":
        return Norm(None, None, 1e-5)
    return Norm(_t(rng, D), None, 1e-6, rms=True)


def _mlp(rng, gated, biases):
    b = (lambda n: _t(rng, n)) if biases else (lambda n: None)
    return Mlp(_t(rng, F, D), b(F), _t(rng, D, F), b(D), torch.nn.functional.gelu,
               wg=_t(rng, F, D) if gated else None, bg=b(F) if gated else None)


def _naive_norm(Si, norm, mode):
    actual = Si.sum(0)
    var = np.mean(actual ** 2) if norm.rms else np.var(actual)
    out = []
    for s in Si:
        g = (s if norm.rms else s - s.mean()) / math.sqrt(var + norm.eps)
        out.append(g if norm.weight is None else g * norm.weight.numpy())
    return absdot_split(np.stack(out), None if norm.bias is None else norm.bias.numpy(), mode)


def _naive_mlp(Ui, mlp, mode):
    w1, w2 = mlp.w1.numpy(), mlp.w2.numpy()
    np_ = lambda t: None if t is None else t.numpy()  # noqa: E731
    Z = absdot_split(np.stack([w1 @ u for u in Ui]), np_(mlp.b1), mode)
    if mlp.wg is not None:
        g = mlp.wg.numpy() @ Ui.sum(0) + (0 if mlp.bg is None else mlp.bg.numpy())
        coef = mlp.act(torch.tensor(g)).numpy()
    else:
        zeta = Z.sum(0)
        coef = mlp.act(torch.tensor(zeta)).numpy() / zeta
    return absdot_split(np.stack([w2 @ (coef * z) for z in Z]), np_(mlp.b2), mode)


def _shares(rng, zero_row=False):
    U = _t(rng, B, R, K, D)
    U[..., -1, :] = 0.3 * U[..., -1, :]  # the bias slot holds something too, as after a block
    if zero_row:  # one row whose token slots are all 0: every bias goes to the bias slot
        U[1, 2, :-1] = 0
    return U


@pytest.mark.parametrize("mode", ["absdot", "separate"])
@pytest.mark.parametrize("kind", ["ln", "ln_bare", "rms"])
def test_norm_linear_shares_equals_the_normalised_shares_times_w(kind, mode):
    rng = np.random.default_rng(0)
    norm, U, w = _norm(rng, kind), _shares(rng, zero_row=True), _t(rng, 7, D)
    got = norm_linear_shares(U, norm, w, mode)
    assert got.shape == (B, R, K, 7)
    for b in range(B):
        for r in range(R):
            want = _naive_norm(U[b, r].numpy(), norm, mode) @ w.numpy().T
            np.testing.assert_allclose(got[b, r].numpy(), want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", ["absdot", "separate"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("biases", [True, False])
@pytest.mark.parametrize("kind", [None, "ln", "rms"])
def test_mlp_shares_with_and_without_a_folded_norm_equal_the_naive_loop(kind, biases, gated, mode):
    rng = np.random.default_rng(1)
    norm = None if kind is None else _norm(rng, kind)
    mlp, U = _mlp(rng, gated, biases), _shares(rng, zero_row=True)
    got = mlp_shares(U, mlp, mode, norm=norm)
    for b in range(B):
        for r in range(R):
            Ui = U[b, r].numpy()
            Ui = Ui if norm is None else _naive_norm(Ui, norm, mode)
            np.testing.assert_allclose(got[b, r].numpy(), _naive_mlp(Ui, mlp, mode), atol=1e-10, rtol=0)
    # the shares add up to the MLP of the actual (normalised) vector
    actual = U.sum(-2)
    h = actual if norm is None else norm_shares(U, norm, mode).sum(-2)
    pre = h @ mlp.w1.T + (0 if mlp.b1 is None else mlp.b1)
    if gated:
        pre = pre * mlp.act(h @ mlp.wg.T + (0 if mlp.bg is None else mlp.bg))
    else:
        pre = mlp.act(pre)
    want = pre @ mlp.w2.T + (0 if mlp.b2 is None else mlp.b2)
    torch.testing.assert_close(got.sum(-2), want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("pre_norm", [True, False])
def test_block_shares_chunked_rows_and_subset_equal_the_whole_block(pre_norm):
    # the attention takes f / d times the MLP's chunk of rows: every chunking and row subset gives the same shares
    rng = np.random.default_rng(2)
    H, dh, n = 2, 3, 7
    blk = Block(pre_norm, _norm(rng, "ln"), _norm(rng, "ln"), _t(rng, H * dh, D), _t(rng, H * dh), _t(rng, D, H * dh),
                _t(rng, D), H, H, _mlp(rng, False, True))
    S = _t(rng, B, n, n + 1, D)
    alpha = torch.softmax(_t(rng, B, H, n, n), -1)
    whole = block_shares(S, alpha, blk)
    for chunk in (1, 2, 3):
        torch.testing.assert_close(block_shares(S, alpha, blk, chunk=chunk), whole, atol=1e-12, rtol=0)
    rows = torch.tensor([5, 0, 3])
    torch.testing.assert_close(block_shares(S, alpha, blk, rows=rows, chunk=1), whole[:, rows], atol=1e-12, rtol=0)
