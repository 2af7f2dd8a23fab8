"""The residual share of every token, measured through the whole block (attention, norms and MLP).

A block's output at token i is made of two parts and the biases: what its residual carries (token i's own
input x_i) and what its attention mixes in from the tokens (a_i = Σ_h Σ_j α^h_ij f^h(x̃_j), b_O apart). The
MLP reads their sum, so it is split between them as DecompX does (Modarressi et al. 2023): every norm acts
on a part with the actual vector's statistics, the activation is linearised per element with the actual
pre-activation, θ = act(ζ) / ζ, the same θ for both parts (a gated MLP holds its gate at its actual value),
and every bias is kept apart. The two parts T_res and T_mix of the output (plus the bias part) add up to
the block's actual output exactly. The measured residual share of token i is

    r_i = ‖T_res,i‖ / (‖T_res,i‖ + ‖T_mix,i‖)

the per-token, per-layer quantity rollout fixes at ½ (Abnar & Zuidema's 0.5·A + 0.5·I).

The rest of the row is spread by the head-mean attention, or, in the blocks made class-specific, by
:func:`class_pattern`: gae's gradient-weighted attention mean_h (∂y/∂α^h ⊙ α^h)^+ with its rows normalised.
"""

from __future__ import annotations

import torch

from .decompx import mlp_shares, norm_shares
from .gradients import gradient_weighted
from .value_aware import Block, normalize_rows

__all__ = ["block_parts", "residual_share", "share_rollout_matrix", "measured_matrix", "class_pattern"]


def block_parts(x: torch.Tensor, mixed: torch.Tensor, attn_bias: torch.Tensor | None, block: Block) -> torch.Tensor:
    """The block's output split into (residual part, attention part, bias part): (B, n, 3, d).

    ``x`` (B, n, d) the block input, ``mixed`` (B, n, d) the attention branch's output without b_O
    (Σ_h Σ_j α^h_ij f^h(x̃_j)), ``attn_bias`` (d,) / (B, n, d) / None what the branch adds besides (b_O).
    The three parts sum to the block's actual output (float rounding apart)."""
    S = torch.stack([x, mixed, torch.zeros_like(x)], dim=2)
    if attn_bias is not None:
        S[:, :, 2] = S[:, :, 2] + attn_bias
    if block.pre_norm:  # out = h + MLP(norm2(h)), h = x + attention
        return S + mlp_shares(norm_shares(S, block.norm2, "separate"), block.mlp, "separate")
    h = norm_shares(S, block.norm1, "separate")  # post-LN: out = norm2(h + MLP(h)), h = norm1(x + attention)
    return norm_shares(h + mlp_shares(h, block.mlp, "separate"), block.norm2, "separate")


def residual_share(parts: torch.Tensor) -> torch.Tensor:
    """r = ‖T_res‖ / (‖T_res‖ + ‖T_mix‖) per token from :func:`block_parts`' (B, n, 3, d): (B, n) in [0, 1];
    1 where both parts vanish (nothing is mixed in, so the token keeps itself)."""
    res, mix = parts[:, :, 0].norm(dim=-1), parts[:, :, 1].norm(dim=-1)
    tot = res + mix
    return torch.where(tot > 0, res / torch.where(tot > 0, tot, torch.ones_like(tot)), torch.ones_like(tot))


def share_rollout_matrix(alpha: torch.Tensor, share: torch.Tensor, pattern: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's mixing matrix M = diag(r) + diag(1 − r) · P: (B, n, n) from alpha (B, H, n, n), the residual
    share r (B, n) and the pattern P (B, n, n; default mean_h α^h). Rows sum to 1 where P's rows do."""
    n = alpha.shape[-1]
    eye = torch.eye(n, dtype=alpha.dtype, device=alpha.device)
    r = share.to(alpha.dtype).unsqueeze(-1)
    return r * eye + (1 - r) * (alpha.mean(1) if pattern is None else pattern.to(alpha.dtype))


def class_pattern(alpha: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """gae's class-specific pattern with its rows normalised: rows of mean_h (∂y/∂α^h ⊙ α^h)^+ divided by their
    sums, (B, n, n) from alpha and grad = ∂y/∂α (B, H, n, n), in alpha's dtype. A row with no positive entry
    stays 0 (nothing of the target is mixed into that token; its rolled-out row then keeps itself)."""
    return normalize_rows(gradient_weighted([alpha], [grad.to(alpha.dtype)], "per_head", dtype=None)[0])


def measured_matrix(x: torch.Tensor, attn_out: torch.Tensor, alpha: torch.Tensor, block: Block,
                    pattern: torch.Tensor | None = None) -> torch.Tensor:
    """One block's measured-share matrix M = diag(r) + diag(1 − r) · P (B, n, n), r from :func:`block_parts`:
    ``x`` (B, n, d) the block input, ``attn_out`` (B, n, d) the attention branch's actual output (b_O
    included), ``alpha`` (B, H, n, n) the attention the block used, ``pattern`` P (B, n, n) how the rest of
    each row is spread (default mean_h α^h; :func:`class_pattern` for a class-specific block)."""
    bo = block.bo
    mixed = attn_out if bo is None else attn_out - bo
    return share_rollout_matrix(alpha, residual_share(block_parts(x, mixed, bo, block)), pattern)
