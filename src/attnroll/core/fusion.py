"""Head fusion: (..., H, n, n) attention -> one (..., n, n) matrix per layer."""

from __future__ import annotations

from typing import Any

import torch

from .. import _checks

HOW = ("mean", "max", "min")


def head_weights(how: Any, num_heads: int, *, like: torch.Tensor) -> torch.Tensor | None:
    """Validate ``how``; for a weight vector return it normalised to sum 1 (shape (H,), on ``like``'s
    device and floating dtype), else None."""
    how = _checks.check_head_fusion("head_fusion", how, allow_none=False, num_heads=num_heads)
    if isinstance(how, str):
        return None
    return how.to(device=like.device, dtype=like.dtype if like.is_floating_point() else torch.float32)


def fuse_tensor(attn: torch.Tensor, how: Any) -> torch.Tensor:
    """Tensor-only fusion over axis -3; no validation of the entries (callers validate)."""
    w = head_weights(how, attn.shape[-3], like=attn)
    if w is not None:
        return torch.einsum("...hij,h->...ij", attn, w)
    if how == "mean":
        return attn.mean(dim=-3)
    if how == "max":
        return attn.amax(dim=-3)
    return attn.amin(dim=-3)


def fuse_heads(attn: Any, how: Any = "mean") -> Any:
    """Fuse the heads of attention maps.

    Args:
        attn: (..., H, n, n) attention, torch tensor or numpy array; rows are queries.
        how: "mean" (default), "max", "min", or a length-H vector of non-negative head weights (normalised
            to sum 1 before use).

    Raises:
        ValueError: NaN or infinite entries (signed values are fused as given).

    Returns:
        (..., n, n), the same kind (torch / numpy) and floating dtype as the input. Mean and weighted fusion
        of row-stochastic heads stay row-stochastic; max and min fusion do not.
    """
    t, was_numpy = _checks.as_tensor("attn", attn)
    if t.ndim < 3:
        raise ValueError(f"attn must have shape (..., H, n, n) with at least 3 axes, got {tuple(t.shape)}")
    _checks.check_square("attn", t)
    if not t.is_floating_point():
        t = t.to(torch.float32)
    _checks.check_finite("attn", t)
    out = fuse_tensor(t, how)
    return out.numpy() if was_numpy else out
