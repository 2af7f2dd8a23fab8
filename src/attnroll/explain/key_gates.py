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

Two routes carry the gates into the attention logits, with the same result. On a model whose attention is
"sdpa", the key route: log m_k depends on the key alone, so each head's query gets one more component 1 and key
k one more component log m_k / scale (the value a zero), and SDPA runs causal with no mask at the original
scale — its fused kernel keeps no n × n matrix, so memory stays linear in the length (a registered transformers
attention function, switched in for the call). Elsewhere ("eager"), the mask route: a float 4D attention mask
(causal + log m_k on key column k) that requires a gradient — n × n per copy, and with SDPA it forces the
unfused path that keeps n × n attention per layer and head.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from contextvars import ContextVar
from typing import Sequence

import torch
from torch import nn

#: The gate values ``gate_grad`` averages its derivative over unless given ``scales``.
DEFAULT_SCALES = (1.0, 0.25)

#: Attention implementations that add a float 4D ``attention_mask`` to the attention logits.
ADDITIVE_KERNELS = ("eager", "sdpa")

#: The transformers attention implementation the key route switches "sdpa" models to for the gated call.
GATED_SDPA = "attnroll_gated_sdpa"

#: {"log_gates": (B, n) tensor, "calls": int} while the key route runs, else None.
_ACTIVE: ContextVar[dict | None] = ContextVar("attnroll_key_gates", default=None)


def check_gateable(model: nn.Module, n: int) -> None:
    """Refuse models whose attention is neither "sdpa" (the key route) nor "eager" (the float-mask route), or
    whose sliding window would bite at ``n`` tokens (the mask route replaces it by one full causal mask; the key
    route is held to the same rule)."""
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in ADDITIVE_KERNELS:
        raise ValueError(f"method 'gate_grad' adds the gates to the attention logits (as one more key component "
                         f"under 'sdpa', a float attention mask under 'eager'), which the {impl!r} attention "
                         f"implementation cannot take; load the model with attn_implementation='sdpa' or 'eager'")
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and 0 < window < n:
        raise ValueError(f"method 'gate_grad' uses one full causal mask in every layer, but this model's sliding "
                         f"window ({window} tokens) is shorter than the {n}-token input; use method 'attn_grad'")


def resolve_default(method: str | None, model: nn.Module, n: int) -> str:
    """``method``, or where it is None the measured default of generation attribution (and the ranking of
    context attribution's default "checked"): "gate_grad" where its gates apply to ``model`` at ``n`` tokens
    (:func:`check_gateable`), else "attn_grad", warned with the reason (a flash-attention kernel, a sliding
    window shorter than the input)."""
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


def gated_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs):
    """transformers attention function (registered as :data:`GATED_SDPA`): SDPA with the active log gates
    (B, n) added to every query's logit of key k — query (B, H, n, d) → [query, 1], key → [key, log m / scale],
    value → [value, 0], the extra output component dropped; ``scaling`` kept at the original head size's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError(f"the {GATED_SDPA!r} attention runs only inside key_gates' gated call; load the "
                           f"model with attn_implementation='sdpa'")
    log_gates, (B, _, n, d) = active["log_gates"], key.shape
    if tuple(log_gates.shape) != (B, n):
        raise ValueError(f"key gates of shape {tuple(log_gates.shape)} do not match the attention's {B} "
                         f"sequences of {n} keys")
    active["calls"] += 1
    scale = float(scaling) if scaling is not None else d ** -0.5
    column = (log_gates / scale).to(key.dtype)[:, None, :, None].expand(B, key.shape[1], n, 1)
    query = torch.cat([query, query.new_ones(*query.shape[:-1], 1)], dim=-1)
    key = torch.cat([key, column], dim=-1)
    value = torch.cat([value, value.new_zeros(*value.shape[:-1], 1)], dim=-1)
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, **kwargs)
    return out[..., :d], weights


@contextlib.contextmanager
def _key_route(model: nn.Module, log_gates: torch.Tensor):
    """Within the block, the model's "sdpa" attention runs :func:`gated_sdpa_attention` with ``log_gates``
    (its masks made as for "sdpa"); the implementations are restored on exit. Yields the active record."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if GATED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(GATED_SDPA, gated_sdpa_attention)
        AttentionMaskInterface.register(GATED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    configs = {id(c): c for mod in model.modules() for c in [getattr(mod, "config", None)]
               if getattr(c, "_attn_implementation", None) == "sdpa"}
    active = {"log_gates": log_gates, "calls": 0}
    token = _ACTIVE.set(active)
    for c in configs.values():
        c._attn_implementation_internal = GATED_SDPA
    try:
        yield active
    finally:
        for c in configs.values():
            c._attn_implementation_internal = "sdpa"
        _ACTIVE.reset(token)


def answer_logprob(model: nn.Module, ids: torch.Tensor, rows: Sequence[int], answer_ids: Sequence[int],
                   log_gates: torch.Tensor, own_row: torch.Tensor | None = None,
                   route: str | None = None) -> torch.Tensor:
    """(B,) Σ_t log p(answer_t | prefix) of ``ids`` (1, n) copied B times, copy b under the gates
    ``exp(log_gates[b])`` (B, n); with ``own_row`` (B,) copy b's target is only answer token ``own_row[b]``.
    ``route``: "keys" (SDPA with the gates as one more key component; "sdpa" models only), "mask" (a float
    attention mask), or None: "keys" where the model's attention is "sdpa", else "mask"."""
    B, n = log_gates.shape
    impl = getattr(model.config, "_attn_implementation", None)
    route = route or ("keys" if impl == "sdpa" else "mask")
    if route not in ("keys", "mask") or (route == "keys" and impl != "sdpa"):
        raise ValueError(f"gate route must be 'mask', or 'keys' on an attn_implementation='sdpa' model; got "
                         f"{route!r} on {impl!r}")
    kw = {"logits_to_keep": n - min(rows)} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    if route == "mask":
        logits = model(input_ids=ids.expand(B, n), attention_mask=gate_mask(log_gates, _dtype(model)), **kw).logits
    else:
        with _key_route(model, log_gates) as active:
            logits = model(input_ids=ids.expand(B, n), **kw).logits
        if active["calls"] == 0:  # attention that does not dispatch through transformers' interface
            return answer_logprob(model, ids, rows, answer_ids, log_gates, own_row, route="mask")
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
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:  # the weights need no gradient: their layers then keep no inputs for one (less memory, same result)
        for p in trainable:
            p.requires_grad_(False)
        with torch.enable_grad():
            f = answer_logprob(model, ids, rows, answer_ids, (zero + point).to(ids.device), own)
            (grad,) = torch.autograd.grad(f.sum(), zero)
    finally:
        for p in trainable:
            p.requires_grad_(True)
    out = (grad / point.exp()).reshape(copies, len(s), n).mean(dim=1)  # ∂f/∂m = (∂f/∂log m) / m
    return out if per_row else out[0]


def _dtype(model: nn.Module) -> torch.dtype:
    p = next(model.parameters(), None)
    return p.dtype if p is not None and p.is_floating_point() else torch.float32
