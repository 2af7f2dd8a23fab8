"""Context attribution's "gate_grad": a first-order leave-one-out estimate from gates on the attention keys.

Give every prompt token k a gate m_k on the attention paid to it: log m_k is added to the attention logits of
key k in every layer, every head and every query row (a float 4D attention mask). m = 1 is the unmodified
model; m_k = 0 for the tokens of one unit removes that unit from everything the model reads (as leave-one-out
does, but at unchanged positions). With f = Σ_t log p(answer_t | prefix), the derivative ∂f/∂m_k at m = 1 is the
first-order estimate of f(all) − f(without k) — attribution patching (Nanda 2023; Kramár et al. 2024, AtP*) of
the attention to a key, which is what ContextCite's ablations (Cohen-Wang et al. 2024) remove. Because one
shared gate per unit adds the same term to all its tokens' logits, the unit's derivative is the sum of its
tokens' derivatives: the token scores are summed per unit like every other method's.

``scales`` averages the derivative over several points of the straight path m = s (s in ``scales``) applied
to the gated tokens (the prompt's units; the chat template's tokens and the answer are never gated): with
the default (1, 0.25) a two-point estimate of ∫₀¹ ∂f/∂m ds, the finite ablation's size, at one forward +
backward with the sequence copied once per point on the batch axis. (1, 0.25) was chosen on validation
against exact leave-one-out among (1, 0.5), (1, 0.25), (1, 0.1) and (0.5, 0.1): the point nearer removal keeps
the decisive passage's estimate from saturating (EVALUATION.md, "Context attribution on SmolLM2-135M-Instruct").
"""

from __future__ import annotations

import inspect
import warnings
from typing import Sequence

import torch
from torch import nn

#: The gate values ``gate_grad`` averages its derivative over unless given ``scales``.
DEFAULT_SCALES = (1.0, 0.25)

#: Attention implementations that add a float 4D ``attention_mask`` to the attention logits.
ADDITIVE_KERNELS = ("eager", "sdpa")


def check_gateable(model: nn.Module, n: int) -> None:
    """Refuse models whose attention does not add a float 4D mask to its logits, or whose sliding window
    (replaced by the one full causal mask) would bite at ``n`` tokens."""
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in ADDITIVE_KERNELS:
        raise ValueError(f"method 'gate_grad' adds the gates to the attention logits through a float attention "
                         f"mask, which the {impl!r} attention implementation ignores; load the model with "
                         f"attn_implementation='sdpa' or 'eager'")
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and 0 < window < n:
        raise ValueError(f"method 'gate_grad' uses one full causal mask in every layer, but this model's sliding "
                         f"window ({window} tokens) is shorter than the {n}-token input; use method 'attn_grad'")


def resolve_default(method: str | None, model: nn.Module, n: int) -> str:
    """``method``, or where it is None the measured default of context / generation attribution: "gate_grad"
    where its gates apply to ``model`` at ``n`` tokens (:func:`check_gateable`), else "attn_grad", warned with
    the reason (a flash-attention kernel, a sliding window shorter than the input)."""
    if method is not None:
        return method
    try:
        check_gateable(model, n)
    except ValueError as e:
        warnings.warn(f"the default method 'gate_grad' does not apply here ({e}); 'attn_grad' is used instead",
                      UserWarning, stacklevel=3)
        return "attn_grad"
    return "gate_grad"


def gate_mask(log_gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, n, n) additive attention mask: causal (−inf above the diagonal, as the dtype's minimum) plus
    ``log_gates[b, k]`` on key column k of every row."""
    B, n = log_gates.shape
    causal = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=log_gates.device).triu(1)
    return causal[None, None] + log_gates[:, None, None, :].to(dtype)


def answer_logprob(model: nn.Module, ids: torch.Tensor, rows: Sequence[int], answer_ids: Sequence[int],
                   log_gates: torch.Tensor, own_row: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) Σ_t log p(answer_t | prefix) of ``ids`` (1, n) copied B times, copy b under the gates
    ``exp(log_gates[b])`` (B, n); with ``own_row`` (B,) copy b's target is only answer token ``own_row[b]``."""
    B, n = log_gates.shape
    kw = {"attention_mask": gate_mask(log_gates, _dtype(model))}
    last = n - min(rows)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = last
    logits = model(input_ids=ids.expand(B, n), **kw).logits
    keep = logits.shape[1]
    r = torch.tensor([keep - (n - i) for i in rows], device=logits.device)
    picked = logits[:, r]
    logp = (picked if picked.dtype == torch.float64 else picked.float()).log_softmax(dim=-1)
    per_token = logp[:, torch.arange(len(rows)), torch.tensor(list(answer_ids), device=logits.device)]  # (B, T)
    if own_row is None:
        return per_token.sum(dim=-1)
    return per_token[torch.arange(B), own_row.to(logits.device)]


def gate_gradients(model: nn.Module, ids: torch.Tensor, rows: Sequence[int], answer_ids: Sequence[int],
                   gated: torch.Tensor, scales: Sequence[float] = DEFAULT_SCALES,
                   per_row: bool = False) -> torch.Tensor:
    """(n,) per token: the mean over ``scales`` s of ∂f/∂m_k at m = s on the ``gated`` tokens (n,) bool
    (m = 1 elsewhere), f the answer's total log-probability; one forward + backward with len(scales) copies.
    ``per_row``: (len(rows), n), row i for f = log p(answer_i | prefix) alone (len(rows) × len(scales) copies)."""
    n = ids.shape[1]
    check_gateable(model, n)
    scales = [scales] if isinstance(scales, (int, float)) else scales
    try:
        s = torch.tensor([float(v) for v in scales], dtype=torch.float32)
    except (TypeError, ValueError):
        s = torch.zeros(0)
    if s.numel() == 0 or bool((s <= 0).any()) or bool((s > 1).any()):
        raise ValueError(f"gate_grad's scales must be numbers in (0, 1] (the gate values along the path), "
                         f"got {list(scales)}")
    copies = len(rows) if per_row else 1
    point = (s.log().reshape(-1, 1) * gated.to(torch.float32).reshape(1, n)).repeat(copies, 1)  # (copies·S, n)
    own = torch.arange(copies).repeat_interleave(len(s)) if per_row else None
    zero = torch.zeros(point.shape, requires_grad=True)  # log m = log s on the gated tokens, 0 (m = 1) elsewhere
    with torch.enable_grad():
        f = answer_logprob(model, ids, rows, answer_ids, (zero + point).to(ids.device), own)
        (grad,) = torch.autograd.grad(f.sum(), zero)
    out = (grad / point.exp()).reshape(copies, len(s), n).mean(dim=1)  # ∂f/∂m = (∂f/∂log m) / m
    return out if per_row else out[0]


def _dtype(model: nn.Module) -> torch.dtype:
    p = next(model.parameters(), None)
    return p.dtype if p is not None and p.is_floating_point() else torch.float32
