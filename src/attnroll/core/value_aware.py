"""Value-aware contribution matrices of one transformer block: pure maths on tensors, no model.

A block is described by :class:`Block` (value / output weights, the two norms, where they sit, the MLP); the
caller supplies what the forward pass actually computed (the layer input ``x`` (B, n, d), the attention
probabilities ``alpha`` (B, H, n, n) and the actual pre-norm vectors). Notation of the papers:

    f^h(x_j) = (x̃_j W_V^h + b_V^h) W_O^h          x̃ = x (post-LN blocks) or norm1(x) (pre-LN blocks)
    z_{i←j}  = Σ_h α^h_ij f^h(x̃_j) + δ_ij x_j     so that Σ_j z_{i←j} + b_O = x_i + attention_i exactly

Every function takes and returns torch tensors of one floating dtype; rows of padded queries / columns of
padded keys are zeroed when an ``attention_mask`` (B, n) of 0/1 is given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from . import alti_kernel

__all__ = [
    "Norm", "Mlp", "Routed", "Block", "value_input", "mlp_terms", "linearised", "mlp_width", "with_rows",
    "norm_scale", "norm_share",
    "apply_norm", "value_outputs", "head_mix",
    "pairwise_norms", "normalize_rows", "cosine_distance", "mask_pairs",
]


@dataclass(frozen=True)
class Norm:
    """A LayerNorm (``rms=False``: (x − mean) / sqrt(var + eps) ⊙ γ + β) or an RMSNorm (``rms=True``:
    x / sqrt(mean(x²) + eps) ⊙ γ). ``weight`` γ and ``bias`` β are (d,) or None (1 and 0)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float
    rms: bool = False


@dataclass(frozen=True)
class Mlp:
    """The feed-forward branch: ``fc2(act(fc1(h)))``, or with ``gate`` (SwiGLU / GeGLU)
    ``fc2(act(gate(h)) ⊙ fc1(h))``. Weights (out, in) as ``nn.Linear``; biases (out,) or None; a layer scale
    after the branch is already folded into ``w2`` / ``b2``."""

    w1: torch.Tensor
    b1: torch.Tensor | None
    w2: torch.Tensor
    b2: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]
    wg: torch.Tensor | None = None
    bg: torch.Tensor | None = None
    up_act: Callable[[torch.Tensor], torch.Tensor] | None = None
    up_offset: float = 0.0


@dataclass(frozen=True)
class Routed:
    """A mixture-of-experts MLP with its routing held at the values the forward pass computed:
    MLP(h_i) = Σ_e weights[i, e] · experts[e](h_i), ``experts`` the routed experts then any shared ones (an
    :class:`Mlp` each), ``weights`` (..., E) aligned with the rows the MLP is applied to: the router's weight of
    each chosen expert, 0 for the others, a shared expert's gate value (or 1). Linear in what each expert is
    linear in, so every rule of a dense MLP applies per expert, weighted. ``weights`` None: not yet bound to a
    forward pass (:meth:`LayerAnatomy.block`'s ``routing``)."""

    experts: tuple[Mlp, ...]
    weights: torch.Tensor | None = None

    def bound(self) -> torch.Tensor:
        """The routing weights; ValueError when the MLP was never bound to a forward pass's routing."""
        if self.weights is None:
            raise ValueError("this mixture-of-experts MLP has no routing: bind the routing the forward pass "
                             "recorded (LayerStates.routing) before decomposing it")
        return self.weights


def mlp_width(mlp: "Mlp | Routed") -> int:
    """The widest hidden layer of the MLP (its fc1's outputs; an expert's for a mixture of experts)."""
    return max(m.w1.shape[0] for m in mlp.experts) if isinstance(mlp, Routed) else mlp.w1.shape[0]


def mlp_terms(mlp: Mlp, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ζ, coefficients, constant) of the MLP at its actual input h (..., d): MLP(h) = W2 (coef ⊙ ζ + const) + b2
    exactly, ζ = W1 h + b1. Dense: coef = θ = act(ζ)/ζ (DecompX's zero-origin slope); gated: coef = act(W_g h +
    b_g) held at its value, times the up path's zero-origin slope when it has an activation of its own (GPT-OSS's
    clamp), and const = coef_gate · ``up_offset`` (its + 1) or None."""
    pre = h @ mlp.w1.T + (0 if mlp.b1 is None else mlp.b1)
    if mlp.wg is None:
        return pre, linearised(mlp.act, pre), None
    gate = mlp.act(h @ mlp.wg.T + (0 if mlp.bg is None else mlp.bg))
    coef = gate if mlp.up_act is None else gate * linearised(mlp.up_act, pre)
    return pre, coef, (gate * mlp.up_offset if mlp.up_offset else None)


def linearised(act: Callable, pre: torch.Tensor) -> torch.Tensor:
    """θ = act(ζ) / ζ elementwise (0 where ζ = 0, where any θ gives the same product)."""
    nz = pre != 0
    return torch.where(nz, act(pre) / torch.where(nz, pre, torch.ones_like(pre)), torch.zeros_like(pre))


@dataclass(frozen=True)
class Block:
    """One transformer block's value path.

    ``wv`` (H_kv·d_h, d), ``bv`` (H_kv·d_h,) or None: the value projection; ``wo`` (d, H·d_h), ``bo`` (d,)
    or None: the output projection with any layer scale folded in. Query head h reads key/value head
    h // (H / H_kv) (grouped KV). ``pre_norm``: h' = x + Attn(norm1(x)), out = h' + MLP(norm2(h')); else
    (post-LN, BERT) h' = norm1(x + Attn(x)), out = norm2(h' + MLP(h')).
    """

    pre_norm: bool
    norm1: Norm
    norm2: Norm
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    heads: int
    kv_heads: int
    mlp: Mlp | Routed
    latent: tuple[torch.Tensor, torch.Tensor | None, Norm] | None = None

    @property
    def head_dim(self) -> int:
        return self.wv.shape[0] // self.kv_heads


def value_input(xv: torch.Tensor, block: Block) -> torch.Tensor:
    """What the value projection reads from xv (..., d): xv itself, or with ``latent`` = (W_a (r, d), b_a, norm)
    (multi-head latent attention, DeepSeek-V2 / V3) the normed latent norm(xv W_aᵀ + b_a), its divisor the
    token's own (frozen when decomposed, as every norm's)."""
    if block.latent is None:
        return xv
    wa, ba, norm = block.latent
    return apply_norm(xv @ wa.T + (0 if ba is None else ba), norm)


def with_rows(block: Block, take: Callable[[torch.Tensor], torch.Tensor]) -> Block:
    """``block`` for a subset or rearrangement of its rows: a mixture of experts' routing weights (B, n, E)
    mapped by ``take`` (the same indexing the caller applies to the rows); a dense MLP's block unchanged."""
    if not isinstance(block.mlp, Routed):
        return block
    return replace(block, mlp=replace(block.mlp, weights=take(block.mlp.bound())))


# ------------------------------------------------------------------------------------------- norms
def norm_scale(actual: torch.Tensor, norm: Norm) -> torch.Tensor:
    """The divisor the norm applied to the actual pre-norm vectors (..., d): sqrt(Var + eps) for a
    LayerNorm, sqrt(mean(x²) + eps) for an RMSNorm; shape (..., 1)."""
    if norm.rms:
        return (actual.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    return (actual.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()


def norm_share(share: torch.Tensor, scale: torch.Tensor, norm: Norm) -> torch.Tensor:
    """g(share) = (share − mean(share)) / scale ⊙ γ (LayerNorm; no centring for RMSNorm), β excluded.

    ``share`` (B, n, ..., d) are parts of the pre-norm vectors of rows n; ``scale`` (B, n, 1) is the actual
    divisor of each row (:func:`norm_scale`). Linear in ``share``: the shares of a row sum to the row's
    normalised vector minus β."""
    if not norm.rms:
        share = share - share.mean(-1, keepdim=True)
    extra = share.ndim - scale.ndim
    s = scale.reshape(scale.shape[:2] + (1,) * extra + (1,))
    out = share / s
    return out if norm.weight is None else out * norm.weight


def apply_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """The norm applied to actual vectors x (..., d) (what the model's own module computes)."""
    out = norm_share(x, norm_scale(x, norm), norm) if x.ndim >= 3 else _flat_norm(x, norm)
    return out if norm.bias is None else out + norm.bias


def _flat_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    return norm_share(x.unsqueeze(0), norm_scale(x, norm).unsqueeze(0), norm).squeeze(0)


# ------------------------------------------------------------------------------------------- value path
def value_outputs(xv: torch.Tensor, block: Block) -> torch.Tensor:
    """f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h for every token and head: xv (B, n, d) -> (B, n, H, d).

    ``xv`` is what the block's value path reads (norm1(x) for pre-LN blocks; a latent block's projection and norm
    applied here, :func:`value_input`). b_O is not included."""
    B, n, _ = xv.shape
    v = value_input(xv, block) @ block.wv.T
    if block.bv is not None:
        v = v + block.bv
    v = v.view(B, n, block.kv_heads, block.head_dim)
    if block.heads != block.kv_heads:
        v = v.repeat_interleave(block.heads // block.kv_heads, dim=2)
    wo = block.wo.view(block.wo.shape[0], block.heads, block.head_dim)
    return torch.einsum("bnhe,dhe->bnhd", v, wo)


def head_mix(alpha: torch.Tensor, F: torch.Tensor, x: torch.Tensor | None = None,
             rows: torch.Tensor | None = None) -> torch.Tensor:
    """z_{i←j} = Σ_h α^h_ij f^h(x_j) (+ δ_ij x_j when ``x`` (B, n, d) is given): (B, n_i, n_j, d).

    alpha (B, H, n, n), F (B, n, H, d) from :func:`value_outputs`; ``rows`` (r,) long restricts i."""
    a = alpha if rows is None else alpha[:, :, rows]
    z = torch.einsum("bhij,bjhd->bijd", a, F)
    if x is not None:
        idx = torch.arange(x.shape[1], device=x.device) if rows is None else rows
        ar = torch.arange(len(idx), device=x.device)
        z[:, ar, idx] += x[:, idx]
    return z


def pairwise_norms(alpha: torch.Tensor, F: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
    """‖z_{i←j}‖₂ (B, n, n) without forming the (B, n, n, d) vectors.

    ‖Σ_h α^h_ij f^h_j‖² = Σ_{h,g} α^h_ij α^g_ij ⟨f^h_j, f^g_j⟩ (a per-token H×H Gram matrix), and with the
    residual on the diagonal + ‖x_i‖² + 2 Σ_h α^h_ii ⟨x_i, f^h_i⟩. Apply any linear map (a norm's share map
    without its per-row scale) to F and x before calling."""
    gram = torch.einsum("bjhd,bjgd->bjhg", F, F)
    sq = torch.einsum("bhij,bjhg,bgij->bij", alpha, gram, alpha)
    if x is not None:
        diag_alpha = torch.diagonal(alpha, dim1=-2, dim2=-1)  # (B, H, n)
        cross = torch.einsum("bhi,bihd,bid->bi", diag_alpha, F, x)
        extra = x.pow(2).sum(-1) + 2 * cross
        sq = sq + torch.diag_embed(extra)
    return sq.clamp(min=0).sqrt()


def mask_pairs(C: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the rows and columns of padded tokens of C (B, n, n) (mask (B, n) of 0/1; None = keep all)."""
    if attention_mask is None:
        return C
    m = attention_mask.to(C.dtype)
    return C * m[:, :, None] * m[:, None, :]


def normalize_rows(C: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of C (B, n, n) divided by their sums; a row summing to 0 stays 0 (no NaN), and padded rows /
    columns are zeroed first, so nothing flows to or from padding."""
    C = mask_pairs(C, attention_mask)
    s = C.sum(-1, keepdim=True)
    return torch.where(s > 0, C / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(C))


def cosine_distance(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """1 − cos(a, b) over the last axis (broadcasting); 0 where either vector is 0."""
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    dot = (a * b).sum(-1)
    ok = (na > eps) & (nb > eps)
    cos = dot / torch.where(ok, na * nb, torch.ones_like(na))
    return torch.where(ok, (1 - cos).clamp(min=0), torch.zeros_like(cos))


# ------------------------------------------------------------------------------------------- per-layer matrices
def _share_map(v: torch.Tensor, norms: list[tuple[Norm, torch.Tensor]]) -> torch.Tensor:
    """The chain of norms' share maps without their per-row scales (centring and γ only)."""
    for norm, _ in norms:
        if not norm.rms:
            v = v - v.mean(-1, keepdim=True)
        if norm.weight is not None:
            v = v * norm.weight
    return v


def norm_matrix(alpha: torch.Tensor, F: torch.Tensor, x: torch.Tensor | None = None,
                norms: list[tuple[Norm, torch.Tensor]] | None = None) -> torch.Tensor:
    """N_ij = ‖g(z_{i←j})‖ (B, n, n) for one layer.

    Without ``x``: Kobayashi et al. 2020's ‖Σ_h α^h_ij f^h(x_j)‖; with ``x`` (B, n, d) the residual joins
    the diagonal (2021's AttnRes-N); ``norms`` = [(norm, actual pre-norm vectors (B, n, d)), ...] pushes the
    vectors through those norms in order as they act on the actual vectors (GlobEnc), β excluded."""
    norms = norms or []
    Fm = _share_map(F, norms)
    xm = None if x is None else _share_map(x, norms)
    N = pairwise_norms(alpha, Fm, xm)
    for norm, actual in norms:
        N = N / norm_scale(actual, norm)
    return N


def _mixed_by_key(alpha: torch.Tensor, F: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Σ_h α^h_ij f^h_j laid out (B, n_j, r, d) for the rows i in ``rows``: one batched matmul over (b, j)
    with the heads as the inner dimension, written contiguously (no permuted copy)."""
    a = alpha[:, :, rows].permute(0, 3, 2, 1)  # (B, n_j, r, H)
    return torch.matmul(a, F)  # (B, n_j, H, d) -> (B, n_j, r, d)


ALTI_KERNELS = ("auto", "fused", "torch")


def alti_matrix(alpha: torch.Tensor, F: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                norm: tuple[Norm, torch.Tensor] | None = None, chunk: int | None = None,
                kernel: str = "auto") -> torch.Tensor:
    """ALTI's contributions (B, n, n), rows not yet normalised.

    T_i(x_j) = g(z_{i←j}) (``norm`` = (norm, its actual input) for post-LN blocks; None for pre-LN blocks,
    where T_i(x_j) = z_{i←j} on the residual stream) and c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁) with
    y (B, n, d) the actual output the shares add up to (b_O and β included).

    g is linear up to the row's divisor σ_i: g(z_{i←j}) = (Σ_h α^h_ij G^h_j + δ_ij g₀(x_j)) / σ_i with
    G = g₀(F) (centring and γ, per key token), so c_ij = max(0, ‖σ_i y_i‖₁ − ‖σ_i y_i − σ_i T_i(x_j)‖₁) / σ_i
    and both norm kinds share one kernel. ``kernel``: "fused" (:mod:`alti_kernel`, needs numba), "torch"
    (``chunk`` rows at a time through a (B, n, chunk, d) buffer) or "auto" (fused where it can run)."""
    if kernel not in ALTI_KERNELS:
        raise ValueError(f"kernel must be one of {ALTI_KERNELS}; got {kernel!r}")
    scale = None
    if norm is not None:
        scale = norm_scale(norm[1], norm[0])  # (B, n, 1)
        F, x, y = _share_map(F, [norm]), _share_map(x, [norm]), y * scale
    fused = kernel == "fused" or (kernel == "auto" and alti_kernel.supports(F) and alti_kernel.available())
    C = alti_kernel.contributions(alpha, F, x, y) if fused else _alti_chunks(alpha, F, x, y, chunk)
    # T_i(x_j) = 0 exactly where no head attends j from i (causal or padded keys): c_ij = 0, not rounding.
    linked = (alpha != 0).any(1) | torch.eye(x.shape[1], dtype=torch.bool, device=x.device)
    C = C * linked
    return C if scale is None else C / scale


def _alti_chunks(alpha: torch.Tensor, F: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 chunk: int | None) -> torch.Tensor:
    """The torch kernel of :func:`alti_matrix` (pre-LN form: T_i(x_j) = Σ_h α^h_ij F^h_j + δ_ij x_j):
    ``chunk`` rows at a time; the one (B, n_j, chunk, d) intermediate is reused in place."""
    n = x.shape[1]
    step = n if chunk is None else max(1, int(chunk))
    y1 = y.abs().sum(-1)  # (B, n)
    out = []
    for start in range(0, n, step):
        rows = torch.arange(start, min(n, start + step), device=x.device)
        T = _mixed_by_key(alpha, F, rows)  # (B, n_j, r, d)
        local = torch.arange(len(rows), device=x.device)
        T[:, rows, local] += x[:, rows]  # the residual: j = i
        dist = T.sub_(y[:, rows].unsqueeze(1)).abs_().sum(-1)  # ‖T_i(x_j) − y_i‖₁, (B, n_j, r)
        out.append((y1[:, rows].unsqueeze(1) - dist).clamp_(min=0).transpose(1, 2))
    return torch.cat(out, dim=1)


def value_zeroing_matrix(alpha: torch.Tensor, F: torch.Tensor, x: torch.Tensor, attn: torch.Tensor,
                         out: torch.Tensor, finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         chunk: int | None = None) -> torch.Tensor:
    """Value zeroing (Mohebbi et al. 2023) for one layer: C_ij = cosine distance between the block's
    output at i with token j's value vectors zeroed in every head and its actual output ``out``.

    Zeroing v_j leaves the attention probabilities unchanged and removes Σ_h α^h_ij f^h(x_j) from the
    attention output ``attn`` (B, n, d) of every row i; ``finish(x, attn')`` runs the rest of the block.
    Batched over ``chunk`` zeroed tokens at a time. Returns (B, n_i, n_j)."""
    B, n, d = x.shape
    step = n if chunk is None else max(1, int(chunk))
    cols = []
    for start in range(0, n, step):
        js = torch.arange(start, min(n, start + step), device=x.device)
        removed = torch.matmul(alpha[:, :, :, js].permute(0, 3, 2, 1), F[:, js])  # (B, c, n_i, d)
        new = finish(x.unsqueeze(1).expand(B, len(js), n, d), attn.unsqueeze(1) - removed)
        cols.append(cosine_distance(new, out.unsqueeze(1)).transpose(1, 2))
    return torch.cat(cols, dim=2)
