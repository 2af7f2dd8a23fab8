"""Residual correction: account for the skip connection around each attention block.

All three modes in use in the literature are written as one affine form per row i,

    Ã[i] = d_i · (a · A[i] + c · e_i),

with a the weight on attention, c the weight on the identity and d_i an optional row scale:

========  ===========  =========  ===================================  ==========================
mode      a            c          d_i                                  where it comes from
========  ===========  =========  ===================================  ==========================
blend     1 − α        α          1                                    Abnar & Zuidema (paper)
renorm    1 − α        α          1 / ((1 − α)·Σ_j A[i, j] + α)        Abnar's code, Chefer CVPR
add       1            α / (1−α)  1                                    Chefer ICCV (I + A at α=½)
========  ===========  =========  ===================================  ==========================

``rollout`` uses these coefficients directly (it never materialises Ã on its fast paths); ``add_residual``
builds Ã explicitly.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _checks

MODES = ("blend", "renorm", "add")


def residual_coefficients(alpha: Any, mode: Any) -> tuple[float, float]:
    """Validate (alpha, mode) and return (a, c): the weights on attention and on the identity."""
    mode = _checks.check_choice("residual_mode", mode, MODES)
    alpha = _checks.check_real("alpha", alpha, low=0.0, high=1.0)
    if mode == "add":
        if alpha >= 1.0:
            raise ValueError(
                "alpha must be < 1 with residual_mode='add' (the identity weight α/(1−α) is infinite at α=1); "
                f"got {alpha}. Use residual_mode='blend' for α=1."
            )
        return 1.0, alpha / (1.0 - alpha)
    return 1.0 - alpha, alpha


def row_totals(A: torch.Tensor, a: float, c: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Row sums of a·A + c·I (identity on valid tokens only), shape (..., n): the renorm mode's divisor."""
    total = a * A.sum(dim=-1)
    return total + (c if mask is None else c * mask.to(A.dtype))


def divide_rows(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Each row of x (..., n, m) divided by ``total`` (..., n); a zero total (padding) gives a zero row.

    Division, not multiplication by 1/total, keeps tiny alphas exact (1/5e-324 overflows)."""
    safe = torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    return torch.where((total > 0).unsqueeze(-1), x / safe, torch.zeros((), dtype=x.dtype, device=x.device))


def apply_residual(
    A: torch.Tensor, a: float, c: float, renorm: bool, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Tensor-only Ã for (..., n, n) ``A``; ``mask`` (..., n) bool puts the identity on valid tokens only."""
    n = A.shape[-1]
    eye = torch.eye(n, dtype=A.dtype, device=A.device)
    ident = eye if mask is None else torch.diag_embed(mask.to(A.dtype))
    out = a * A + c * ident
    if renorm:
        out = divide_rows(out, row_totals(A, a, c, mask))
    return out


def add_residual(A: Any, alpha: float = 0.5, mode: str = "blend") -> Any:
    """Add the residual (skip) connection to fused attention.

    Args:
        A: (..., n, n) attention matrices (rows = queries), torch tensor or numpy array, non-negative.
        alpha: weight of the identity, in [0, 1]. 0.5 gives the paper's 0.5·(A + I).
        mode: "blend": (1 − α)·A + α·I, rows stay stochastic if A's are;
            "renorm": ((1 − α)·A + α·I) divided by its row sums — the reference code's (A + I)/rowsum at α=½;
            equals blend when A is row-stochastic, differs after max/min fusion or sparsification;
            "add": A + α/(1−α)·I, unnormalised — Chefer's I + A at α=½ (α must be < 1).

    Returns:
        (..., n, n), the same kind and floating dtype as ``A``.
    """
    t, was_numpy = _checks.as_tensor("A", A)
    if t.ndim < 2:
        raise ValueError(f"A must have shape (..., n, n), got {tuple(t.shape)}")
    _checks.check_square("A", t)
    if not t.is_floating_point():
        t = t.to(torch.float32)
    _checks.check_finite_nonnegative("A", t)
    a, c = residual_coefficients(alpha, mode)
    out = apply_residual(t, a, c, mode == "renorm")
    return out.numpy() if was_numpy else out
