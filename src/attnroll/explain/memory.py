"""Whether a dense capture fits in memory, estimated before the forward pass.

The dense capture runs the model's eager attention, which forms every layer's (B, H, n, n) scores and
probabilities, and keeps one matrix per layer (B, n, n with the head mean, B, H, n, n otherwise; twice that
with gradients). For a long input that is more memory than the machine has, and the allocator's own
message ("can't allocate memory: you tried to allocate ... bytes") names neither the cause nor the fix. So
the size is estimated from the input's token count and the model's heads and layers, and a capture that
would not fit is refused with the estimate, what is available and the two ways out: the matrix-free route
or a shorter input (as ``core.flow`` refuses a flow graph that would not fit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._system import available_memory

__all__ = ["dense_bytes", "check_dense_memory", "MATRIX_FREE_METHODS"]

#: The methods with a matrix-free route (explain/matrix_free.py), for transformers models.
MATRIX_FREE_METHODS = ("raw", "rollout", "grad_rollout", "gae")

#: Input keys whose second dimension is the token count (B, n[, d]).
_TOKEN_KEYS = ("input_ids", "inputs_embeds", "attention_mask")


def dense_bytes(batch: int, n: int, heads: int, layers: int, *, itemsize: int = 4, fused: bool = False,
                keep_grad: bool = False) -> int:
    """About the peak bytes of a dense capture: one layer's eager scores and probabilities (2·B·H·n²) plus
    the matrices kept for every layer (B·n² fused, B·H·n² otherwise; gradients keep the probabilities of every
    layer for the backward pass as well)."""
    square = batch * n * n * itemsize
    kept = layers * (1 if fused and not keep_grad else heads) * (2 if keep_grad else 1)
    return int(square * (2 * heads + kept))


def _token_count(inputs: Any) -> tuple[int, int] | None:
    """(B, n) of a text-like input: a dict with input ids / embeddings / a mask, or a (B, n) tensor of ids."""
    if isinstance(inputs, torch.Tensor):
        return tuple(inputs.shape) if inputs.ndim == 2 and not inputs.is_floating_point() else None  # type: ignore
    if isinstance(inputs, dict):
        for key in _TOKEN_KEYS:
            t = inputs.get(key)
            if isinstance(t, torch.Tensor) and t.ndim >= 2:
                return int(t.shape[0]), int(t.shape[1])
    return None


def _heads_layers(model: nn.Module) -> tuple[int, int] | None:
    """(heads, layers) from a transformers config (its text config first), or from the model's
    ``nn.MultiheadAttention`` modules; None when neither says."""
    config = getattr(model, "config", None)
    for cfg in (getattr(config, "text_config", None), config):
        heads = getattr(cfg, "num_attention_heads", None)
        layers = getattr(cfg, "num_hidden_layers", None)
        if isinstance(heads, int) and isinstance(layers, int) and heads > 0 and layers > 0:
            return heads, layers
    mha = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    return (max(m.num_heads for m in mha), len(mha)) if mha else None


def _available(model: nn.Module) -> tuple[int | None, str]:
    """Bytes free where the model computes (its GPU: free plus what torch's allocator holds unused; else the
    machine's available memory) and where that is."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(param.device)
        cached = torch.cuda.memory_reserved(param.device) - torch.cuda.memory_allocated(param.device)
        return int(free + max(cached, 0)), f"on {param.device}"  # blocks torch holds free are reused first
    return available_memory(), "in memory"


def check_dense_memory(model: nn.Module, inputs: Any, method: str, *, fused: bool = False,
                       keep_grad: bool = False) -> None:
    """MemoryError, before the forward pass, when the dense capture of ``inputs`` would need more memory
    than is available; nothing when it fits or cannot be estimated (an input without a token count, a
    model whose heads and layers are unknown, unknown free memory)."""
    size, shape = _token_count(inputs), _heads_layers(model)
    if size is None or shape is None:
        return
    (batch, n), (heads, layers) = size, shape
    param = next(model.parameters(), None)
    itemsize = param.element_size() if param is not None and param.is_floating_point() else 4
    need = dense_bytes(batch, n, heads, layers, itemsize=itemsize, fused=fused, keep_grad=keep_grad)
    have, where = _available(model)
    if have is None or need <= have:
        return
    gib = 2**30
    if method in MATRIX_FREE_METHODS and getattr(model, "config", None) is not None:
        route = ("use the matrix-free route (attention='recompute', or leave attention= unset and drop "
                 "sparsification options such as discard_ratio / top_k / threshold), which keeps only the "
                 "explained rows")
    else:
        route = (f"use a method with a matrix-free route ({', '.join(MATRIX_FREE_METHODS)} on a transformers "
                 "model), which keeps only the explained rows")
    raise MemoryError(
        f"{type(model).__name__}: method {method!r} captures dense attention matrices: {batch} example(s) x {n} "
        f"tokens, {heads} heads, {layers} layers need about {need / gib:.2f} GiB, but only about "
        f"{have / gib:.2f} GiB is available {where}. Either {route}, or pass a shorter input (fewer tokens, e.g. "
        "tokenizer(..., truncation=True, max_length=...)) or fewer examples at once."
    )
