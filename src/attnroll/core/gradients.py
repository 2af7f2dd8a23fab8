"""Gradient-weighted attention: the per-layer mixing matrices of the gradient methods, and Chefer's update.

- :func:`gradient_weighted`: Ā_l = mean_h((dy/dA_l ⊙ A_l)^+) (Chefer, Gur & Wolf 2021: the positive part per
  head, then the mean), or (mean_h(dy/dA_l ⊙ A_l))^+ with ``clamp="after_mean"`` (vit-explain's order).
- :func:`gae_update`: one layer of Chefer's rule 6, R ← R + Ā·R; from R = I over layers 1..L it gives
  (I + Ā_L)···(I + Ā_1), which is ``rollout(..., residual_mode="add", alpha=0.5, check_stochastic=False)``.

Torch tensors or numpy arrays in, the same kind out; no model, no I/O.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import _checks

__all__ = ["CLAMPS", "gradient_weighted", "gae_update"]

#: Where the positive part is taken: per head before the mean, or after it.
CLAMPS = ("per_head", "after_mean")


def gradient_weighted(attentions: Sequence[Any], grads: Sequence[Any], clamp: str = "per_head",
                      dtype: torch.dtype | None = torch.float32) -> list[Any]:
    """Per layer, the gradient-weighted head-fused attention.

    Args:
        attentions: L arrays (B, H, n, n) (or (H, n, n)), the attention probabilities A_l.
        grads: L arrays of the same shapes, dy/dA_l.
        clamp: "per_head" = mean_h((g ⊙ A)^+) (Chefer); "after_mean" = (mean_h(g ⊙ A))^+ (vit-explain).
        dtype: the dtype the products are computed in (float32 by default; None keeps the input's).

    Returns:
        L arrays (B, n, n) (or (n, n)), non-negative, the same kind (torch / numpy) as the inputs.
    """
    _checks.check_choice("clamp", clamp, CLAMPS)
    if len(attentions) != len(grads):
        raise ValueError(f"grads must have one entry per layer of attentions ({len(attentions)}), got {len(grads)}")
    out = []
    for i, (a, g) in enumerate(zip(attentions, grads)):
        ta, numpy_in = _checks.as_tensor(f"attentions[{i}]", a)
        tg, _ = _checks.as_tensor(f"grads[{i}]", g)
        if ta.shape != tg.shape or ta.ndim < 3:
            raise ValueError(f"attentions[{i}] and grads[{i}] must have the same shape (..., H, n, n), got "
                             f"{tuple(ta.shape)} and {tuple(tg.shape)}")
        prod = tg.to(dtype) * ta.to(dtype) if dtype is not None else tg * ta
        w = prod.clamp(min=0).mean(dim=-3) if clamp == "per_head" else prod.mean(dim=-3).clamp(min=0)
        out.append(w.numpy() if numpy_in else w)
    return out


def gae_update(R: Any, A: Any) -> Any:
    """Chefer's rule 6 for one layer: R + A·R, with R (..., n, m) the relevance so far and A (..., n, n) the
    layer's gradient-weighted attention. Same kind (torch / numpy) as ``R``."""
    tR, numpy_in = _checks.as_tensor("R", R)
    tA, _ = _checks.as_tensor("A", A)
    if tA.shape[-1] != tA.shape[-2] or tA.shape[-1] != tR.shape[-2]:
        raise ValueError(f"A must be (..., n, n) with n = R's rows ({tR.shape[-2]}), got shape {tuple(tA.shape)}")
    out = tR + tA.to(tR.dtype) @ tR
    return out.numpy() if numpy_in else out
