"""Token mixers other than softmax attention as mixing matrices: what each layer's output takes from each
token's value-like input, with the data-dependent gates held at the values the forward pass gave them.

Each mixer is linear in its value-like input once its gates are held, so its map is exact, one (n, n) matrix per
head or channel (the layer's Jacobian with those gates detached):

- Mamba-2 / SSD (Dao & Gu, ICML 2024), per head h: ``M_h = L_h ∘ (C Bᵀ) · diag(Δ) + D_h I`` with
  ``L_h[t, s] = exp(Σ_{k=s+1..t} Δ_k A_h)`` for s ≤ t (:func:`ssd_matrix`);
- Mamba's selective SSM (Gu & Dao 2023; the hidden-attention reading of Ali, Zimerman & Wolf, ACL 2025), per
  channel d: ``M_d[t, s] = Σ_N C_t[N] exp(Σ_{k=s+1..t} Δ_k[d] A[d, N]) Δ_s[d] B_s[N] + D_d δ_ts``
  (:func:`selective_matrix`);
- a short causal convolution, per channel: a banded Toeplitz matrix, with gates on its input (LFM2's B) and
  output (LFM2's C; the SiLU after Mamba's convolution held at σ(u), Zimerman et al., ICLR 2025) as diagonals
  (:func:`conv_matrix`); a convolution bias adds a constant, which no token contributes;
- gated DeltaNet (Yang et al., ICLR 2025), per head: the weight of v_s on o_t is
  ``β_s k_sᵀ [Π_{r=s+1..t} α_r (I − β_r k_r k_rᵀ)] q_t`` (:func:`delta_matrix`);
- a diagonal linear recurrence (RG-LRU of Griffin / RecurrentGemma), per channel:
  ``M_d[t, s] = Π_{k=s+1..t} a_k[d] · b_s[d]`` with b the input's gate and normalisation (:func:`lru_matrix`).

A mixer and the layers it feeds are composed through :func:`compose` (per channel: a convolution then the SSM).
The per-channel / per-head matrices become one token-to-token matrix per layer with :func:`fuse_channels`
(the method choice, see docs/methods.md). :func:`fused_rows` gives the same fused matrix applied to relevance
rows, one block of output tokens at a time (memory O(block·n) per channel group, no (n, n) per channel kept).

Torch only; every input is a tensor of the forward pass (float64 for exactness checks).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ssd_matrix", "selective_matrix", "conv_matrix", "delta_matrix", "lru_matrix", "compose", "mix",
           "fuse_channels", "fused_rows", "FUSIONS", "ssd_block", "BLOCK"]

#: How per-channel matrices become one per layer: "abs_mean" (default: the mean of |M_c| over channels, each
#: row divided by its sum, so that rollout's residual blend applies as to attention), "mean" (the signed mean,
#: not normalised).
FUSIONS = ("abs_mean", "mean")
#: Output tokens per block in :func:`fused_rows`.
BLOCK = 256


def _decay(log_a: torch.Tensor, t0: int = 0, t1: int | None = None, cols: int | None = None) -> torch.Tensor:
    """exp(Σ_{k=s+1..t} log_a_k) for rows t in [t0, t1), columns s in [0, cols) (default all n), 0 above the
    diagonal: (..., t1-t0, cols) from log_a (..., n)."""
    n = log_a.shape[-1]
    t1 = n if t1 is None else t1
    cols = n if cols is None else cols
    cum = log_a.cumsum(-1)
    seg = cum[..., t0:t1, None] - cum[..., None, :cols]
    t = torch.arange(t0, t1, device=log_a.device)[:, None]
    s = torch.arange(cols, device=log_a.device)[None, :]
    return torch.exp(seg.masked_fill(s > t, float("-inf")))


def ssd_block(C: torch.Tensor, B: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor | None,
              t0: int, t1: int, causal_cols: bool = False) -> torch.Tensor:
    """Rows [t0, t1) of :func:`ssd_matrix`: (b, h, t1-t0, n); with ``causal_cols`` only the columns [0, t1) that
    can be non-zero, (b, h, t1-t0, t1) (what :func:`fused_rows` takes)."""
    cols = t1 if causal_cols else C.shape[1]
    log_a = (dt * A).transpose(1, 2)  # (b, h, n)
    L = _decay(log_a, t0, t1, cols)
    CB = torch.einsum("bthN,bshN->bhts", C[:, t0:t1], B[:, :cols])
    M = L * CB * dt[:, :cols].transpose(1, 2)[:, :, None, :]
    if D is not None:
        idx = torch.arange(t0, t1, device=M.device)
        M[:, :, idx - t0, idx] += D.to(M.dtype)[None, :, None]
    return M


def ssd_matrix(C: torch.Tensor, B: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
               D: torch.Tensor | None = None) -> torch.Tensor:
    """The Mamba-2 / SSD scan as one matrix per head: y[:, t, h] = Σ_s M[:, h, t, s] x[:, s, h].

    C, B: (b, n, h, N) (groups repeated to heads); dt: (b, n, h) the step after softplus and clamping; A: (h,)
    the (negative) per-head decay rate; D: (h,) skip or None. Returns (b, h, n, n), lower triangular."""
    return ssd_block(C, B, dt, A, D, 0, C.shape[1])


def selective_matrix(C: torch.Tensor, B: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                     D: torch.Tensor | None = None, chunk: int = 64) -> torch.Tensor:
    """Mamba's selective scan as one matrix per channel: y[:, t, d] = Σ_s M[:, d, t, s] x[:, s, d].

    C, B: (b, n, N); dt: (b, n, d) after softplus; A: (d, N) negative; D: (d,) or None. Returns (b, d, n, n),
    computed ``chunk`` channels at a time (memory b·chunk·n²·N)."""
    b, n, d = dt.shape
    out = dt.new_zeros(b, d, n, n)
    t = torch.arange(n, device=dt.device)
    for c0 in range(0, d, chunk):
        c1 = min(d, c0 + chunk)
        log_a = dt[:, :, c0:c1, None] * A[None, None, c0:c1]  # (b, n, c, N)
        L = _decay(log_a.permute(0, 2, 3, 1))  # (b, c, N, n, n)
        W = torch.einsum("btN,bcNts,bsN->bcts", C, L, B)
        out[:, c0:c1] = W * dt[:, :, c0:c1].transpose(1, 2)[:, :, None, :]
    if D is not None:
        out[:, :, t, t] += D.to(out.dtype)[None, :, None]
    return out


def conv_matrix(weight: torch.Tensor, n: int, pre: torch.Tensor | None = None,
                post: torch.Tensor | None = None) -> torch.Tensor:
    """A depthwise causal convolution as one banded Toeplitz matrix per channel:
    y[:, t, c] = post[:, t, c] · Σ_s T_c[t, s] pre[:, s, c] x[:, s, c], with T_c[t, s] = weight[c, K-1-(t-s)] for
    0 ≤ t-s < K (the kernel's last tap on the current token, as ``F.conv1d`` with K-1 left padding computes).

    weight: (d, K); pre / post: (b, n, d) gates or None. Returns (b, d, n, n) (b = 1 without gates)."""
    d, K = weight.shape
    t = torch.arange(n, device=weight.device)
    lag = t[:, None] - t[None, :]
    band = (lag >= 0) & (lag < K)
    T = torch.where(band, weight[:, (K - 1 - lag).clamp(0, K - 1)], weight.new_zeros(()))  # (d, n, n)
    T = T[None]
    if pre is not None:
        T = T * pre.transpose(1, 2)[:, :, None, :]
    if post is not None:
        T = T * post.transpose(1, 2)[:, :, :, None]
    return T


def delta_matrix(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet as one matrix per head: o[:, t, h] = Σ_s W[:, h, t, s] v[:, s, h], with
    W[t, s] = β_s k_sᵀ [Π_{r=s+1..t} α_r (I − β_r k_r k_rᵀ)] q_t, α = exp(g).

    q, k: (b, n, h, dk) as the recurrence reads them (normalised, q scaled); beta: (b, n, h); g: (b, n, h), or
    (b, n, h, dk) for a per-channel decay (Kimi Delta Attention: α_t = diag(exp g_t) on the key channels). The
    state update is S_t = (I − β_t k_t k_tᵀ) diag(α_t) S_{t−1} + β_t k_t v_tᵀ (the recurrence's delta rule; a scalar
    α_t commutes) and o_t = S_tᵀ q_t. Returns (b, h, n, n), lower triangular; O(n²·dk) per head."""
    b, n, h, dk = q.shape
    W = q.new_zeros(b, h, n, n)
    U = q.new_zeros(b, h, n, dk)  # U[t] = Π_{r=s+1..t} α_r (I − β_r k_r k_rᵀ) q_t while s runs down
    qh, kh, bh, ah = q.transpose(1, 2), k.transpose(1, 2), beta.transpose(1, 2), g.exp().transpose(1, 2)
    ah = ah[..., None] if g.ndim == 3 else ah  # (b, h, n, 1) per head or (b, h, n, dk) per key channel
    for s in range(n - 1, -1, -1):
        U[:, :, s] = qh[:, :, s]
        proj = U @ kh[:, :, s, :, None]  # (b, h, n, 1): k_sᵀ U[t]
        W[:, :, :, s] = bh[:, :, s, None] * proj[..., 0]
        U = ah[:, :, s, None, :] * (U - bh[:, :, s, None, None] * proj * kh[:, :, s, None, :])
    return W


def lru_matrix(log_a: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A diagonal linear recurrence h_t = a_t h_{t−1} + scale_t x_t as one matrix per channel:
    M_d[t, s] = exp(Σ_{k=s+1..t} log a_k[d]) · scale_s[d]. log_a, scale: (b, n, d). Returns (b, d, n, n)."""
    return _decay(log_a.transpose(1, 2)) * scale.transpose(1, 2)[:, :, None, :]


def compose(*matrices: torch.Tensor) -> torch.Tensor:
    """The per-channel product of mixers applied in turn (first argument first): M_last ··· M_first."""
    out = matrices[0]
    for M in matrices[1:]:
        out = M @ out
    return out


def mix(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Apply per-group matrices M (b, g, n, n) to x (b, n, g, p) (p channels per group; (b, n, g) for one):
    y[:, t, g] = Σ_s M[:, g, t, s] x[:, s, g]."""
    if x.ndim == 3:
        return torch.einsum("bgts,bsg->btg", M, x)
    return torch.einsum("bgts,bsgp->btgp", M, x)


def fuse_channels(M: torch.Tensor, how: str = "abs_mean") -> torch.Tensor:
    """One token-to-token matrix from per-channel / per-head ones (b, c, n, n) -> (b, n, n): "abs_mean" (mean of
    |M_c|, rows divided by their sums; an all-zero row stays zero) or "mean" (the signed mean)."""
    if how not in FUSIONS:
        raise ValueError(f"how must be one of {FUSIONS}, got {how!r}")
    if how == "mean":
        return M.mean(1)
    F = M.abs().mean(1)
    s = F.sum(-1, keepdim=True)
    return F / torch.where(s > 0, s, torch.ones((), dtype=s.dtype, device=s.device))


def fused_rows(r: torch.Tensor, block: Callable[[int, int], torch.Tensor], n: int, *, a: float = 1.0,
               c: float = 0.0, rows: int = BLOCK) -> torch.Tensor:
    """r · (a·F + c·I) for relevance rows r (b, R, n), F the "abs_mean" fusion of a mixer whose rows [t0, t1)
    of per-channel matrices ``block(t0, t1)`` gives ((b, ch, t1-t0, w): its first w ≤ n columns, the rest 0, as a
    causal mixer's block needs only w = t1), computed ``rows`` output tokens at a time: no (n, n) matrix is kept
    (memory O(rows·n·ch))."""
    out = c * r
    for t0 in range(0, n, rows):
        t1 = min(n, t0 + rows)
        F = block(t0, t1).abs().mean(1)  # (b, t1-t0, w)
        s = F.sum(-1, keepdim=True)
        F = F / torch.where(s > 0, s, torch.ones((), dtype=s.dtype, device=s.device))
        out[:, :, : F.shape[-1]] += a * (r[:, :, t0:t1] @ F)
    return out
