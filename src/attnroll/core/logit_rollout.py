"""Logit contributions of the attention updates, rolled out through per-layer mixing matrices: the maths of
ALTI-Logit (Ferrando, Gállego, Tsiamas & Costa-jussà, ACL 2023) for pre-norm transformers. Pure tensors.

On a pre-norm stack the readout row r's final vector is a sum of residual updates, x^L_r = x^0_r +
Σ_l (attention_l(r) + mlp_l(r)); the head w_c · norm_f(x^L_r) + b_c, with the final norm's divisor frozen at
its actual value, is linear in each update. Token j's direct logit contribution at layer l is

    Δ^l_j = ω · Σ_h α^h_rj f^h(x̃^l_j),      ω = (γ ⊙ w_c − mean(γ ⊙ w_c)) / σ(x^L_r)   (RMSNorm: no centring)

and it is carried to the input tokens by the mixing of the layers below, R^l = C_{l−1} ⋯ C_0 (R^0 = I):
score_k = Σ_l Σ_j Δ^l_j R^l_jk.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .value_aware import Norm, norm_scale

__all__ = ["head_direction", "direct_logit", "logit_rollout"]


def head_direction(w: torch.Tensor, norm: Norm | None, actual: torch.Tensor) -> torch.Tensor:
    """ω (B, d) with w_c · g(v) = ω · v for every v, where g is the final norm's share map with the divisor
    of the actual read vector (β excluded). ``w`` (B, d) the target class's classifier row per example;
    ``actual`` (B, d) the vector the norm actually reads; ``norm`` None = no final norm (ω = w)."""
    if norm is None:
        return w
    wg = w if norm.weight is None else w * norm.weight
    if not norm.rms:
        wg = wg - wg.mean(-1, keepdim=True)
    return wg / norm_scale(actual, norm)


def direct_logit(alpha_row: torch.Tensor, F: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Δ_j = Σ_h α^h_rj (f^h_j · ω) (B, n) for one layer: ``alpha_row`` (B, H, n) the readout row's attention,
    ``F`` (B, n, H, d) the value-output vectors f^h(x̃_j) (b_O excluded), ``omega`` (B, d)."""
    return torch.einsum("bhj,bjhd,bd->bj", alpha_row, F, omega)


def logit_rollout(deltas: Sequence[torch.Tensor], mixing: Sequence[torch.Tensor]) -> torch.Tensor:
    """score (B, n) = Σ_l Δ^l · C_{l−1} ⋯ C_0 from per-layer rows ``deltas`` (L × (B, n)) and mixing matrices
    ``mixing`` (L entries, (B, n, n); the last is never read and may be None), by Horner's rule right to left: O(L·n²)."""
    if len(deltas) == 0 or len(mixing) != len(deltas):
        raise ValueError(f"deltas and mixing must hold one entry per layer (>= 1), got {len(deltas)} and {len(mixing)}")
    s = deltas[-1]
    for l in range(len(deltas) - 2, -1, -1):
        s = torch.einsum("bi,bij->bj", s, mixing[l]) + deltas[l]
    return s
