"""Attention sinks: tokens that receive attention whatever the query, measured on captured attention.

Decoder language models park most of each head's softmax mass on a few tokens, the first one above all,
whatever the query is about (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
ICLR 2024; Gu et al., "When Attention Sink Emerges in Language Models", ICLR 2025). Composed over the
layers, that mass ends in the sink: rollout of such a model puts nearly its whole map on token 0.

The rule (:func:`find_sinks`), on the head-mean attention of a sample of query rows of one example:

- the queries judged are real tokens that see at least ``min_keys`` real keys (:func:`sample_queries`,
  at most ``max_queries`` of them, evenly spaced), so that a large share is not just a short row's uniform one;
- in one layer, key ``j`` *holds* when at least ``query_fraction`` of the judged queries after it give it at
  least ``share`` of their attention (well above uniform: 1 / ``min_keys``);
- ``j`` is a sink when it holds in at least ``layer_fraction`` of the layers and at least ``min_queries``
  judged queries come after it.

A key that many queries of most layers attend to, whatever they are, is a sink by this rule, the first token
or not; a token attended to by a few queries or in a few layers (content) is not. Pure functions, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SinkRule", "DEFAULT_RULE", "sample_queries", "find_sinks", "drop_columns", "top_share"]


@dataclass(frozen=True)
class SinkRule:
    """The thresholds of :func:`find_sinks` (see the module docstring)."""

    share: float = 0.3
    query_fraction: float = 0.8
    layer_fraction: float = 0.6
    min_keys: int = 4
    min_queries: int = 4
    max_queries: int = 32


DEFAULT_RULE = SinkRule()


def sample_queries(real: torch.Tensor, rule: SinkRule = DEFAULT_RULE) -> torch.Tensor:
    """(Q,) int64 positions of the query rows judged for one causal example: the real tokens (``real`` (n,)
    0/1) from the ``min_keys``-th real one on, at most ``max_queries`` of them, evenly spaced, last included."""
    pos = torch.nonzero(real.reshape(-1).to(torch.bool)).reshape(-1)[rule.min_keys - 1:]
    if pos.numel() <= rule.max_queries:
        return pos.to(torch.int64)
    pick = torch.linspace(0, pos.numel() - 1, rule.max_queries, dtype=torch.float64).round().to(torch.int64)
    return pos[torch.unique(pick)].to(torch.int64)


def find_sinks(rows: torch.Tensor, queries: torch.Tensor, real: torch.Tensor,
               rule: SinkRule = DEFAULT_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys of one causal example are attention sinks.

    Args:
        rows: (L, Q, n) head-mean attention of the query rows ``queries`` in each layer.
        queries: (Q,) their positions.
        real: (n,) 0/1, the real (not padding) tokens.

    Returns:
        (sinks (n,) bool, held (n,) float: the fraction of layers in which each key holds; 0 where a key
        cannot be judged).
    """
    if rows.ndim != 3 or rows.shape[1] != queries.numel() or rows.shape[2] != real.numel():
        raise ValueError(f"find_sinks: rows must be (L, Q={queries.numel()}, n={real.numel()}), "
                         f"got {tuple(rows.shape)}")
    n = real.numel()
    keys = torch.arange(n, device=rows.device)
    after = queries.to(rows.device).reshape(-1, 1) > keys.reshape(1, -1)  # (Q, n): query i judges key j < i
    judged = after.sum(dim=0)  # (n,)
    hit = (rows >= rule.share) & after  # (L, Q, n)
    frac = hit.sum(dim=1).to(torch.float64) / judged.clamp(min=1)  # (L, n)
    held = (frac >= rule.query_fraction).to(torch.float64).mean(dim=0) if rows.shape[0] else frac.sum(dim=0)
    ok = (judged >= rule.min_queries) & real.to(device=rows.device, dtype=torch.bool)
    held = torch.where(ok, held, torch.zeros_like(held))
    return ok & (held >= rule.layer_fraction), held.to(torch.float32)


def drop_columns(row: torch.Tensor, drop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Take the ``drop`` (..., n) bool columns out of relevance rows ``row`` (..., n) and rescale the rest so
    that each row keeps its absolute mass Σ|r|.

    Returns:
        (the new rows, the dropped share (...,): Σ_drop |r| / Σ |r|, 0 for an all-zero row). A row whose
        whole mass was dropped becomes 0.
    """
    drop = drop.to(device=row.device, dtype=torch.bool).expand_as(row)
    mag = row.abs().to(torch.float64)
    total = mag.sum(dim=-1)
    gone = torch.where(drop, mag, torch.zeros_like(mag)).sum(dim=-1)
    share = torch.where(total > 0, gone / torch.where(total > 0, total, torch.ones_like(total)),
                        torch.zeros_like(total))
    left = total - gone
    scale = torch.where(left > 0, total / torch.where(left > 0, left, torch.ones_like(left)), torch.zeros_like(left))
    out = torch.where(drop, torch.zeros((), dtype=row.dtype, device=row.device), row)
    return (out.to(torch.float64) * scale.unsqueeze(-1)).to(row.dtype), share.to(torch.float32)


def top_share(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(share (...,), position (...,)): the largest single token's share Σ-normalised of each row's absolute
    mass, and where it is (share 0 for an all-zero row)."""
    mag = row.abs().to(torch.float64)
    total = mag.sum(dim=-1)
    top, pos = mag.max(dim=-1)
    share = torch.where(total > 0, top / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(top))
    return share.to(torch.float32), pos
