"""Chunked layers: attention that runs separately on contiguous chunks of one packed sequence (Qwen2-VL's
vision tower: one kernel call per image of ``cu_seqlens``; Qwen2.5-VL: per window in most layers, per image in
the others), kept as the queries and keys each call saw, and applied to relevance rows matrix-free.

The layer's token-to-token matrix over the packed sequence of n tokens is block diagonal,

    P = diag(P_1, …, P_C),   P_c = softmax(scaling · q_c k_cᵀ)   (per head, chunk c = tokens [s_c, e_c))

so r·Ã (Ã = diag(1/s)(a·P + c·I), as :func:`attnroll.core.operators.apply_layer`) is computed chunk by
chunk: (r·Ã)[s_c:e_c] = r[s_c:e_c]·Ã_c. Rows of several images ride in one relevance row: a chunk never
mixes tokens of two images. The cost per layer is what the forward's attention costs, Σ_c n_c², never n².

Merging (:func:`spread`): a token made of m source tokens (Qwen's PatchMerger: 2×2 patches → one language
token) passes each source the share ``weights`` of its relevance (¼ each by default, a convention as rollout's
α = ½ is: the merger is a learned MLP of the concatenated patches).

Torch only; no model, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from .operators import BlockRule, KernelInputs, apply_layer, probs_block

__all__ = ["Chunk", "ChunkedLayer", "split_call", "apply_chunked", "chunked_rows", "chunked_probs", "spread"]


@dataclass
class Chunk:
    """Tokens [start, stop) of the packed sequence and what the kernel saw for them: ``layer`` (1, H, n_c, d)."""

    start: int
    stop: int
    layer: KernelInputs


@dataclass
class ChunkedLayer:
    """One layer as its chunks (contiguous, in order, covering 0..n)."""

    n: int
    chunks: list[Chunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        at = 0
        for c in self.chunks:
            if c.start != at or c.stop <= c.start or c.layer.shape[2] != c.stop - c.start:
                raise ValueError(f"chunks must cover the packed sequence of {self.n} tokens in order; chunk "
                                 f"[{c.start}, {c.stop}) with {c.layer.shape[2]} queries follows token {at}")
            at = c.stop
        if at != self.n:
            raise ValueError(f"the chunks cover {at} of the packed sequence's {self.n} tokens")

    @property
    def heads(self) -> int:
        return self.chunks[0].layer.shape[1]


def split_call(layer: KernelInputs, bounds: Sequence[int], offset: int) -> list[Chunk]:
    """One kernel call over several chunks at once (a varlen kernel's ``cu_seqlens``: ``bounds`` relative to the
    call) cut into its chunks; q, k, v and grad_out are sliced along the token axis (the kernel's row
    log-sum-exp is kept when the call is one chunk)."""
    out = []
    whole = list(bounds) == [0, layer.shape[2]]
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        part = replace(layer, q=layer.q[:, :, s:e], k=layer.k[:, :, s:e], lse=layer.lse if whole else None,
                       v=None if layer.v is None else layer.v[:, :, s:e],
                       grad_out=None if layer.grad_out is None else layer.grad_out[:, :, s:e])
        out.append(Chunk(offset + s, offset + e, part))
    return out


def apply_chunked(r: torch.Tensor, layer: ChunkedLayer, rule: BlockRule, *, a: float, c: float,
                  renorm: bool = False) -> torch.Tensor:
    """r·Ã for relevance rows r (1, R, n) over the packed sequence -> (1, R, n), chunk by chunk (chunks whose
    rows carry no relevance are the identity's: a·0 + c·0)."""
    if r.ndim != 3 or r.shape[0] != 1 or r.shape[-1] != layer.n:
        raise ValueError(f"relevance rows must be (1, R, {layer.n}) over the packed sequence, got {tuple(r.shape)}")
    out = torch.zeros_like(r)
    for ch in layer.chunks:
        part = r[..., ch.start:ch.stop]
        if bool((part != 0).any()):
            out[..., ch.start:ch.stop] = apply_layer(part, ch.layer, rule, a=a, c=c, renorm=renorm)
    return out


def chunked_rows(layers: Sequence[ChunkedLayer], rows: torch.Tensor, rule: BlockRule, *, a: float, c: float,
                 renorm: bool = False, inject: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Rows of Ã(L−1)···Ã(0) from the top: ``rows`` (1, R, n) -> (1, R, n). ``inject`` {k: (1, R, n)}:
    relevance read at the output of layer k (added before layer k is applied: a feature taken after block k)."""
    v = rows
    inject = inject or {}
    for i in range(len(layers) - 1, -1, -1):
        if i in inject:
            v = v + inject[i]
        v = apply_chunked(v, layers[i], rule, a=a, c=c, renorm=renorm)
    return v


def chunked_probs(layer: ChunkedLayer) -> torch.Tensor:
    """The dense (H, n, n) block-diagonal probabilities (for checks and small sequences only)."""
    P = torch.zeros(layer.heads, layer.n, layer.n)
    for ch in layer.chunks:
        m = ch.stop - ch.start
        P[:, ch.start:ch.stop, ch.start:ch.stop] = probs_block(ch.layer, 0, m, 0, m)[0]
    return P


def spread(values: torch.Tensor, sources: torch.Tensor, n: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Relevance of merged tokens onto their sources: ``values`` (R, K) per merged token, ``sources`` (K, m)
    the source tokens of each, ``weights`` (m,) each source's share (default 1/m; must sum to 1) -> (R, n)."""
    if values.ndim != 2 or sources.ndim != 2 or values.shape[1] != sources.shape[0]:
        raise ValueError(f"values must be (R, K) and sources (K, m); got {tuple(values.shape)} and "
                         f"{tuple(sources.shape)}")
    m = sources.shape[1]
    w = torch.full((m,), 1.0 / m, dtype=values.dtype) if weights is None else weights.to(values.dtype)
    if w.shape != (m,) or bool((w < 0).any()) or abs(float(w.sum()) - 1.0) > 1e-5:
        raise ValueError(f"weights must be {m} non-negative shares summing to 1, got {w.tolist()}")
    out = torch.zeros(values.shape[0], n, dtype=values.dtype, device=values.device)
    contrib = values[:, :, None] * w.to(values.device)[None, None, :]  # (R, K, m)
    out.index_add_(1, sources.reshape(-1).to(values.device), contrib.reshape(values.shape[0], -1))
    return out
