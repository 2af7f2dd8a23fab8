"""The public transformers path: ``output_attentions=True`` on an eager forward.

Used for transformers families that declare no output recorder (DeBERTa, MPNet, BLOOM, Falcon, GPT-Neo,
RoFormer, XLM, ...) and whenever the private declaration has a shape this version of attnroll does not know
(a transformers release that reshaped it). The model is asked for ``output_attentions=True`` through a
forward pre-hook (removed afterwards) while every config says "eager"; the tensors the model returns are
checked before they become layers (SDPA subclasses of an eager attention class run the eager parent's
forward meanwhile): per layer (B, H, n, n), one token count for the whole stack, rows that
sum to 1. A stack whose token count changes between layers (Funnel's pooling) is refused with the reason.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .. import _checks

#: ModelOutput fields holding per-layer attention -> attnroll stream names.
_FIELDS = (
    ("attentions", "self"),
    ("encoder_attentions", "encoder"),
    ("decoder_attentions", "decoder"),
    ("cross_attentions", "cross"),
)


def accepts_output_attentions(model: nn.Module) -> bool:
    """Whether the model's forward takes ``output_attentions`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "output_attentions" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def ask_for_attentions(stack: ExitStack, model: nn.Module) -> None:
    """Add ``output_attentions=True`` (and ``return_dict=True``) to every call of the model while the
    capture is on; the hook is removed on exit."""

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "output_attentions": True, "return_dict": True}

    handle = model.register_forward_pre_hook(pre, with_kwargs=True)
    stack.callback(handle.remove)


def eager_forwards(stack: ExitStack, model: nn.Module) -> None:
    """Modules built as an SDPA subclass of an eager attention class (``XSdpaSelfAttention(XSelfAttention)``,
    chosen when the model was built, whatever the config says later) run their eager parent's forward
    while the capture is on; restored on exit."""
    from .hooks import set_attr_temporarily

    for m in model.modules():
        cls = type(m)
        base = cls.__mro__[1] if len(cls.__mro__) > 1 else None
        if "Sdpa" in cls.__name__ and base is not None and base.__name__ == cls.__name__.replace("Sdpa", ""):
            set_attr_temporarily(stack, m, "forward", base.forward.__get__(m))


def output_streams(model: nn.Module, output: Any) -> dict[str, list[torch.Tensor]]:
    """Stream -> per-layer tensors from a transformers ModelOutput, validated (see the module docstring)."""
    name = type(model).__name__
    streams: dict[str, list[torch.Tensor]] = {}
    for field, stream in _FIELDS:
        layers = getattr(output, field, None)
        if layers is None or len(layers) == 0:
            continue
        layers = list(layers)
        missing = [i for i, t in enumerate(layers) if not isinstance(t, torch.Tensor)]
        if missing:
            raise _checks.UnsupportedModelError(
                f"{name} returned no attention weights for layer(s) {missing} of {field} even with "
                "output_attentions=True on the eager path (its attention modules were built for SDPA / flash "
                "attention and ignore the config at run time). Load it with attn_implementation='eager'."
            )
        streams[stream] = layers
    if not streams:
        raise _checks.UnsupportedModelError(
            f"{name} returned no attentions with output_attentions=True, so attnroll cannot read them; load it "
            "with attn_implementation=\"eager\" (SDPA / flash attention compute no attention probabilities)"
        )
    for stream, layers in streams.items():
        validate_layers(name, stream, layers)
    return streams


def validate_layers(name: str, stream: str, layers: list[torch.Tensor], signed: bool = False) -> None:
    """Refuse (UnsupportedModelError, with the reason) layers that are not one (B, H, n, n) row-stochastic
    token-to-token matrix each, of one token count for the whole stream (cross attention: any n_q x n_k);
    ``signed``: the layers are signed matrices that multiply the values (their rows are not checked)."""
    shapes = {tuple(t.shape[-2:]) for t in layers}
    bad = [i for i, t in enumerate(layers) if t.ndim not in (3, 4)]  # 3-D: heads fused at capture time
    if bad:
        raise _checks.UnsupportedModelError(
            f"{name}: the {stream} attention of layer {bad[0]} has shape {tuple(layers[bad[0]].shape)}, not "
            "(B, H, n_q, n_k) softmax probabilities; attnroll refuses rather than guess its layout"
        )
    if stream != "cross" and len(shapes) != 1:
        raise _checks.UnsupportedModelError(
            f"{name}: its {stream} layers attend over different token counts ({sorted(shapes)}): the sequence "
            "is pooled or windowed between layers, so there is no single token-to-token product to roll out"
        )
    if stream != "cross" and any(q != k for q, k in shapes):
        raise _checks.UnsupportedModelError(
            f"{name}: its {stream} layers return non-square weights (queries x keys {sorted(shapes)}), not a "
            "token-to-token matrix over one sequence (local windows, sampled points or a recurrent state take "
            "its place), so there is nothing to roll out; attnroll refuses rather than guess their layout"
        )
    t = layers[0].detach()
    if t.ndim == 3 or t.is_meta or signed:  # fused at capture time; matrix-free (recomputed as a softmax, no
        return  # values); signed matrices that multiply the values (differential attention, listed non-stochastic)
    sums = t.sum(dim=-1)
    rowsum_ok = bool(((sums - 1).abs() < 1e-3).any(dim=-1).all())
    if not rowsum_ok or bool((t < 0).any()):
        raise _checks.UnsupportedModelError(
            f"{name}: the returned {stream} attention is not row-stochastic softmax probabilities (rows sum "
            f"to {float(sums.min()):.3g}..{float(sums.max()):.3g}); attnroll refuses rather than roll it out"
        )
