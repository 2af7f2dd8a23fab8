"""Targets for models without class scores: ``f(outputs) -> (B,)`` scalars that ``explain`` differentiates.

A bare sentence encoder (e.g. all-MiniLM-L6-v2) outputs token states, not classes; what it is used for is
the similarity of two sentences' mean-pooled embeddings, so that is what its explanations explain.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["mean_pool", "similarity_to"]


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings (B, d): token states (B, n, d) averaged over the real tokens (mask (B, n) of 0/1)."""
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


def similarity_to(model: Any, tokenizer: Any, mask: torch.Tensor, others: Sequence[str]) -> Callable:
    """A target for a batch of B texts whose padding mask is ``mask`` (B, n): the cosine similarity of each
    text's mean-pooled embedding to that of ``others[b]`` (B texts, embedded here once, held fixed)."""
    import torch.nn.functional as F

    enc = tokenizer(list(others), padding=True, truncation=True, return_tensors="pt")
    device = next(iter(model.parameters())).device  # a model on a GPU (a Ray actor with --num-gpus)
    enc = {k: v.to(device) for k, v in enc.items()}
    mask = mask.to(device)
    with torch.no_grad():
        other = mean_pool(model(**enc).last_hidden_state, enc["attention_mask"])

    def cosine(outputs: Any) -> torch.Tensor:
        return F.cosine_similarity(mean_pool(outputs.last_hidden_state, mask), other, dim=-1)

    cosine.__qualname__ = "cosine similarity of mean-pooled embeddings"
    return cosine
