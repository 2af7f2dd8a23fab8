"""Sparsification of (fused) attention: discard the smallest entries, keep the top k, or threshold.

Conventions shared by every rule (and by ``rollout``/``attention_flow``, which call these functions):

* Entries in the first ``protect_prefix`` rows or columns (CLS, distillation, register tokens) are never
  zeroed. Padding (``mask`` False) rows and columns are not *eligible*: they are neither counted nor kept.
* Ties are broken deterministically: among equal values the earlier entry in row-major order is dropped
  first (``discard_ratio``) or kept first (``top_k``), so a padded batch gives exactly the result of the
  cropped sequences.
* Afterwards each row is rescaled so that its sum is what it was before (1 for attention probabilities);
  a row whose remaining entries are all zero stays zero.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _checks

SCOPES = ("layer", "row")


def _eligible(A: torch.Tensor, protect_prefix: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Bool (..., n, n): entries a rule may zero (not protected; both tokens valid)."""
    n = A.shape[-1]
    idx = torch.arange(n, device=A.device)
    free = idx >= protect_prefix
    elig = free[:, None] & free[None, :]
    if mask is not None:
        elig = elig & mask[..., :, None] & mask[..., None, :]
    return elig.expand(A.shape)


def _keep_largest(vals: torch.Tensor, count: torch.Tensor, prefer_early: bool) -> torch.Tensor:
    """Bool mask of the ``count`` largest entries along the last axis; among entries equal to the boundary
    value the earliest (``prefer_early``) or the latest are kept. ``count`` (..., 1) may differ between
    slices. Uses a partial selection (topk on the smaller side) rather than a full sort."""
    flat = vals.reshape(-1, vals.shape[-1])
    counts = count.expand(*vals.shape[:-1], 1).reshape(-1)
    out = torch.zeros(flat.shape, dtype=torch.bool, device=vals.device)
    m = flat.shape[-1]
    for c in torch.unique(counts).tolist():
        c = int(c)
        if c <= 0:
            continue
        if c >= m:
            out[counts == c] = True
            continue
        same = counts == c
        sub = flat if bool(same.all()) else flat[same]
        if c <= m // 2:
            boundary = sub.topk(c, dim=-1).values.amin(dim=-1, keepdim=True)  # the c-th largest
        else:
            boundary = sub.topk(m - c + 1, dim=-1, largest=False).values.amax(dim=-1, keepdim=True)
        above = sub > boundary
        tied = sub == boundary
        need = c - above.sum(dim=-1, keepdim=True)
        order = tied.cumsum(dim=-1) if prefer_early else tied.flip(-1).cumsum(dim=-1).flip(-1)
        keep = above | (tied & (order <= need))
        if sub is flat:
            out = keep
        else:
            out[same] = keep
    return out.reshape(vals.shape)


def keep_mask(
    A: torch.Tensor,
    *,
    discard_ratio: float = 0.0,
    discard_scope: str = "layer",
    top_k: int | None = None,
    threshold: float | None = None,
    protect_prefix: int = 1,
    mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Bool (..., n, n) of entries that survive, or None when no rule is active. Tensor-only, no checks."""
    if not discard_ratio and top_k is None and threshold is None:
        return None
    elig = _eligible(A, protect_prefix, mask)
    drop = torch.zeros(A.shape, dtype=torch.bool, device=A.device)
    inf = torch.tensor(float("inf"), dtype=A.dtype, device=A.device)
    # Discarding the k smallest = keeping the (size − k) largest; the ineligible entries are set to +inf so
    # they are among the kept, and ties are dropped earliest-first, i.e. kept latest-first.
    if discard_ratio:
        if discard_scope == "layer":
            flat_elig = elig.flatten(-2)
            vals = torch.where(flat_elig, A.flatten(-2), inf)
            k = torch.floor(flat_elig.sum(-1, keepdim=True) * discard_ratio).long()
            drop |= ~_keep_largest(vals, vals.shape[-1] - k, prefer_early=False).reshape(A.shape)
        else:
            vals = torch.where(elig, A, inf)
            k = torch.floor(elig.sum(-1, keepdim=True) * discard_ratio).long()
            drop |= ~_keep_largest(vals, vals.shape[-1] - k, prefer_early=False)
    if top_k is not None:
        vals = torch.where(elig, A, -inf)
        count = torch.full(A.shape[:-1] + (1,), top_k, dtype=torch.long, device=A.device)
        drop |= ~_keep_largest(vals, count, prefer_early=True)
    if threshold is not None:
        drop |= A < threshold
    return ~(drop & elig)


def restrict(A: torch.Tensor, keep: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
    """Zero the entries not in ``keep`` and rescale each row back to its sum ``before`` (default: its
    current sum). Rows left with nothing stay zero."""
    if before is None:
        before = A.sum(dim=-1, keepdim=True)
    out = torch.where(keep, A, torch.zeros((), dtype=A.dtype, device=A.device))
    after = out.sum(dim=-1, keepdim=True)
    scale = torch.where(after > 0, before / torch.where(after > 0, after, torch.ones_like(after)), after)
    return out * scale


def check_options(
    n: int, discard_ratio: Any, discard_scope: Any, top_k: Any, threshold: Any, protect_prefix: Any
) -> tuple[float, str, int | None, float | None, int]:
    """Validate the sparsification options for n tokens; returns them normalised."""
    discard_ratio = _checks.check_real("discard_ratio", discard_ratio, low=0.0, high=1.0, high_open=True)
    discard_scope = _checks.check_choice("discard_scope", discard_scope, SCOPES)
    if top_k is not None:
        top_k = _checks.check_int("top_k", top_k)
        if not 1 <= top_k <= n:
            raise ValueError(f"top_k must be in [1, n] = [1, {n}] (entries kept per row), got {top_k}")
    if threshold is not None:
        threshold = _checks.check_real("threshold", threshold, low=0.0)
    protect_prefix = _checks.check_int("protect_prefix", protect_prefix)
    if not 0 <= protect_prefix <= n:
        raise ValueError(f"protect_prefix must be in [0, n] = [0, {n}] (leading tokens never zeroed), got "
                         f"{protect_prefix}")
    return discard_ratio, discard_scope, top_k, threshold, protect_prefix


def sparsify(
    A: Any,
    *,
    discard_ratio: float = 0.0,
    discard_scope: str = "layer",
    top_k: int | None = None,
    threshold: float | None = None,
    protect_prefix: int = 1,
) -> Any:
    """Zero small attention entries and renormalise rows (see the module docstring for conventions).

    Args:
        A: (..., n, n) non-negative attention (rows = queries), torch tensor or numpy array.
        discard_ratio: fraction in [0, 1) of the smallest eligible entries to zero: per matrix
            (``discard_scope="layer"``, as vit-explain does but per example) or per row (``"row"``);
            the count is floor(eligible · ratio).
        top_k: keep only the k largest eligible entries of each row (1 <= k <= n).
        threshold: zero eligible entries strictly below this value.
        protect_prefix: the first this many rows and columns are never zeroed.

    Returns:
        (..., n, n), same kind and dtype as ``A``; each row keeps its original sum.
    """
    t, was_numpy = _checks.as_tensor("A", A)
    if t.ndim < 2:
        raise ValueError(f"A must have shape (..., n, n), got {tuple(t.shape)}")
    _checks.check_square("A", t)
    if not t.is_floating_point():
        t = t.to(torch.float32)
    _checks.check_finite_nonnegative("A", t)
    opts = check_options(t.shape[-1], discard_ratio, discard_scope, top_k, threshold, protect_prefix)
    keep = keep_mask(
        t, discard_ratio=opts[0], discard_scope=opts[1], top_k=opts[2], threshold=opts[3], protect_prefix=opts[4]
    )
    out = t if keep is None else restrict(t, keep)
    return out.numpy() if was_numpy else out
