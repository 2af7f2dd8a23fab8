"""The target's score per example (``resolve_target``: the class or token logit, or a callable's value) and
the autograd check every gradient method makes first (``require_grad_mode``)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _checks
from ..capture.outputs import main_logits

__all__ = ["resolve_target", "require_grad_mode"]


def resolve_target(outputs: Any, target: Any, *, positions: list[int] | None = None) -> tuple[torch.Tensor, Any]:
    """The target's score per example, y (B,), and how to record the target.

    * ``target`` callable: ``target(outputs)`` must return a tensor of shape (B,).
    * otherwise the main logits are used: (B, C) class scores, or (B, n, V) token-level scores read at
      ``positions`` (one per example: the next-token logits of a decoder). ``None`` = the argmax per
      example; an int = that index for every example; a list = one index per example.
    """
    if callable(target) and not isinstance(target, (int, list, tuple)):
        y = target(outputs)
        logits = main_logits(outputs)
        B = None if logits is None else logits.shape[0]
        label = f"callable: {getattr(target, '__qualname__', type(target).__name__)}"
        return _checks.check_target_output(y, B, target), label
    logits = main_logits(outputs)
    if logits is None:
        raise ValueError(
            f"target: the model's output ({type(outputs).__name__}) has no logits to take a class score from; "
            "pass target=a callable f(outputs) -> (B,) scores (e.g. lambda o: o.pooler_output.norm(dim=-1))"
        )
    if logits.ndim == 3:
        if positions is None:
            positions = [logits.shape[1] - 1] * logits.shape[0]
        logits = logits[
            torch.arange(logits.shape[0], device=logits.device), torch.tensor(positions, device=logits.device)
        ]
    if logits.ndim != 2:
        raise ValueError(
            f"target: the model's logits have shape {tuple(logits.shape)}; class targets need (B, C) or (B, n, V). "
            "Pass target=a callable f(outputs) -> (B,) instead"
        )
    B, C = logits.shape
    idx = _checks.check_target(target, B, C, default=logits.detach().argmax(dim=-1).tolist())
    y = logits[torch.arange(B, device=logits.device), torch.tensor(idx, device=logits.device)]
    return y, idx


def require_grad_mode(name: str) -> None:
    """Gradient methods need autograd: refuse torch.no_grad() / inference_mode() with the way out."""
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        where = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise RuntimeError(
            f"method {name!r} needs gradients of the target with respect to the attention, but it was called "
            f"under {where}. Call attnroll.explain outside that block (attnroll computes no parameter "
            "gradients and leaves .grad untouched), or use a gradient-free method such as 'rollout' or 'raw'."
        )
