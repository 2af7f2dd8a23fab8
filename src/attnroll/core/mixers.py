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
rows, one block of output tokens at a time (memory O(block·n) per channel group, no (n, n) per channel kept);
:func:`ssd_rows` does so for the SSD matrices with each block's earlier columns one rank-N product per head,
:func:`ssd_signed_rows` sweeps the signed head mean in linear time. :class:`MixerRows` is a mixer as a layer of the
matrix-free row sweep (``core.operators.apply_layer``), its fused matrix one block of rows at a time (convolution
folded by :func:`fold_rows`): :class:`SSDRows` (Mamba-2), :class:`SelectiveRows` (Mamba, :func:`selective_block`),
:class:`DeltaRows` (gated DeltaNet / KDA, a state scan), :class:`ConvRows` (a short convolution, banded) and
:class:`LRURows` (RG-LRU).

Torch only; every input is a tensor of the forward pass (float64 for exactness checks).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["ssd_matrix", "selective_matrix", "conv_matrix", "delta_matrix", "lru_matrix", "compose", "mix",
           "fuse_channels", "fused_rows", "FUSIONS", "ssd_block", "ssd_rows",
           "ssd_signed_rows", "SSDRows", "BLOCK", "MixerRows", "fold_rows", "selective_block", "SelectiveRows",
           "DeltaRows", "ConvRows", "LRURows", "ROWS_BUDGET", "CONVOLUTIONS", "conv_coef",
           "apply_conv_rows", "conv_row_sums"]

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
    can be non-zero, (b, h, t1-t0, t1) (what :func:`fused_rows` takes).

    The columns before the block are a rank-N product per head (the SSD's semiseparable structure): for s < t0 ≤ t,
    exp(Σ_{k=s+1..t} Δ_k A) = exp(cum_t − cum_{t0−1}) · exp(cum_{t0−1} − cum_s), both factors ≤ 1 when every
    Δ·A ≤ 0 (Mamba-2's A is negative), so M[t, s] = (C_t e_t)·(B_s Δ_s e'_s): one matrix product, no exponential
    per entry. The block's own columns take the direct form (its decays could overflow a factor)."""
    b, n, h, _ = C.shape
    cols = t1 if causal_cols else n
    log_a = (dt * A).transpose(1, 2)  # (b, h, n)
    if t0 == 0 or bool((log_a > 0).any()):
        L = _decay(log_a, t0, t1, cols)
        CB = torch.einsum("bthN,bshN->bhts", C[:, t0:t1], B[:, :cols])
        M = L * CB * dt[:, :cols].transpose(1, 2)[:, :, None, :]
    else:
        cum = log_a.cumsum(-1)
        ref = cum[..., t0 - 1: t0]
        left = C[:, t0:t1].transpose(1, 2) * torch.exp(cum[..., t0:t1] - ref)[..., None]  # (b, h, rows, N)
        right = (B[:, :t0] * dt[:, :t0, :, None]).transpose(1, 2) * torch.exp(ref - cum[..., :t0])[..., None]
        M = C.new_zeros(b, h, t1 - t0, cols)
        M[..., :t0] = left @ right.transpose(-1, -2)
        seg = cum[..., t0:t1, None] - cum[..., None, t0:t1]
        t = torch.arange(t1 - t0, device=C.device)
        L = torch.exp(seg.masked_fill(t[None, :] > t[:, None], float("-inf")))
        CB = torch.einsum("bthN,bshN->bhts", C[:, t0:t1], B[:, t0:t1])
        M[..., t0:t1] = L * CB * dt[:, t0:t1].transpose(1, 2)[:, :, None, :]
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
    ah = g.exp().transpose(1, 2)
    ah = ah[..., None] if g.ndim == 3 else ah  # (b, h, n, 1) per head or (b, h, n, dk) per key channel
    return _delta_local(q.transpose(1, 2), k.transpose(1, 2), beta.transpose(1, 2), ah)[0]


def _delta_local(qh: torch.Tensor, kh: torch.Tensor, bh: torch.Tensor,
                 ah: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`delta_matrix` of heads-first inputs (q, k: (b, h, n, dk); β: (b, h, n); α: (b, h, n, 1 or dk)), and
    U (b, h, n, dk): U[t] = A_0 ··· A_t q_t with A_r = diag(α_r)(I − β_r k_r k_rᵀ), what the rows carry to the
    columns before these tokens (:class:`DeltaRows`)."""
    b, h, n, dk = qh.shape
    W = qh.new_zeros(b, h, n, n)
    U = qh.new_zeros(b, h, n, dk)  # U[t] = Π_{r=s+1..t} α_r (I − β_r k_r k_rᵀ) q_t while s runs down
    for s in range(n - 1, -1, -1):
        U[:, :, s] = qh[:, :, s]
        proj = U @ kh[:, :, s, :, None]  # (b, h, n, 1): k_sᵀ U[t]
        W[:, :, :, s] = bh[:, :, s, None] * proj[..., 0]
        U = ah[:, :, s, None, :] * (U - bh[:, :, s, None, None] * proj * kh[:, :, s, None, :])
    return W, U


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
    (memory O(rows·n·ch)). Blocks whose rows carry no relevance are skipped; ``block`` returns a fresh tensor
    (it is overwritten)."""
    out = c * r
    for t0 in range(0, n, rows):
        t1 = min(n, t0 + rows)
        rr = r[:, :, t0:t1]
        if not bool(rr.any()):
            continue
        F = block(t0, t1).abs_().sum(1)  # (b, t1-t0, w): the channel mean up to a factor the rows' sums remove
        s = F.sum(-1)[:, None, :]
        wt = rr / torch.where(s > 0, s, torch.ones((), dtype=s.dtype, device=s.device))
        out[:, :, : F.shape[-1]] += a * (wt @ F)
    return out


def ssd_rows(r: torch.Tensor, C: torch.Tensor, B: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             D: torch.Tensor | None, *, a: float = 1.0, c: float = 0.0, rows: int = BLOCK) -> torch.Tensor:
    """:func:`fused_rows` of the SSD matrices (``fused_rows(r, lambda t0, t1: ssd_block(..., causal_cols=True), n)``),
    computed without an (h, rows, n) block: per block of output rows, each head's columns before the block are one
    rank-N matrix product (decays factored at the block's start, as :func:`ssd_block`), added into Σ_h |M_h| one
    head at a time; the block's own columns take the direct form. Memory O(rows·n); falls back to
    :func:`fused_rows` when some Δ·A > 0 (a factor could overflow)."""
    n = C.shape[1]
    log_a = (dt * A).transpose(1, 2)  # (b, h, n)
    if bool((log_a > 0).any()):
        return fused_rows(r, lambda t0, t1: ssd_block(C, B, dt, A, D, t0, t1, causal_cols=True), n, a=a, c=c,
                          rows=rows)
    cum = log_a.cumsum(-1)
    Ch = C.transpose(1, 2)  # (b, h, n, N)
    BhT = (B * dt[..., None]).permute(0, 2, 3, 1).contiguous()  # (b, h, N, n): a matmul's right operand as stored
    BT, dtT = B.permute(0, 2, 3, 1).contiguous(), dt.transpose(1, 2)  # (b, h, N, n), (b, h, n)
    above = torch.ones(rows, rows, dtype=torch.bool, device=C.device).triu_(1)
    one = torch.ones((), dtype=r.dtype, device=r.device)
    out = c * r
    for t0 in range(0, n, rows):
        t1 = min(n, t0 + rows)
        rr = r[:, :, t0:t1]
        if not bool(rr.any()):
            continue
        Fd = _own_block(Ch[:, :, t0:t1], BT[..., t0:t1], dtT[..., t0:t1], log_a[..., t0:t1], D, above)
        total = Fd.sum(-1)
        Fl = _earlier_columns(Ch, BhT, cum, t0, t1) if t0 > 0 else None  # (b, rows, t0)
        if Fl is not None:
            total = total + Fl.sum(-1)
        wt = rr / torch.where(total > 0, total, one)[:, None, :]
        out[:, :, t0:t1] += a * (wt @ Fd)
        if Fl is not None:
            out[:, :, :t0] += a * (wt @ Fl)
    return out


def _own_block(Ch: torch.Tensor, BT: torch.Tensor, dtT: torch.Tensor, log_a: torch.Tensor, D: torch.Tensor | None,
               above: torch.Tensor) -> torch.Tensor:
    """Σ_h |M_h| on a block's own rows and columns, (b, R, R) (:func:`_own_heads` summed over heads)."""
    return _own_heads(Ch, BT, dtT, log_a, D, above).sum(1)


def _own_heads(Ch: torch.Tensor, BT: torch.Tensor, dtT: torch.Tensor, log_a: torch.Tensor, D: torch.Tensor | None,
               above: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """|M_h| on a block's own rows and columns, (b, h, R, R), from the block's own cumulative decays: factored,
    (C_t e^{cum_t}) · (Δ_s B_s e^{−cum_s}), one product per head, when the block's decays span less than a quarter
    of the dtype's exponent range (neither factor overflows); else :func:`ssd_block`'s direct form (an exponential
    per entry). D on the diagonal. Ch (b, h, R, N), BT (b, h, N, R), dtT and log_a (b, h, R), ``above`` the mask
    above the diagonal (made once per sweep); ``keep``: only these rows (indices into the block), (b, h, len(keep),
    R)."""
    R = Ch.shape[2]
    cum = log_a.cumsum(-1)
    rows, mask = (cum, above[:R, :R]) if keep is None else (cum[..., keep], above[:R, :R][keep])
    Cr = Ch if keep is None else Ch[:, :, keep]
    if float(-cum[..., -1].min()) < 0.25 * math.log(torch.finfo(Ch.dtype).max):
        left = Cr * torch.exp(rows)[..., None]
        M = (left @ (BT * (torch.exp(-cum) * dtT)[:, :, None, :])).masked_fill_(mask, 0.0)
    else:
        L = torch.exp((rows[..., :, None] - cum[..., None, :]).masked_fill_(mask, float("-inf")))
        M = L.mul_(Cr @ BT).mul_(dtT[:, :, None, :])
    if D is not None:
        t = torch.arange(R, device=M.device) if keep is None else keep
        M[:, :, torch.arange(t.numel(), device=M.device), t] += D.to(M.dtype)[None, :, None]
    return M.abs_()


def _earlier_columns(Ch: torch.Tensor, BhT: torch.Tensor, cum: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """Σ_h |M_h[t, s]| for rows t in [t0, t1) and columns s < t0, (b, t1-t0, t0): per head one rank-N product of
    the block's C rows and the earlier columns' Δ·B, decays factored at the block's start (both factors ≤ 1). The
    right operand is built (N, t0) contiguous (a transposed view makes the thin product several times slower), and
    each head's product lands in one reused buffer."""
    ref = cum[..., t0 - 1: t0]
    left = Ch[:, :, t0:t1] * torch.exp(cum[..., t0:t1] - ref)[..., None]  # (b, h, rows, N)
    right = BhT[..., :t0] * torch.exp(ref - cum[..., :t0])[:, :, None, :]  # (b, h, N, t0)
    Fl = torch.matmul(left[:, 0], right[:, 0]).abs_()
    P = torch.empty_like(Fl)
    for k in range(1, left.shape[1]):
        Fl.add_(torch.matmul(left[:, k], right[:, k], out=P).abs_())
    return Fl


def ssd_signed_rows(r: torch.Tensor, C: torch.Tensor, B: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                    D: torch.Tensor | None, *, a: float = 1.0, c: float = 0.0, chunk: int = 256) -> torch.Tensor:
    """r · (a·F + c·I) with F = mean_h M_h, the signed ("mean") fusion of the SSD matrices, in time linear in n:
    (r·M_h)[s] = Δ_s B_s · u_s + D_h r_s with u_s = Σ_{t ≥ s} r_t C_t exp(cum_t − cum_s), a reverse scan of an
    N-vector per head and row, ``chunk`` tokens at a time (the chunk's own (chunk, chunk) block direct, the
    state from the tokens after it carried with its decay). Memory O(n·N·h). Heads' signed entries cancel in
    the mean (see docs/methods.md): exact for that fusion, not for "abs_mean"."""
    b, n, h, N = C.shape
    log_a = (dt * A).transpose(1, 2)  # (b, h, n)
    out = c * r
    if bool((log_a > 0).any()):  # a growing state: the direct blocks (no factor is bounded)
        for t0 in range(0, n, chunk):
            t1 = min(n, t0 + chunk)
            out[:, :, :t1] += a * (r[:, :, t0:t1] @ ssd_block(C, B, dt, A, D, t0, t1, causal_cols=True).mean(1))
        return out
    cum = log_a.cumsum(-1)
    Ch, Bh = C.transpose(1, 2), (B * dt[..., None]).transpose(1, 2)  # (b, h, n, N)
    dmean = 0.0 if D is None else float(D.double().mean())
    z = r.new_zeros(b, r.shape[1], h, N)  # Σ_{t ≥ t1} r_t C_t exp(cum_t − cum_{t1−1}), per row and head
    for t1 in range(n, 0, -chunk):
        t0 = max(0, t1 - chunk)
        cb = cum[..., t0:t1]
        q = torch.arange(t1 - t0, device=r.device)
        L = torch.exp((cb[..., :, None] - cb[..., None, :]).masked_fill(q[None, :] > q[:, None], float("-inf")))
        W = L * (Ch[:, :, t0:t1] @ Bh[:, :, t0:t1].transpose(-1, -2))  # (b, h, Q, Q): rows t, columns s
        part = torch.einsum("brt,bhts->brhs", r[:, :, t0:t1], W)
        part += torch.einsum("brhN,bhsN->brhs", z, Bh[:, :, t0:t1]) * torch.exp(cb[..., -1:] - cb)[:, None]
        out[:, :, t0:t1] += a * (part.mean(2) + dmean * r[:, :, t0:t1])
        if t0 > 0:
            ref = cum[..., t0 - 1: t0]
            z = z * torch.exp(cb[..., -1:] - ref)[:, None] + torch.einsum(
                "brt,bhtN->brhN", r[:, :, t0:t1], Ch[:, :, t0:t1] * torch.exp(cb - ref)[..., None])
    return out


# ------------------------------------------------------------------------------- rows-only mixer layers
#: The decay below which :class:`SSDRows`' sweep leaves an earlier column out (None: eps² of the dtype; 0: never,
#: every column taken, as ``benchmarks/bench_mixers.py --keep-past`` times it).
FORGET_BELOW: float | None = None
#: Elements of the per-channel block one step of :meth:`MixerRows.block` holds (channels are taken in groups that
#: fit): memory O(rows·n·channels per group), never (n, n) per channel.
ROWS_BUDGET = 1 << 23


#: How a mixer's causal convolution enters its layer's fused matrix: "apart" (default) composes it as an operator
#: of its own before |·|, Σ_c |M_{h(c)}| · |diag(gate_c) · T_c| (the scan's and the convolution's absolute values
#: taken apart, as rollout composes any two mixing steps); "folded" takes |·| of each channel's whole product,
#: Σ_c |M_{h(c)} · diag(gate_c) · T_c| (cancelling taps cancel; O(channels) times the work). docs/methods.md.
CONVOLUTIONS = ("apart", "folded")


def conv_coef(gate_in: torch.Tensor | None, weight: torch.Tensor, heads_of: int, w: int, dtype: torch.dtype,
              batch: int = 1) -> torch.Tensor:
    """The banded convolution operator of each group, Σ_{c in g} |diag(gate_c) · T_c|, as coefficients
    (b, G, w, K): coef[g, s, k] = Σ_c |gate_c[s + k]| · |w_c[K-1-k]|, the entry of row s + k, column s (0 past w).
    gate_in (b, ≥ w, G·heads_of) or None (ones); weight (G·heads_of, K). One product over the group's channels
    per row, then each tap's column shifted."""
    C, K = weight.shape
    G = C // heads_of
    taps = weight.to(dtype).flip(-1).abs().reshape(G, heads_of, K)  # taps[g, p, k] = |weight[c, K-1-k]|
    if gate_in is None:
        Z = taps.sum(1)[None, :, None, :].expand(batch, G, w, K)  # (b, G, w, K)
    else:
        g = gate_in[:, :w].to(dtype).abs().reshape(-1, w, G, heads_of)
        Z = torch.einsum("bjgp,gpk->bgjk", g, taps)  # Z[b, g, j, k] = Σ_p |gate[j, (g, p)]| · taps[g, p, k]
    coef = torch.zeros(Z.shape[0], G, w, K, dtype=dtype, device=weight.device)
    for k in range(min(K, w)):
        coef[:, :, : w - k, k] = Z[:, :, k:, k]
    return coef


def apply_conv_rows(v: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """v · S_g for rows v (..., G, R, w) and the banded S_g of :func:`conv_coef` (b, G, w, K), broadcast over the
    leading dimensions: out[..., s] = Σ_k v[..., s + k] · coef[s, k]. Returns (..., G, R, w)."""
    w, K = coef.shape[-2], coef.shape[-1]
    vp = torch.nn.functional.pad(v, (0, K - 1))
    ck = coef[..., None, :, :]  # (b, G, 1, w, K)
    out = vp[..., :w] * ck[..., 0]
    for k in range(1, K):
        out.addcmul_(vp[..., k: k + w], ck[..., k])
    return out


def conv_row_sums(coef: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """S_g · real for the banded S_g of :func:`conv_coef` (b, G, w, K) (real (b, w) or None: ones): (b, G, w),
    entry j = Σ_k coef[j − k, k] · real[j − k] over j − k ≥ 0."""
    b, G, w, K = coef.shape
    c = coef if real is None else coef * real[:, None, :, None].to(coef.dtype)
    out = c[..., 0].clone()
    for k in range(1, min(K, w)):
        out[..., k:] += c[..., : w - k, k]
    return out


def fold_rows(M: torch.Tensor, gate_in: torch.Tensor | None = None, weight: torch.Tensor | None = None,
              heads_of: int = 1, convolution: str = "apart") -> torch.Tensor:
    """Σ_c |K_c| over channels for rows of per-group matrices M (b, G, R, w) (``heads_of`` channels per group):
    K_c = M_{g(c)} · diag(gate_in_c) · T_c with T_c the causal convolution of ``weight`` (G·heads_of, K) and
    gate_in (b, ≥ w, G·heads_of) (None: ones), or K_c = M_{g(c)} without ``weight``. Returns (b, R, w).

    ``convolution`` (:data:`CONVOLUTIONS`): "apart" takes |·| of each factor, Σ_g |M_g| · S_g with S_g =
    Σ_{c in g} |diag(gate_c) T_c| banded (:func:`conv_coef`; K shifted products per group); "folded" takes it of
    each channel's product: K_c[t, s] = Σ_k M_g[t, s + k] · gate_c[s + k] · w_c[K-1-k] (M causal: its columns
    past w are 0), per group one batched product over the K taps for all its channels (M's shifted columns and
    the taps' coefficients are strided views, no copy per tap), then |·| summed over the channels."""
    if convolution not in CONVOLUTIONS:
        raise ValueError(f"convolution must be one of {CONVOLUTIONS}, got {convolution!r}")
    b, G, R, w = M.shape
    if weight is None:
        return M.abs().sum(1) * heads_of
    if convolution == "apart":
        coef = conv_coef(gate_in, weight, heads_of, w, M.dtype, b)
        return apply_conv_rows(M.abs(), coef).sum(1)
    K = weight.shape[-1]
    pad = torch.nn.functional.pad
    g = M.new_ones(b, w, G * heads_of) if gate_in is None else gate_in[:, :w].to(M.dtype)
    taps = weight.to(M.dtype).flip(-1)  # taps[:, k] = weight[:, K-1-k]
    coef = pad(g, (0, 0, 0, K - 1)).unfold(1, K, 1) * taps  # (b, w, C, K): gate[s + k, c] · w_c[K-1-k]
    coef = coef.reshape(b, w, G, heads_of, K).permute(0, 2, 1, 4, 3)  # (b, G, w, K, P)
    if heads_of == 1:  # one channel per group: the K taps summed elementwise, (b, G, R, w) each
        Mp, ck = pad(M, (0, K - 1)), coef[..., 0].transpose(-1, -2)[:, :, None]  # ck: (b, G, 1, K, w)
        acc = Mp[..., :w] * ck[..., 0, :]
        for k in range(1, K):
            acc.addcmul_(Mp[..., k: k + w], ck[..., k, :])
        return acc.abs_().sum(1)
    shifted = pad(M, (0, K - 1)).unfold(-1, K, 1).transpose(2, 3)  # (b, G, w, R, K): M_g[t, s + k]
    total = M.new_zeros(b, w, R)
    for h in range(G):  # one batched (R, K) @ (K, P) product per column s, per group
        total += torch.matmul(shifted[:, h], coef[:, h]).abs_().sum(-1)
    return total.transpose(1, 2)


class MixerRows:
    """A token mixer as a layer of the matrix-free row sweep (``core.operators.apply_layer`` dispatches to
    :meth:`apply_rows`): its fused matrix F = normalise_rows(Σ_c |K_c|) (as the dense record's layer) applied to
    relevance rows one block of output tokens at a time, never an (n, n) matrix.

    A subclass gives the rows [t0, t1) of its per-group matrices (:meth:`group_rows`, columns [0, t1)), ``groups``
    and ``heads_of`` (channels per group), and optionally the convolution folded per channel (``gate_in`` (b, n, C),
    ``weight`` (C, K)); or overrides :meth:`block`. ``heads``: the head count the stream's layers report
    (``shape``), for a hybrid's attention layers."""

    sinks = None  # what the row methods' checks read of an attention layer
    mask = None
    causal = True
    is_causal_model = True
    gate_in: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    heads_of = 1
    groups = 1
    inner = 1  # elements per entry a group's rows take to compute (a state size), for the group step
    convolution = "apart"  # how the convolution enters (:data:`CONVOLUTIONS`)

    def __init__(self, batch: int, n: int, device: torch.device, heads: int = 1, rows: int = 64):
        self.batch, self.n, self._device, self.heads, self.rows = batch, n, device, heads, rows

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.heads, self.n, self.n

    @property
    def device(self) -> torch.device:
        return self._device

    def group_rows(self, t0: int, t1: int, g0: int, g1: int) -> torch.Tensor:
        """Rows [t0, t1), columns [0, t1) of groups [g0, g1)'s matrices: (b, g1-g0, t1-t0, t1)."""
        raise NotImplementedError

    def block(self, t0: int, t1: int) -> torch.Tensor:
        """Σ_c |K_c| for output rows [t0, t1) and columns [0, t1): (b, t1-t0, t1), the groups taken as many at a
        time as :data:`ROWS_BUDGET` allows (:func:`fold_rows`)."""
        K = 1 if self.weight is None else self.weight.shape[-1]
        per = self.heads_of * K if self.convolution == "folded" else 3
        step = max(1, ROWS_BUDGET // (max(per, self.inner) * (t1 - t0) * t1))
        total = None
        for g0 in range(0, self.groups, step):
            g1 = min(self.groups, g0 + step)
            c0, c1 = g0 * self.heads_of, g1 * self.heads_of
            part = fold_rows(self.group_rows(t0, t1, g0, g1), None if self.gate_in is None else
                             self.gate_in[..., c0:c1], None if self.weight is None else self.weight[c0:c1],
                             self.heads_of, self.convolution)
            total = part if total is None else total.add_(part)
        assert total is not None  # groups >= 1
        return total

    @torch.no_grad()  # a map, not a graph: gates that are parameters (D) must not make the sweep track gradients
    def apply_rows(self, r: torch.Tensor, *, a: float, c: float, renorm: bool = False,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """r · diag(1/s)·(a·F + c·I) for rows r (b, R, n): F restricted to the real tokens of ``mask`` (b, n) (padded
        columns 0, rows renormalised over the real ones; the identity on real tokens), ``renorm`` dividing each row
        by s_i = a·Σ_j F_ij + c·[i real] (s = 1 without)."""
        n = r.shape[-1]
        real = torch.ones(r.shape[0], n, dtype=r.dtype, device=r.device) if mask is None else mask.to(r.dtype)
        out = torch.zeros_like(r)
        one = torch.ones((), dtype=r.dtype, device=r.device)
        for t0 in range(0, n, self.rows):
            t1 = min(n, t0 + self.rows)
            rr = r[:, :, t0:t1] * real[:, None, t0:t1]
            if not bool(rr.any()):
                continue
            F = self.block(t0, t1).to(r.dtype) * real[:, None, :t1]
            sums = F.sum(-1)  # (b, rows)
            F = F / torch.where(sums > 0, sums, one)[..., None]
            if renorm:
                s = a * (sums > 0).to(r.dtype) + c * real[:, t0:t1]
                rr = rr / torch.where(s > 0, s, one)[:, None, :]
            out[:, :, t0:t1] += c * rr
            out[:, :, :t1] += a * (rr @ F)
        return out


class SSDRows(MixerRows):
    """A Mamba-2 mixer as a :class:`MixerRows` layer: F = normalise_rows(Σ_c |S_{h(c)}| · |diag(gate_in_c) · T_c|)
    (the convolution of ``weight`` and the SiLU's σ(u) composed apart, :data:`CONVOLUTIONS`; "folded":
    Σ_c |S_{h(c)} · diag(gate_in_c) · T_c|), as the dense record's layer.

    With the convolution apart, :meth:`apply_rows` sweeps blocks of ``rows`` output tokens (fewer where the heads'
    rows would pass :data:`ROWS_BUDGET`): each head's |S_h| rows (the columns before the block one rank-N
    product, as :func:`ssd_rows`) are contracted with the relevance rows, and the banded Σ_{c in h} |diag(gate_c)
    T_c| is applied once per head at the end (:func:`apply_conv_rows`): O(n²·H) per sweep, memory O(rows·n·H).

    C, B: (b, n, H, N); dt: (b, n, H); A, D: (H,); gate_in: (b, n, H·P); weight: (H·P, K); ``heads``: the head
    count the stream's layers report (``shape``), for a hybrid's attention layers."""

    def __init__(self, C, B, dt, A, D, gate_in, weight, heads: int = 1, rows: int = 128):
        super().__init__(C.shape[0], C.shape[1], C.device, heads, rows)
        self.C, self.B, self.dt, self.A, self.D = C, B, dt, A, D
        self.gate_in, self.weight = gate_in, weight
        self.groups, self.heads_of = C.shape[2], gate_in.shape[-1] // C.shape[2]

    def group_rows(self, t0: int, t1: int, g0: int, g1: int) -> torch.Tensor:
        D = None if self.D is None else self.D[g0:g1]
        return ssd_block(self.C[:, :, g0:g1], self.B[:, :, g0:g1], self.dt[:, :, g0:g1], self.A[g0:g1], D, t0, t1,
                         causal_cols=True)

    @torch.no_grad()  # a map, not a graph: gates that are parameters (D) must not make the sweep track gradients
    def apply_rows(self, r: torch.Tensor, *, a: float, c: float, renorm: bool = False,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        log_a = (self.dt * self.A).transpose(1, 2)  # (b, H, n)
        if self.convolution != "apart" or self.weight is None or bool((log_a > 0).any()):  # a growing state: direct
            return super().apply_rows(r, a=a, c=c, renorm=renorm, mask=mask)
        return _ssd_apart_rows(self, r, log_a, a, c, renorm, mask)

    def conv_coef(self) -> torch.Tensor:
        """:func:`conv_coef` of this layer's convolution and σ(u) (b, H, n, K), computed once per layer (the sink
        probe's sweep and the rollout's share it)."""
        if getattr(self, "_coef", None) is None:
            assert self.weight is not None
            self._coef = conv_coef(self.gate_in, self.weight, self.heads_of, self.n, self.C.dtype, self.batch)
        return self._coef


def _ssd_apart_rows(lay: SSDRows, r: torch.Tensor, log_a: torch.Tensor, a: float, c: float, renorm: bool,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """:meth:`MixerRows.apply_rows` of an :class:`SSDRows` with the convolution apart (every Δ·A ≤ 0): per block
    of output rows, E_h = |S_h| on its rows (earlier columns one rank-N product per head, decays factored at the
    block's start; its own columns direct), row sums Σ_h E_h · (S_conv_h · real), V_h += (rows / sums) · E_h;
    at the end a · Σ_h V_h · S_conv_h on the real columns."""
    b, n, H, _ = lay.C.shape
    assert lay.weight is not None  # SSDRows.apply_rows takes this route only with a convolution
    real = torch.ones(b, n, dtype=r.dtype, device=r.device) if mask is None else mask.to(r.dtype)
    coef = lay.conv_coef()  # (b, H, n, K)
    srow = conv_row_sums(coef, real.to(coef.dtype))[..., None]  # (b, H, n, 1)
    cum = log_a.cumsum(-1)
    Ch = lay.C.transpose(1, 2)  # (b, H, n, N)
    BhT = (lay.B * lay.dt[..., None]).permute(0, 2, 3, 1).contiguous()  # (b, H, N, n)
    BT, dtT = lay.B.permute(0, 2, 3, 1).contiguous(), lay.dt.transpose(1, 2)
    rows = min(lay.rows, max(16, ROWS_BUDGET // max(1, b * H * n)))
    above = torch.ones(rows, rows, dtype=torch.bool, device=r.device).triu_(1)
    out, V = torch.zeros_like(r), lay.C.new_zeros(b, H, r.shape[1], n)
    live = (r * real[:, None, :]).ne(0).any(1).any(0).nonzero()[:, 0]
    if live.numel() <= rows:  # a few rows carry relevance (one-hot probes, the top layer): those rows directly
        for q in live.split(max(1, ROWS_BUDGET // max(1, b * H * n))):
            _ssd_few_rows(lay, r, real, q, srow, cum, V, out, a, c, renorm)
        return out + a * (apply_conv_rows(V, coef).sum(1).to(r.dtype) * real[:, None, :])
    store = lay.C.new_empty(b, H, rows * n)  # the earlier columns' |S_h| of one block (_earlier_heads)
    for t0 in range(0, n, rows):
        t1 = min(n, t0 + rows)
        rr = r[:, :, t0:t1] * real[:, None, t0:t1]
        live = rr.ne(0).any(1).any(0)  # the block's rows that carry relevance
        count = int(live.sum())
        if not count:
            continue
        keep = None if 2 * count > t1 - t0 else live.nonzero()[:, 0]  # few rows (one-hot rows, the top layer)
        Ed = _own_heads(Ch[:, :, t0:t1], BT[..., t0:t1], dtT[..., t0:t1], log_a[..., t0:t1], lay.D, above, keep)
        sums = (Ed @ srow[:, :, t0:t1]).sum(1)[..., 0]  # (b, R)
        El = _earlier_heads(Ch, BhT, cum, t0, t1, keep, srow, sums, store) if t0 else []
        sums = sums.to(r.dtype)
        if keep is not None:
            rr, at = rr[..., keep], t0 + keep
        else:
            at = torch.arange(t0, t1, device=r.device)
        wt = _pass_rows(rr, sums, real[:, at], at, out, a, c, renorm).to(Ed.dtype)[:, None]  # (b, 1, R_r, R)
        V[..., t0:t1] += wt @ Ed
        for (i, h), s0, E in El:
            V[i, h, :, s0:t0].addmm_(wt[i, 0], E)
    return out + a * (apply_conv_rows(V, coef).sum(1).to(r.dtype) * real[:, None, :])


def _ssd_few_rows(lay: SSDRows, r: torch.Tensor, real: torch.Tensor, q: torch.Tensor, srow: torch.Tensor,
                  cum: torch.Tensor, V: torch.Tensor, out: torch.Tensor, a: float, c: float, renorm: bool) -> None:
    """The rows ``q`` (positions) of :func:`_ssd_apart_rows`'s sweep, each one's |S_h| row in the direct form
    (C_q·Δ_s B_s · exp(cum_q − cum_s) for s ≤ q, + D at s = q; no factor can overflow): their row sums, the
    relevance they pass added to V (b, H, R_r, n) and the identity's share to ``out``, in place."""
    n = cum.shape[-1]
    seg = (cum[..., q, None] - cum[..., None, :]).masked_fill_(torch.arange(n, device=q.device) > q[:, None], -math.inf)
    E = torch.einsum("bqhN,bshN->bhqs", lay.C[:, q], lay.B * lay.dt[..., None]).mul_(seg.exp_())  # (b, H, Q, n)
    if lay.D is not None:
        E[:, :, torch.arange(q.numel(), device=q.device), q] += lay.D.to(E.dtype)[None, :, None]
    E.abs_()
    sums = (E @ srow).sum(1)[..., 0].to(r.dtype)  # (b, Q)
    rr = r[:, :, q] * real[:, None, q]
    V += _pass_rows(rr, sums, real[:, q], q, out, a, c, renorm).to(E.dtype)[:, None] @ E


def _pass_rows(rr: torch.Tensor, sums: torch.Tensor, real: torch.Tensor, at: torch.Tensor, out: torch.Tensor,
               a: float, c: float, renorm: bool) -> torch.Tensor:
    """The relevance rows ``rr`` (b, R_r, R) of output tokens ``at`` with their layer rows' sums (b, R): as
    :meth:`MixerRows.apply_rows` blends them (``renorm``: divided by a·[row has mass] + c·[real]), the identity's
    share c·rr added to ``out`` in place; returns rr / sums, the weights of those rows' |S| entries."""
    one = torch.ones((), dtype=rr.dtype, device=rr.device)
    if renorm:
        s = a * (sums > 0).to(rr.dtype) + c * real
        rr = rr / torch.where(s > 0, s, one)[:, None, :]
    out[:, :, at] += c * rr
    return rr / torch.where(sums > 0, sums, one)[:, None, :]


def _earlier_heads(Ch: torch.Tensor, BhT: torch.Tensor, cum: torch.Tensor, t0: int, t1: int,
                   keep: torch.Tensor | None, srow: torch.Tensor, sums: torch.Tensor,
                   store: torch.Tensor) -> list[tuple[tuple[int, int], int, torch.Tensor]]:
    """|S_h| on rows [t0, t1) (or their ``keep``) and the columns before t0, per example and head: one rank-N
    product each (decays factored at the block's start), written as |·| into contiguous pieces of ``store``
    (b, H, ≥ rows·t0; reused from block to block: a fresh (rows, t0) tensor per product costs more than the
    product), its row sums against ``srow`` (b, H, n, 1) added to ``sums`` (b, R) while the piece is in cache.
    Columns whose decay to the block's first row, exp(cum_{t0−1} − cum_s), is below eps² of the dtype are left out
    (a prefix, the scan's forgotten past: every entry there is below eps² · |C_t · Δ_s B_s|, under the resolution
    of the sums it would enter). Returns ((example, head), first column, piece (R, t0 − first)) for the
    contraction with the relevance rows."""
    ref = cum[..., t0 - 1: t0]
    left = Ch[:, :, t0:t1] * torch.exp(cum[..., t0:t1] - ref)[..., None]  # (b, H, R, N)
    left = left if keep is None else left[:, :, keep]
    floor = (2 * math.log(torch.finfo(cum.dtype).eps) if FORGET_BELOW is None else
             math.log(FORGET_BELOW) if FORGET_BELOW > 0 else -math.inf)
    first = torch.searchsorted(-cum[..., :t0].contiguous(), (floor - ref).contiguous())[..., 0].tolist()  # (b, H)
    R = left.shape[2]
    out = []
    for i in range(left.shape[0]):
        for h in range(left.shape[1]):
            s0 = first[i][h]
            if s0 >= t0:
                continue
            right = BhT[i, h, :, s0:t0] * torch.exp(ref[i, h] - cum[i, h, s0:t0])
            E = store[i, h, : R * (t0 - s0)].view(R, t0 - s0)
            torch.matmul(left[i, h], right, out=E).abs_()
            sums[i] += torch.mv(E, srow[i, h, s0:t0, 0])
            out.append(((i, h), s0, E))
    return out


def selective_block(C: torch.Tensor, B: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor | None,
                    t0: int, t1: int, sub: int = 16) -> torch.Tensor:
    """Rows [t0, t1), columns [0, t1) of :func:`selective_matrix`: (b, d, t1-t0, t1), every entry one product over
    the N states per channel (matrix products, no exponential per entry), the decays factored as
    exp(cum_t − cum_s) = exp(cum_t − ref) · exp(ref − cum_s). The columns before the block take ref = cum_{t0−1}
    (both factors ≤ 1 when every Δ·A ≤ 0, as Mamba's negative A gives: a factor that underflows belongs to an entry
    that does); the block's own columns, ``sub`` rows at a time, take ref at those rows' start, exact while their
    own decays span less than ``_SPAN`` (the factors > 1 stay in range), else those rows' own columns take the
    direct form, as does a growing state throughout. Memory O(d·(rows·t1 + N·t1))."""
    b, n, d = dt.shape
    log_a = (dt[:, :t1, :, None] * A).permute(0, 2, 3, 1)  # (b, d, N, t1)
    Bdt = B[:, :t1, None, :] * dt[:, :t1, :, None]  # (b, t1, d, N)
    out = dt.new_zeros(b, d, t1 - t0, t1)
    if bool((log_a > 0).any()):  # a growing state: the direct form throughout
        out[:] = torch.einsum("btN,bdNts,bsdN->bdts", C[:, t0:t1], _decay(log_a, t0, t1), Bdt)
        return _plus_diagonal(out, D, t0, t1)
    cum = log_a.cumsum(-1)
    span = _SPAN[cum.dtype == torch.float64]

    def product(r0: int, r1: int, c0: int, c1: int) -> None:  # rows [r0, r1), columns [c0, c1), ref cum_{r0−1}
        ref = cum[..., r0 - 1: r0] if r0 > 0 else torch.zeros_like(cum[..., :1])
        left = C[:, None, r0:r1] * torch.exp(cum[..., r0:r1] - ref).transpose(-1, -2)  # (b, d, rows, N)
        right = Bdt[:, c0:c1].transpose(1, 2) * torch.exp(ref - cum[..., c0:c1]).transpose(-1, -2)
        out[:, :, r0 - t0: r1 - t0, c0:c1] = left @ right.transpose(-1, -2)

    if t0 > 0:
        product(t0, t1, 0, t0)
    for q0 in range(t0, t1, sub):
        q1 = min(t1, q0 + sub)
        ref = cum[..., q0 - 1: q0] if q0 > 0 else torch.zeros_like(cum[..., :1])
        if bool(((ref - cum[..., q1 - 1: q1]) < span).all()):
            product(q0, q1, t0, q1)
            t = torch.arange(q1 - q0, device=dt.device)
            out[:, :, q0 - t0: q1 - t0, q0:q1].masked_fill_(t[None, :] > t[:, None], 0.0)
            continue
        if q0 > t0:
            product(q0, q1, t0, q0)
        out[:, :, q0 - t0: q1 - t0, q0:q1] = torch.einsum(
            "btN,bdNts,bsdN->bdts", C[:, q0:q1], _decay(log_a[..., q0:q1]), Bdt[:, q0:q1])
    return _plus_diagonal(out, D, t0, t1)


def _plus_diagonal(out: torch.Tensor, D: torch.Tensor | None, t0: int, t1: int) -> torch.Tensor:
    """Rows [t0, t1) of per-channel matrices (b, d, t1-t0, ≥ t1) plus the skip D (d,) on the diagonal."""
    if D is not None:
        idx = torch.arange(t0, t1, device=out.device)
        out[:, :, idx - t0, idx] += D.to(out.dtype)[None, :, None]
    return out


#: How far (in log units) the decays over ``sub`` rows may span for :func:`selective_block` to factor their own
#: columns: float32 (index 0), float64 (index 1); the factors > 1 stay below exp(span).
_SPAN = (60.0, 600.0)


class SelectiveRows(MixerRows):
    """Mamba's selective scan as a :class:`MixerRows` layer, per channel d: K_d = diag(gate_out_d) · M_d ·
    diag(gate_in_d) · T_d (:func:`selective_block`; the output gate SiLU(z) on the rows, the convolution of
    ``weight`` and the SiLU's σ(u) folded, as the dense record's layer).

    C, B: (b, n, N); dt: (b, n, d); A: (d, N); D: (d,) or None; gate_out, gate_in: (b, n, d); weight: (d, K)."""

    def __init__(self, C, B, dt, A, D, gate_out, gate_in, weight, heads: int = 1, rows: int = 64):
        super().__init__(C.shape[0], C.shape[1], C.device, heads, rows)
        self.C, self.B, self.dt, self.A, self.D, self.gate_out = C, B, dt, A, D, gate_out
        self.gate_in, self.weight, self.groups, self.inner = gate_in, weight, dt.shape[-1], C.shape[-1]

    def group_rows(self, t0: int, t1: int, g0: int, g1: int) -> torch.Tensor:
        D = None if self.D is None else self.D[g0:g1]
        M = selective_block(self.C, self.B, self.dt[..., g0:g1], self.A[g0:g1], D, t0, t1)
        return M * self.gate_out[:, t0:t1, g0:g1].transpose(1, 2)[..., None].to(M.dtype)


class DeltaRows(MixerRows):
    """Gated DeltaNet / KDA as a :class:`MixerRows` layer, per value channel c of head h:
    K_c = W_h · diag(gate_in_c) · T_c (:func:`delta_matrix`; the convolution and the SiLU's σ(u) folded).

    The rows [t0, t1) of W_h come from a scan over the state, never the full matrix: the block's own columns are
    the delta rule on the block's tokens alone, which also gives U_t = A_{t0} ··· A_t q_t
    (A_r = diag(α_r)(I − β_r k_r k_rᵀ)); the earlier columns are W[t, s] = x_sᵀ U_t with
    x_sᵀ = β_s k_sᵀ A_{s+1} ··· A_{t0−1}, the rows X (b, h, t0, dk) of a state carried forward block by block
    (X ← X · A_{t0} ··· A_{t1−1}, the new tokens' rows appended). Each block is taken at once in the chunkwise
    (WY) form (:func:`_delta_block`, every block of the sweep at once: matrix products and one triangular inverse
    per block, no loop over tokens); a block whose per-channel decays span past ``_SPAN`` takes the delta rule
    token by token (:func:`_delta_local`, :meth:`_advance_tokens`). Memory O(n·(dk + rows)) per head, O(rows·n) per
    block; blocks taken in order advance X (an earlier block restarts it).

    q, k: (b, n, h, dk) as the recurrence reads them; beta: (b, n, h); g: (b, n, h) or (b, n, h, dk) (KDA's
    per-key-channel decay); gate_in: (b, n, h·dv); weight: (h·dv, K)."""

    def __init__(self, q, k, beta, g, gate_in, weight, heads: int = 1, rows: int = 64):
        b, n, h, dk = q.shape
        super().__init__(b, n, q.device, heads, rows)
        self.qh, self.kh, self.bh = q.transpose(1, 2), k.transpose(1, 2), beta.transpose(1, 2)
        gh = g.transpose(1, 2)
        self.gh = gh[..., None] if g.ndim == 3 else gh  # log α: (b, h, n, 1 or dk)
        self.ah = self.gh.exp()
        self.gate_in, self.weight, self.groups, self.heads_of = gate_in, weight, h, gate_in.shape[-1] // h
        self.state = q.new_zeros(b, h, n, dk)  # rows x_s, s < self.at
        self.at = 0
        self._kept: tuple[int, tuple[torch.Tensor, ...]] | None = None  # (rows, :meth:`_chunks`)

    def advance(self, t0: int) -> None:
        """Carry the state's rows X to the boundary t0 (x_sᵀ = β_s k_sᵀ A_{s+1} ··· A_{t0−1} for s < t0), ``rows``
        tokens at a time: X ← X·(Γ − K̄ᵀ·Y) and the new rows Y (:func:`_delta_block`)."""
        if t0 < self.at:
            self.at = 0
        while self.at < t0:
            e0, e1 = self.at, min(t0, self.at + self.rows)
            blk = self._block(e0, e1, 0, self.groups)
            if blk is None:
                self._advance_tokens(e0, e1)
            else:
                dt = self.state.dtype
                _, _, Y, Kbar, end = (p.to(dt) for p in blk)
                if e0:  # X·(A_{e0} ··· A_{e1−1}) = X·(Γ − K̄ᵀ·Y), the product formed first (dk × dk)
                    P = torch.diag_embed(end[..., 0, :].exp().expand(*Y.shape[:2], Y.shape[-1]))
                    self.state[:, :, :e0] = self.state[:, :, :e0] @ P.sub_(Kbar.transpose(-1, -2) @ Y)
                self.state[:, :, e0:e1] = Y
            self.at = e1

    def _advance_tokens(self, e0: int, e1: int) -> None:
        """:meth:`advance` over tokens [e0, e1) one token at a time: Z = [I; new rows] times each A_r in turn,
        then X ← X · Z[:dk]."""
        b, h, _, dk = self.qh.shape
        Z = self.qh.new_zeros(b, h, dk + e1 - e0, dk)
        Z[:, :, :dk] = torch.eye(dk, dtype=Z.dtype, device=Z.device)
        for r in range(e0, e1):
            live = Z[:, :, : dk + r - e0]
            Za = live * self.ah[:, :, r, None, :]
            kr, br = self.kh[:, :, r], self.bh[:, :, r, None, None]
            live.copy_(Za - br * (Za @ kr[..., None]) * kr[:, :, None, :])
            Z[:, :, dk + r - e0] = self.bh[:, :, r, None] * kr
        if e0:
            self.state[:, :, :e0] = self.state[:, :, :e0] @ Z[:, :, :dk]
        self.state[:, :, e0:e1] = Z[:, :, dk:]

    def _block(self, t0: int, t1: int, g0: int, g1: int) -> tuple[torch.Tensor, ...] | None:
        """:func:`_delta_block` of tokens [t0, t1) and heads [g0, g1) (W, U, Y, K̄, cum at the end), from
        :meth:`_chunks` when [t0, t1) is one of the sweep's blocks; None when per-channel decays span too far."""
        R = self.rows
        if t0 % R == 0 and t1 == min(self.n, t0 + R):
            j, m = t0 // R, t1 - t0
            W, U, Y, Kbar, end, fits = (p[:, g0:g1, j] for p in self._chunks())
            return (W[..., :m, :m], U[..., :m, :], Y[..., :m, :], Kbar[..., :m, :], end) if bool(fits.all()) else None
        sl = (slice(None), slice(g0, g1), slice(t0, t1))
        *parts, fits = _delta_block(self.qh[sl], self.kh[sl], self.bh[sl], self.gh[sl])
        return tuple(parts) if bool(fits.all()) else None

    def _chunks(self) -> tuple[torch.Tensor, ...]:
        """:func:`_delta_block` of every block [j·rows, (j+1)·rows) at once (b, h, blocks, ...), kept while ``rows``
        stays; the last block padded with tokens that change nothing (q = k = 0, β = 0, α = 1). O(n·(rows + dk))
        per head."""
        if self._kept is None or self._kept[0] != self.rows:
            b, h, n, _ = self.qh.shape
            R = self.rows
            C = -(-n // R)

            def chunked(x: torch.Tensor) -> torch.Tensor:
                x = torch.nn.functional.pad(x, (0, 0, 0, C * R - n))
                return x.reshape(b, h, C, R, x.shape[-1])

            q, k, g = chunked(self.qh), chunked(self.kh), chunked(self.gh)
            beta = chunked(self.bh[..., None])[..., 0]
            self._kept = (R, _delta_block(q, k, beta, g))
        return self._kept[1]

    def apply_rows(self, r: torch.Tensor, *, a: float, c: float, renorm: bool = False,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        try:
            return super().apply_rows(r, a=a, c=c, renorm=renorm, mask=mask)
        finally:
            self._kept = None  # the blocks' parts (:meth:`_chunks`) are kept for one sweep only

    def group_rows(self, t0: int, t1: int, g0: int, g1: int) -> torch.Tensor:
        self.advance(t0)
        blk = self._block(t0, t1, g0, g1)
        if blk is None:
            W, U = _delta_local(self.qh[:, g0:g1, t0:t1], self.kh[:, g0:g1, t0:t1], self.bh[:, g0:g1, t0:t1],
                                self.ah[:, g0:g1, t0:t1])
        else:
            W, U = blk[0].to(self.qh.dtype), blk[1].to(self.qh.dtype)
        out = W.new_zeros(W.shape[0], g1 - g0, t1 - t0, t1)
        out[..., t0:] = W
        if t0:
            out[..., :t0] = U @ self.state[:, g0:g1, :t0].transpose(-1, -2)
        return out


def _delta_pairs(xs: tuple[torch.Tensor, ...], y: torch.Tensor, cum: torch.Tensor) -> list[torch.Tensor]:
    """P[t, s] = Σ_c x_t[c] y_s[c] exp(cum_t[c] − cum_s[c]) for s ≤ t, 0 above, for each x of ``xs``: (..., R, R)
    from x, y (..., R, dk) and cumulative log-decays cum (..., R, 1 or dk). One decay per head: the R×R decays
    direct (any range, one exponential per entry shared by the xs); per key channel: factored,
    (x e^{cum}) · (y e^{−cum})ᵀ (exact while |cum| < ``_SPAN``, neither factor leaving the range)."""
    R = y.shape[-2]
    above = torch.ones(R, R, dtype=torch.bool, device=y.device).triu(1)
    if cum.shape[-1] == 1:
        E = (cum - cum.transpose(-1, -2)).masked_fill_(above, float("-inf")).exp_()
        return [(x @ y.transpose(-1, -2)).mul_(E) for x in xs]
    right = (y * torch.exp(-cum)).transpose(-1, -2)
    return [((x * cum.exp()) @ right).masked_fill_(above, 0.0) for x in xs]


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """The inverse of unit lower triangular matrices L (..., R, R) by doubling: the inverses of the diagonal blocks
    of size b give those of size 2b, [[A, 0], [C, D]]^{-1} = [[A^{-1}, 0], [−D^{-1} C A^{-1}, D^{-1}]] (batched
    matrix products, log2 R steps; R padded to a power of two with the identity)."""
    R = L.shape[-1]
    P = 1 << max(0, R - 1).bit_length()
    if P != R:
        L = torch.nn.functional.pad(L, (0, P - R, 0, P - R))
        L[..., R:, R:] = torch.eye(P - R, dtype=L.dtype, device=L.device)
    lead = L.shape[:-2]
    X = torch.ones(*lead, P, 1, 1, dtype=L.dtype, device=L.device)  # the inverses of the 1×1 diagonal blocks
    b = 1
    while b < P:
        m = P // (2 * b)
        C = L.reshape(*lead, m, 2 * b, m, 2 * b).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)[..., b:, :b]
        Ai, Di = X[..., 0::2, :, :], X[..., 1::2, :, :]
        X = torch.cat([torch.cat([Ai, torch.zeros_like(Ai)], -1), torch.cat([-(Di @ C @ Ai), Di], -1)], -2)
        b *= 2
    return X[..., 0, :R, :R]


def _delta_block(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor,
                 g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The delta rule over a block of R tokens at once (the chunkwise, WY form): q, k (..., R, dk), β (..., R),
    log α g (..., R, 1 or dk). With A_r = diag(α_r)(I − β_r k_r k_rᵀ), the block's tokens 0..R−1, γ_t = e^{cum_t}
    (cum the log-decays summed from the block's start, Γ_t = diag(γ_t)) and K̄ the rows γ_t ∘ k_t:

        W[t, s] = β_s k_sᵀ A_{s+1} ··· A_t q_t = (Q·T)[t, s],  Q[t, s] = k_sᵀ Γ_t Γ_s^{-1} q_t (s ≤ t)
        U_t = A_0 ··· A_t q_t = γ_t ∘ q_t − Σ_s W[t, s] K̄_s
        A_0 ··· A_{R−1} = Γ_{R−1} − K̄ᵀ·Y,   Y[s] = β_s k_sᵀ A_{s+1} ··· A_{R−1} = (Tᵀ·K_end)[s]

    with T = (I + diag(β)·G)^{-1}·diag(β), G[t, s] = k_sᵀ Γ_t Γ_s^{-1} k_t for s < t (unit lower triangular:
    :func:`_unit_lower_inverse`) and K_end the rows γ_{R−1}/γ_s ∘ k_s: the delta rule's state
    S_t = A_tᵀ S_{t−1} + β_t k_t v_tᵀ started at I with one-hot values, whose scaled form Γ_t^{-1} S_t adds one
    rank-one term per token.
    Returns (W, U, Y, K̄, cum_{R−1} (..., 1, 1 or dk)) in float32 or wider and ``fits`` (...): False where the
    decays are not finite or, per key channel, span past ``_SPAN`` (those blocks' parts are not to be used)."""
    dt = torch.promote_types(k.dtype, torch.float32)
    q, k, beta, cum = q.to(dt), k.to(dt), beta.to(dt), g.to(dt).cumsum(-2)
    fits = cum.isfinite().flatten(-2).all(-1)
    if cum.shape[-1] > 1:
        fits &= (cum.abs() < _SPAN[dt == torch.float64]).flatten(-2).all(-1)
    G, Q = _delta_pairs((k, q), k, cum)
    G.mul_(beta[..., None]).diagonal(dim1=-2, dim2=-1).fill_(1.0)  # I + diag(β)·G, G strictly lower
    T = _unit_lower_inverse(G).mul_(beta[..., None, :])
    Kbar = k * cum.exp()
    W = Q @ T
    end = cum[..., -1:, :]
    Y = T.transpose(-1, -2) @ (k * torch.exp(end - cum))
    return W, q * cum.exp() - W @ Kbar, Y, Kbar, end, fits


class ConvRows(MixerRows):
    """A gated short causal convolution (LFM2) as a :class:`MixerRows` layer: M_c[t, s] = post[t, c] ·
    weight[c, K-1-(t-s)] · pre[s, c] for 0 ≤ t − s < K (:func:`conv_matrix`), banded: each block's Σ_c |M_c| is K
    diagonals, O(rows·K·d). weight: (d, K); pre, post: (b, n, d) or None."""

    def __init__(self, weight, pre=None, post=None, n: int | None = None, heads: int = 1, rows: int = 64):
        like = post if post is not None else pre
        if like is not None:
            b, length = int(like.shape[0]), int(like.shape[1])
        elif n is not None:
            b, length = 1, int(n)
        else:
            raise ValueError("ConvRows needs the length n when neither pre nor post is given")
        super().__init__(b, length, weight.device, heads, rows)
        self.conv_weight, self.pre, self.post = weight, pre, post

    def block(self, t0: int, t1: int) -> torch.Tensor:
        d, K = self.conv_weight.shape
        dtype = self.conv_weight.dtype if self.post is None else self.post.dtype
        out = torch.zeros(self.batch, t1 - t0, t1, dtype=dtype, device=self.device)
        t = torch.arange(t0, t1, device=self.device)
        post = torch.ones(self.batch, t1 - t0, d, dtype=dtype, device=self.device) if self.post is None else \
            self.post[:, t0:t1].abs()
        for lag in range(min(K, t1)):
            ok = t >= lag
            s = t[ok] - lag
            pre = 1 if self.pre is None else self.pre[:, s].abs()
            out[:, (t - t0)[ok], s] = (post[:, ok] * pre) @ self.conv_weight[:, K - 1 - lag].abs().to(dtype)
        return out


class LRURows(MixerRows):
    """A diagonal linear recurrence (RG-LRU) as a :class:`MixerRows` layer, per channel d: K_d = diag(gate_out_d) ·
    (M_d ∘ [same segment]) · T_d with M_d = :func:`lru_matrix`'s (rows [t0, t1) from the block's cumulative decays),
    the convolution of ``weight`` folded (no gate on its output).

    log_a, scale, gate_out: (b, n, d); weight: (d, K); segment: (b, n) ids, a path only within one (a restart
    cuts it), or None."""

    def __init__(self, log_a, scale, gate_out, weight, segment=None, heads: int = 1, rows: int = 64):
        super().__init__(log_a.shape[0], log_a.shape[1], log_a.device, heads, rows)
        self.log_a, self.scale, self.gate_out, self.segment = log_a, scale, gate_out, segment
        self.weight, self.groups = weight, log_a.shape[-1]

    def group_rows(self, t0: int, t1: int, g0: int, g1: int) -> torch.Tensor:
        M = _decay(self.log_a[:, :t1, g0:g1].transpose(1, 2), t0, t1)
        M = M * self.scale[:, :t1, g0:g1].transpose(1, 2)[:, :, None, :]
        if self.segment is not None:
            seg = self.segment
            M = M * (seg[:, None, t0:t1, None] == seg[:, None, None, :t1])
        return M * self.gate_out[:, t0:t1, g0:g1].transpose(1, 2)[..., None].to(M.dtype)
