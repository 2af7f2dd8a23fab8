"""ALTI's per-layer contributions (``core.value_aware.alti_matrix``): both kernels (the fused numba one and
the torch one) against a naive numpy loop over (b, i, j) written from the definition, with the norm applied
to each share as the paper writes it (not factored), and against each other; exact zeros where no head
links i to j."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnroll.core import alti_kernel
from attnroll.core.value_aware import Norm, alti_matrix, apply_norm

KERNELS = ["torch", "fused"]


def _need(kernel):
    if kernel == "fused" and not alti_kernel.available():
        pytest.skip("the fused kernel needs numba (the 'fast' extra)")


def _inputs(B, n, H, d, dtype, seed=0, causal=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, H, n, n, generator=g, dtype=torch.float64)
    if causal:
        logits = logits.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    alpha = torch.softmax(logits, -1)
    F = torch.randn(B, n, H, d, generator=g, dtype=torch.float64)
    x = torch.randn(B, n, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (alpha, F, x)]


def _norm(kind, d, dtype):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(5)
    gamma = (torch.rand(d, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    beta = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    return Norm(gamma, None if kind == "rms" else beta, 1e-5, rms=kind == "rms")


def _naive(alpha, F, x, y, norm, actual):
    """c_ij = max(0, ‖y_i‖₁ − ‖y_i − g_i(z_{i←j})‖₁), z_{i←j} = Σ_h α^h_ij F^h_j + δ_ij x_j, by loops."""
    a, F, x, y = (t.double().numpy() for t in (alpha, F, x, y))
    B, n, H, d = F.shape
    C = np.zeros((B, n, n))
    for b in range(B):
        for i in range(n):
            if norm is not None:
                v = actual[b, i].double().numpy()
                sigma = np.sqrt((v ** 2).mean() + norm.eps) if norm.rms else np.sqrt(v.var() + norm.eps)
            for j in range(n):
                z = sum(a[b, h, i, j] * F[b, j, h] for h in range(H)) + (x[b, j] if i == j else 0.0)
                if norm is not None:
                    z = (z if norm.rms else z - z.mean()) / sigma * norm.weight.double().numpy()
                C[b, i, j] = max(0.0, np.abs(y[b, i]).sum() - np.abs(y[b, i] - z).sum())
    return C


def _y(alpha, F, x, norm):
    """The layer output the shares add up to (a constant stands in for b_O), and the norm's actual input."""
    z = torch.einsum("bhij,bjhd->bid", alpha, F) + x + 0.1
    return (z, None) if norm is None else (apply_norm(z, norm), z)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("norm_kind", [None, "layer", "rms"])
@pytest.mark.parametrize("shape", [(2, 5, 3, 6), (1, 6, 8, 4), (2, 3, 5, 7)])  # odd n, H % 4 != 0
def test_alti_matrix_equals_the_naive_loop(kernel, norm_kind, shape):
    _need(kernel)
    alpha, F, x = _inputs(*shape, torch.float64)
    norm = _norm(norm_kind, shape[3], torch.float64)
    y, actual = _y(alpha, F, x, norm)
    C = alti_matrix(alpha, F, x, y, norm=None if norm is None else (norm, actual), chunk=2, kernel=kernel)
    want = _naive(alpha, F, x, y, norm, actual)
    assert (want > 0).mean() > 0.3  # the check sees real contributions, not only the clamp
    np.testing.assert_allclose(C.numpy(), want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("norm_kind", [None, "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_and_torch_kernels_agree(norm_kind, dtype, monkeypatch):
    _need("fused")
    monkeypatch.setattr(alti_kernel, "_THREAD_MIN_WORK", 0)  # split over threads even at this size
    alpha, F, x = _inputs(3, 33, 12, 40, dtype, seed=3)
    norm = _norm(norm_kind, 40, dtype)
    y, actual = _y(alpha, F, x, norm)
    args = dict(norm=None if norm is None else (norm, actual), chunk=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fused = alti_matrix(alpha, F, x, y, kernel="fused", **args)
    finally:
        torch.set_num_threads(before)
    ref = alti_matrix(alpha, F, x, y, kernel="torch", **args)
    assert fused.dtype == ref.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(fused, ref, atol=tol * ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(alti_matrix(alpha, F, x, y, **args), fused, atol=0, rtol=0)  # auto = fused


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_link_gives_an_exact_zero(kernel):
    _need(kernel)
    # sizes where float64 rounding of ‖y_i‖₁ − ‖y_i − 0‖₁ does not always land on 0 or below
    alpha, F, x = _inputs(4, 40, 4, 300, torch.float64, seed=2, causal=True)
    y, _ = _y(alpha, F, x, None)
    C = alti_matrix(alpha, F, x, y, kernel=kernel)
    above = torch.ones(40, 40).triu(1).bool()
    assert torch.all(C[:, above] == 0)
    assert torch.all(C[:, ~above].sum(-1) > 0)


def test_bad_kernel_arguments_are_refused():
    alpha, F, x = _inputs(1, 3, 2, 4, torch.float64)
    with pytest.raises(ValueError, match=r"kernel must be one of \('auto', 'fused', 'torch'\); got 'numpy'"):
        alti_matrix(alpha, F, x, x, kernel="numpy")
    if alti_kernel.available():
        with pytest.raises(ValueError, match="CPU float32 / float64 tensors; got torch.bfloat16"):
            alti_matrix(*(t.bfloat16() for t in (alpha, F, x, x)), kernel="fused")
