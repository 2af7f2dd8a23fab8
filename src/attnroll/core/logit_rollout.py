"""Logit contributions of the attention updates, rolled out through per-layer mixing matrices: the maths of
ALTI-Logit (Ferrando, Gállego, Tsiamas & Costa-jussà, ACL 2023), for pre-norm and post-LN transformers. Pure
tensors.

On a pre-norm stack the readout row r's final vector is a sum of residual updates, x^L_r = x^0_r +
Σ_l (attention_l(r) + mlp_l(r)); the head w_c · norm_f(x^L_r) + b_c, with the final norm's divisor frozen at
its actual value, is linear in each update. Token j's direct logit contribution at layer l is

    Δ^l_j = ω · Σ_h α^h_rj f^h(x̃^l_j),      ω = (γ ⊙ w_c − mean(γ ⊙ w_c)) / σ(x^L_r)   (RMSNorm: no centring)

and it is carried to the input tokens by the mixing of the layers below, R^l = C_{l−1} ⋯ C_0 (R^0 = I):
score_k = Σ_l Σ_j Δ^l_j R^l_jk.

On a post-LN stack (BERT) no update reaches the head directly: block l maps the readout row's stream a^l_r =
x^l_r + Attn_l(r) to x^{l+1}_r = LN2(h + MLP(h)) + ..., h = LN1(a^l_r). With every norm's divisor frozen at its
actual value and the MLP either linearised per element at its actual pre-activation (θ = act(ζ)/ζ, as
DecompX; ``mlp="linearised"``) or kept as an update of its own (``mlp="update"``: MLP(h_r) enters LN2 as a
term that is not attributed, as the paper treats MLP updates), each block is affine in a^l_r, so the logit is
y = ω^0 · x^0_r + Σ_l ω^l · Attn_l(r) + Σ_l (bias and MLP terms of block l) + the head's constant, with one
direction ω^l per layer carried down by the transposed linear parts (:func:`layer_directions`):

    u = g2ᵀ ω^{l+1},   v = u + W1ᵀ (θ ⊙ W2ᵀ u)  (linearised; v = u for "update"),   ω^l = g1ᵀ v

where gᵀ(w) = (γ ⊙ w − mean(γ ⊙ w)) / σ is a LayerNorm's share map transposed (:func:`head_direction`).
Δ^l_j = ω^l · Σ_h α^h_rj f^h(x^l_j) as above, now with ω^l per layer.

A head that pools rows (DINOv2's [CLS ; mean of the patch rows], timm's mean of the patch rows with or
without fc_norm) is still linear in the top stream once every norm's divisor is frozen (each row's own, and
the pooled vector's): y = Σ_r ω_r · x^L_r + c, each read row r with its own direction
ω_r = g_rᵀ(Σ_g p_g[r] ω_g) (:func:`pooled_head_linear`; p_g the pooling part's row weights, ω_g its share of
the pooled direction). Every read row is then carried down as above (:func:`layer_directions` per row) and
its attention updates add up: Δ^l_j = Σ_r ω^l_r · Σ_h α^h_rj f^h(x̃^l_j) (:func:`direct_logit`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .decompx import linearised
from .value_aware import Block, Mlp, Norm, Routed, apply_norm, mlp_terms, norm_scale

__all__ = ["head_direction", "direct_logit", "logit_rollout", "head_linear", "pooled_head_linear",
           "layer_directions", "MLP_RULES"]

#: How a post-LN block's MLP is treated (see module).
MLP_RULES = ("linearised", "update")


def head_direction(w: torch.Tensor, norm: Norm | None, actual: torch.Tensor) -> torch.Tensor:
    """ω (..., d) with w_c · g(v) = ω · v for every v, where g is the final norm's share map with the divisor
    of the actual read vector (β excluded). ``w`` (..., d) the target class's classifier row per example (or
    per read row); ``actual`` (..., d) the vector(s) the norm actually reads; ``norm`` None = no final norm (ω = w)."""
    if norm is None:
        return w
    wg = w if norm.weight is None else w * norm.weight
    if not norm.rms:
        wg = wg - wg.mean(-1, keepdim=True)
    return wg / norm_scale(actual, norm)


def direct_logit(alpha_row: torch.Tensor, F: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Δ_j = Σ_r Σ_h α^h_rj (f^h_j · ω_r) (B, n) for one layer: ``F`` (B, n, H, d) the value-output vectors
    f^h(x̃_j) (b_O excluded); one readout row, ``alpha_row`` (B, H, n) its attention and ``omega`` (B, d), or
    the R rows a pooled head reads, ``alpha_row`` (B, H, R, n) and ``omega`` (B, R, d) each row's direction."""
    if omega.ndim == 2:
        alpha_row, omega = alpha_row.unsqueeze(2), omega.unsqueeze(1)
    # f^h_j · ω_r first ((B, H, R, n), the size of the rows' attention), then weighted by α and summed
    return (alpha_row * torch.einsum("bjhd,brd->bhrj", F, omega)).sum((1, 2))


def logit_rollout(deltas: Sequence[torch.Tensor], mixing: Sequence[torch.Tensor]) -> torch.Tensor:
    """score (B, n) = Σ_l Δ^l · C_{l−1} ⋯ C_0 from per-layer rows ``deltas`` (L × (B, n)) and mixing matrices
    ``mixing`` (L entries, (B, n, n); the last is never read and may be None), by Horner's rule right to left:
    O(L·n²)."""
    if len(deltas) == 0 or len(mixing) != len(deltas):
        raise ValueError(f"deltas and mixing must hold one entry per layer (>= 1), got {len(deltas)} and {len(mixing)}")
    s = deltas[-1]
    for l in range(len(deltas) - 2, -1, -1):
        s = torch.einsum("bi,bij->bj", s, mixing[l]) + deltas[l]
    return s


def _dot(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | float:
    """Row-wise a · b for a (..., d) and a vector b (d,) (0 when b is None)."""
    return 0.0 if b is None else a @ b


def head_linear(w: torch.Tensor, b: torch.Tensor | None, *, final_norm: Norm | None, pooler: tuple | None,
                actual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ω (B, d), c (B,)) with the head's logit y = ω · x + c at the vector x = ``actual`` (B, d) it reads:
    the final norm's divisor frozen (β into c), a pooler act(W x + b) linearised per element at its actual
    pre-activation z (θ = act(z)/z, DecompX's rule; its bias into c), then the classifier row ``w`` (B, d_c)
    and its bias ``b`` (B,) or None. Exact at ``actual`` by construction."""
    c = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b.clone()
    v = actual if final_norm is None else apply_norm(actual, final_norm)
    if pooler is not None:
        W, bp, act = pooler
        z = v @ W.T + (0 if bp is None else bp)
        w = w * linearised(act, z)
        c = c + _dot(w, bp)
        w = w @ W
    if final_norm is not None:
        c = c + _dot(w, final_norm.bias)
        w = head_direction(w, final_norm, actual)
    return w, c


def pooled_head_linear(w: torch.Tensor, b: torch.Tensor | None, *, pools: Sequence[torch.Tensor],
                       token_norm: Norm | None, final_norm: Norm | None, pooler: tuple | None,
                       actual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ω (B, n, d), c (B,)) with the logit y = Σ_r ω_r · x_r + c at the rows x = ``actual`` (B, n, d) of the
    top stream, for a head that pools rows: each row through ``token_norm`` (its own divisor frozen), the G
    parts v_g = Σ_r p_g[r] norm(x_r) (``pools``: G row weights (B, n)) concatenated, then :func:`head_linear`
    (``final_norm`` on the pooled vector, e.g. timm's fc_norm, its divisor frozen at the pooled vector's; the
    pooler; the classifier row ``w`` (B, G·d), bias ``b``). Row r's direction is the transposed norm map of
    Σ_g p_g[r] ω_g, ω_g the pooled direction's part g; the token norm's β joins c. Exact at ``actual``."""
    h = actual if token_norm is None else apply_norm(actual, token_norm)
    v = torch.cat([torch.einsum("bn,bnd->bd", p, h) for p in pools], dim=-1)
    omega, c = head_linear(w, b, final_norm=final_norm, pooler=pooler, actual=v)
    d = actual.shape[-1]
    rows = torch.zeros_like(actual)
    for g, p in enumerate(pools):
        rows = rows + p.unsqueeze(-1) * omega[:, None, g * d:(g + 1) * d]
    if token_norm is None:
        return rows, c
    if token_norm.bias is not None:  # an RMSNorm has no β
        c = c + (rows @ token_norm.bias).sum(-1)
    return head_direction(rows, token_norm, actual), c


def _mlp_back(m: Mlp | Routed, h: torch.Tensor, u: torch.Tensor,
              rule: str) -> tuple[torch.Tensor | None, torch.Tensor | float, torch.Tensor | float]:
    """One MLP branch read backwards from the direction u (B, d) on its output, at its actual input h (B, d):
    (the direction on h or None, its bias terms (B,), its update term (B,)). "linearised": back = W1ᵀ(θ ⊙ W2ᵀu),
    bias u·b2 + (θ ⊙ W2ᵀu)·b1 + (W2ᵀu)·const; "update": no direction, term u · MLP(h). A mixture of experts
    (routing (B, E) held at its values) sums its experts' parts, each weighted by its routing weight."""
    if isinstance(m, Routed):
        weights = m.bound().to(h.dtype)
        parts = [_mlp_back(e, h, u, rule) for e in m.experts]
        back: torch.Tensor | None = None
        bias_terms: torch.Tensor | float = 0.0
        updates: torch.Tensor | float = 0.0
        for e, p in enumerate(parts):
            if rule == "linearised" and p[0] is not None:
                back = weights[:, e, None] * p[0] if back is None else back + weights[:, e, None] * p[0]
            bias_terms = bias_terms + weights[:, e] * p[1]
            updates = updates + weights[:, e] * p[2]
        return back, bias_terms, updates
    zeta, coef, const = mlp_terms(m, h)
    if rule == "linearised":
        up = u @ m.w2  # W2ᵀ u, (B, f)
        t = up * coef  # θ ⊙ W2ᵀ u
        return t @ m.w1, _dot(u, m.b2) + _dot(t, m.b1) + (0.0 if const is None else (up * const).sum(-1)), 0.0
    inner = m.act(zeta) if m.wg is None else coef * zeta + (0 if const is None else const)  # the actual hidden layer
    return None, 0.0, (u * (inner @ m.w2.T + (0 if m.b2 is None else m.b2))).sum(-1)


def layer_directions(omega: torch.Tensor, blocks: list[Block], n1: list[torch.Tensor], n2: list[torch.Tensor],
                     *, mlp: str) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The per-layer directions of a stack (see module) for one readout row per example, each block by its
    layout (``Block.pre_norm``).

    ``omega`` (B, d) the direction on the top block's output (:func:`head_linear`); ``blocks`` the L blocks;
    ``n1[l]`` / ``n2[l]`` (B, d) the readout row's actual inputs of block l's two norms. Returns (ω^l (B, d)
    for l = 0 .. L − 1, the direction on the stream after block l's attention, a^l = x^l + Attn_l; the bias
    terms (B, L) of each block; the MLP updates' terms (B, L), 0 for "linearised"):

    * post-LN: u = g2ᵀ ω^{l+1}; linearised v = u + W1ᵀ(θ ⊙ W2ᵀu), bias ω^{l+1}·β2 + u·b2 + (θ ⊙ W2ᵀu)·b1 +
      v·β1 + ω^l·b_O; "update" v = u, MLP term u · MLP(h_r), bias ω^{l+1}·β2 + u·β1 + ω^l·b_O; ω^l = g1ᵀ v;
    * pre-norm (the stream a^l = n2[l] reaches the next block unchanged besides the MLP branch): linearised
      ω^l = ω^{l+1} + g2ᵀ(W1ᵀ(θ ⊙ W2ᵀ ω^{l+1})), bias ω^{l+1}·b2 + (θ ⊙ W2ᵀω^{l+1})·b1 +
      (W1ᵀ(θ ⊙ W2ᵀω^{l+1}))·β2 + ω^l·b_O; "update" ω^l = ω^{l+1}, MLP term ω^{l+1} · MLP(norm2(a^l)),
      bias ω^l·b_O."""
    if mlp not in MLP_RULES:
        raise ValueError(f"mlp must be one of {MLP_RULES}, got {mlp!r}")
    B = omega.shape[0]
    L = len(blocks)
    dirs: list[torch.Tensor] = [omega] * L
    bias = omega.new_zeros(B, L)
    mlp_terms = omega.new_zeros(B, L)
    for l in reversed(range(L)):
        blk, m = blocks[l], blocks[l].mlp
        # the MLP reads h: norm2 of the stream (pre-norm) or norm1's output (post-LN); u the direction on its output
        h = apply_norm(n2[l], blk.norm2) if blk.pre_norm else apply_norm(n1[l], blk.norm1)
        u = omega if blk.pre_norm else head_direction(omega, blk.norm2, n2[l])
        if not blk.pre_norm:
            bias[:, l] = _dot(omega, blk.norm2.bias)
        back, b_mlp, term = _mlp_back(m, h, u, mlp)
        bias[:, l] += b_mlp
        mlp_terms[:, l] = term
        if blk.pre_norm:
            if back is not None:
                bias[:, l] += _dot(back, blk.norm2.bias)
                omega = omega + head_direction(back, blk.norm2, n2[l])
        else:
            v = u if back is None else u + back
            bias[:, l] += _dot(v, blk.norm1.bias)
            omega = head_direction(v, blk.norm1, n1[l])
        bias[:, l] += _dot(omega, blk.bo)
        dirs[l] = omega
    return dirs, bias, mlp_terms

