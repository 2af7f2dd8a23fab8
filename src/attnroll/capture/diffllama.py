"""Differential attention (Ye et al., "Differential Transformer", ICLR 2025; transformers' DiffLlama): the matrix
that multiplies the values, captured exactly.

transformers' ``DiffLlamaAttention`` computes, for H query heads over K key/value heads (head size d, G = H / K
query heads per kv head), one softmax map A_h per query head and pairs head p with head p + H/2
(p < H/2). Both heads of a pair read the same 2d-wide value vectors V̂_p = [v_a ; v_{a + K/2}] (a = p // G: the
model's two value halves, split along the kv heads), and the pair's output is

    o_p = (1 − λ_init) · RMS( (A_p − λ A_{p + H/2}) V̂_p ),      λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2) + λ_init

(RMS: the per-pair group norm over 2d, no affine; λ_init = 0.8 − 0.6 exp(−0.3 l) for layer l), then o_proj over
the H/2 pairs. So the signed matrix D_p = A_p − λ A_{p + H/2} (rows summing to 1 − λ, entries of either sign) is
what mixes the tokens' values, per pair; the group norm divides each row's mixed vector by one number.

While a capture is on, :func:`install` runs each differential attention module through :func:`forward`, the
same computation with D formed explicitly and multiplied with V̂ (its output equals the model's own, tested),
and returns D (B, H/2, n, n) as the module's weights: the record holds D, the tensor the output is computed
from, so gradients reach it. Restored on exit.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

__all__ = ["is_differential", "install", "forward", "lambda_full", "STOCHASTIC_REASON"]

#: Why a differential layer's rows are no probabilities (``StreamInfo.stochastic_reason``'s start).
STOCHASTIC_REASON = ("differential attention (DiffLlama): each head pair mixes the values with the signed matrix "
                     "softmax₁ − λ·softmax₂ (Ye et al., ICLR 2025), not with probabilities")


def is_differential(module: nn.Module) -> bool:
    """A transformers differential attention module (its λ vectors, group norm and value / output projections)."""
    return all(hasattr(module, n) for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "lambda_init",
                                            "groupnorm", "v_proj", "o_proj"))


def install(stack: ExitStack, model: nn.Module) -> int:
    """Run every differential attention module of ``model`` through :func:`forward` until ``stack`` closes;
    the number of modules switched."""
    from .hooks import set_attr_temporarily

    count = 0
    for m in model.modules():
        if is_differential(m):
            set_attr_temporarily(stack, m, "forward", forward.__get__(m))
            count += 1
    return count


def lambda_full(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2) + λ_init, as the model computes it (sums in float32)."""
    l1 = torch.exp(torch.sum(module.lambda_q1 * module.lambda_k1, dim=-1, dtype=torch.float32)).to(dtype)
    l2 = torch.exp(torch.sum(module.lambda_q2 * module.lambda_k2, dim=-1, dtype=torch.float32)).to(dtype)
    return l1 - l2 + module.lambda_init


def _rotated(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of t (B, heads, n, d) with the model's (B, n, d) cos / sin tables: each
    position's halves (t₁, t₂) become (t₁ cos − t₂ sin, t₂ cos + t₁ sin), Llama's convention."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-t2, t1], dim=-1) * sin


def _mask(scores: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    """The scores with the model's additive mask (or a boolean keep-mask); none given: none applied, as the
    model's eager attention does."""
    if attention_mask is None:
        return scores
    attention_mask = attention_mask[..., :scores.shape[-1]]
    if attention_mask.dtype == torch.bool:
        return scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    return scores + attention_mask


def forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
            attention_mask: torch.Tensor | None = None, cache: Any = None,
            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``DiffLlamaAttention.forward`` with the signed matrix D formed explicitly (see the module): returns (the
    attention branch's output, D (B, H/2, n_q, n_k))."""
    kwargs.pop("past_key_values", None)
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    keys = k.repeat_interleave(self.num_key_value_groups, dim=1)  # query head h reads kv head h // G
    scores = _mask(q @ keys.transpose(2, 3) * self.scaling, attention_mask)
    A = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, n, n)
    half = A.shape[1] // 2
    D = A[:, :half] - lambda_full(self, q.dtype) * A[:, half:]  # (B, H/2, n, n): pair p = heads p, p + H/2
    K = v.shape[1]
    pair_values = torch.cat([v[:, :K // 2], v[:, K // 2:]], dim=-1)  # (B, K/2, n, 2d): [v_a ; v_{a + K/2}]
    pair_values = pair_values.repeat_interleave(self.num_key_value_groups, dim=1)  # (B, H/2, n, 2d)
    out = (D @ pair_values).transpose(1, 2)  # (B, n, H/2, 2d)
    out = (1 - self.lambda_init) * self.groupnorm(out)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), D
