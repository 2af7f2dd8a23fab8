"""Composing the three attention streams of an encoder-decoder model (encoder self-attention, decoder
self-attention, cross-attention) into relevance of each target token over the source and target tokens.

Shapes: B examples, n_e source and n_d target tokens; every matrix is batch-first, rows are queries.

- :func:`encdec_rollout_compose` — mass-conserving rollout (α the residual share):
  R_dd = I, R_de = 0; per decoder layer
  [R_dd | R_de] ← ((1−α)Ā_d + αI)·[R_dd | R_de], then [R_dd | R_de] ← α·[R_dd | R_de] + (1−α)·[0 | Ā_c·R_ee].
- :func:`encdec_gae_compose` — Chefer, Gur & Wolf (ICCV 2021) rules 6, 7 and 10 on gradient-weighted
  matrices: R_ee = Π(I + Ā_e); per decoder layer R_dd += Ā_d·R_dd, R_de += Ā_d·R_de, then
  R_de += R̄_ddᵀ·Ā_c·R̄_ee (``transpose=False``: R̄_dd) with R̄ = :func:`handle_residual` (R).

Torch tensors in, torch tensors out; no model, no I/O.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .gradients import gae_update

__all__ = ["handle_residual", "encdec_rollout_compose", "encdec_gae_compose"]


def _eye(B: int, n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(n, dtype=like.dtype, device=like.device).expand(B, n, n).clone()


def _check_streams(decoder: Sequence[torch.Tensor], cross: Sequence[torch.Tensor], n_e: int) -> tuple[int, int]:
    if not decoder or len(decoder) != len(cross):
        raise ValueError(f"decoder and cross need one matrix per decoder layer (>= 1), got {len(decoder)} and "
                         f"{len(cross)}")
    B, n_d, n_c = cross[0].shape
    if n_c != n_e or tuple(decoder[0].shape) != (B, n_d, n_d):
        raise ValueError(f"cross must be (B, n_d, n_e) with n_e = {n_e} source tokens and decoder (B, n_d, n_d); "
                         f"got cross {tuple(cross[0].shape)} and decoder {tuple(decoder[0].shape)}")
    return B, n_d


def encdec_rollout_compose(R_ee: torch.Tensor, decoder: Sequence[torch.Tensor], cross: Sequence[torch.Tensor],
                           alpha: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(R_dd (B, n_d, n_d), R_de (B, n_d, n_e)) of the mass-conserving encoder-decoder rollout.

    ``R_ee`` (B, n_e, n_e): the encoder's rollout; ``decoder`` / ``cross``: per decoder layer the head-fused
    self-attention (B, n_d, n_d) and cross-attention (B, n_d, n_e). With row-stochastic inputs every row of
    [R_dd | R_de] sums to 1."""
    B, n_d = _check_streams(decoder, cross, R_ee.shape[-1])
    a = float(alpha)
    R_dd, R_de = _eye(B, n_d, R_ee), torch.zeros(B, n_d, R_ee.shape[-1], dtype=R_ee.dtype, device=R_ee.device)
    for Ad, Ac in zip(decoder, cross):
        R_dd = (1 - a) * (Ad @ R_dd) + a * R_dd
        R_de = (1 - a) * (Ad @ R_de) + a * R_de
        R_dd = a * R_dd
        R_de = a * R_de + (1 - a) * (Ac @ R_ee)
    return R_dd, R_de


def handle_residual(R: torch.Tensor) -> torch.Tensor:
    """Chefer's R̄: subtract I, divide each row by its sum (rows summing to 0 stay 0), add I back."""
    n = R.shape[-1]
    eye = torch.eye(n, dtype=R.dtype, device=R.device)
    S = R - eye
    s = S.sum(dim=-1, keepdim=True)
    S = torch.where(s > 0, S / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(S))
    return S + eye


def encdec_gae_compose(encoder: Sequence[torch.Tensor], decoder: Sequence[torch.Tensor],
                       cross: Sequence[torch.Tensor], transpose: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(R_dd (B, n_d, n_d), R_de (B, n_d, n_e)) of Chefer's encoder-decoder rules from the gradient-weighted
    matrices of every encoder layer (B, n_e, n_e), decoder layer (B, n_d, n_d) and cross layer (B, n_d, n_e).
    Rule 11 (R_dd += Ā_c·R_ed) vanishes: the encoder never attends to the decoder, so R_ed = 0."""
    if not encoder:
        raise ValueError("encoder needs at least one layer")
    B, n_d = _check_streams(decoder, cross, encoder[0].shape[-1])
    R_ee = _eye(B, encoder[0].shape[-1], encoder[0])
    for A in encoder:
        R_ee = gae_update(R_ee, A)
    R_ee_bar = handle_residual(R_ee)
    R_dd = _eye(B, n_d, R_ee)
    R_de = torch.zeros(B, n_d, R_ee.shape[-1], dtype=R_ee.dtype, device=R_ee.device)
    for Ad, Ac in zip(decoder, cross):
        R_dd = gae_update(R_dd, Ad)
        R_de = gae_update(R_de, Ad)
        Rb = handle_residual(R_dd)
        R_de = R_de + (Rb.transpose(-1, -2) if transpose else Rb) @ Ac @ R_ee_bar
    return R_dd, R_de
