"""Any attnroll method as a Captum attribution method: ``AttnrollAttribution(model, "rollout")`` is a
``captum.attr.Attribution`` whose ``attribute(inputs, target=...)`` returns relevance shaped like ``inputs``,
so that Captum's metrics (``infidelity``, ``sensitivity_max``) and visualisation take it as they take
Integrated Gradients.

What ``inputs`` may be (one tensor, or a one-tensor tuple as Captum passes them):

- pixels (B, C, H, W): every pixel holds the score of the patch it lies in (prefix tokens have no pixels);
- token ids (B, n) of an integer dtype: every token its score;
- input embeddings (B, n, d) (``inputs_embeds`` of a transformers model): every token's score, repeated over d.

The scores are those of ``attnroll.explain(model, inputs, method, target, **options)``, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _checks
from ..capture import model_facts
from ..methods import explain, method_info

try:
    from captum.attr import Attribution
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attnroll.integrations.captum needs captum: pip install 'attnroll[captum]' (or pip install captum)"
    ) from None

__all__ = ["AttnrollAttribution"]

_KEYS = {"pixels": "pixel_values", "ids": "input_ids", "embeddings": "inputs_embeds"}


class AttnrollAttribution(Attribution):
    """An attnroll method as a Captum ``Attribution``.

    Args:
        model: any model ``attnroll.explain`` supports (transformers, timm, torch, open_clip towers, ...).
        method: a registered attnroll method ("rollout", "gae", "grad_rollout", ...; ``attnroll.methods()``).
        **options: the method's options, as ``explain`` takes them.
    """

    def __init__(self, model: nn.Module, method: str = "rollout", **options: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {_checks.describe(model)}")
        method_info(method)  # an unknown name fails here, listing the known ones
        super().__init__(model)
        self.model, self.method, self.options = model, method, dict(options)

    def has_convergence_delta(self) -> bool:
        return False

    def attribute(self, inputs: Any, target: Any = None, additional_forward_args: Any = None) -> Any:
        """Relevance shaped like ``inputs`` (a tensor, or a tuple of one tensor, as given).

        ``target``: None (the method's default: the predicted class), an int, a list / 1-D tensor of one index
        per example, or a callable ``f(outputs) -> (B,)``. ``additional_forward_args``: a dict of further
        keyword inputs of a transformers model (e.g. ``{"attention_mask": mask}``); None otherwise."""
        as_tuple = isinstance(inputs, tuple)
        if as_tuple and len(inputs) != 1:
            raise ValueError(f"inputs: AttnrollAttribution explains one input tensor, got a tuple of {len(inputs)}")
        x = inputs[0] if as_tuple else inputs
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"inputs must be a tensor (or a tuple of one), got {_checks.describe(x)}")
        kind = _kind(x)
        with torch.enable_grad():  # as Captum's gradient methods: its metrics call them under torch.no_grad()
            e = explain(self.model, self._model_inputs(x, kind, additional_forward_args), self.method,
                        target=_target(target), **self.options)
        rel = _shaped(e, x, kind)
        return (rel,) if as_tuple else rel

    def _model_inputs(self, x: torch.Tensor, kind: str, extra: Any) -> Any:
        if extra is not None and not isinstance(extra, dict):
            raise TypeError("additional_forward_args must be a dict of keyword inputs (e.g. {'attention_mask': m}), "
                            f"got {_checks.describe(extra)}")
        facts = model_facts(self.model, anatomy=False)
        if not facts.keyword_call:
            if extra:
                raise ValueError(f"additional_forward_args: {type(self.model).__name__} takes its input positionally; "
                                 "it has no keyword inputs to add")
            return x
        return {_KEYS[kind]: x, **(extra or {})}


def _kind(x: torch.Tensor) -> str:
    if x.ndim == 4 and x.is_floating_point():
        return "pixels"
    if x.ndim == 2 and not x.is_floating_point():
        return "ids"
    if x.ndim == 3 and x.is_floating_point():
        return "embeddings"
    raise ValueError(
        f"inputs: expected pixels (B, C, H, W) float, token ids (B, n) integers or input embeddings (B, n, d) float, "
        f"got shape {tuple(x.shape)} of dtype {x.dtype}"
    )


def _target(target: Any) -> Any:
    if isinstance(target, torch.Tensor):
        return int(target) if target.ndim == 0 else [int(t) for t in target.reshape(-1).tolist()]
    if isinstance(target, tuple):
        raise ValueError("target: tuples (several output indices per example) are not supported; give one class "
                         "index per example, or a callable f(outputs) -> (B,)")
    return target


def _shaped(e: Any, x: torch.Tensor, kind: str) -> torch.Tensor:
    """The explanation's scores spread over the input: per pixel (its patch's score) or per token."""
    s = e.scores.detach()
    if kind == "pixels":
        grid = e.as_grid().to(torch.float32)  # (B, h, w)
        H, W = x.shape[-2:]
        h, w = grid.shape[-2:]
        if H % h == 0 and W % w == 0:
            up = grid.repeat_interleave(H // h, dim=-2).repeat_interleave(W // w, dim=-1)
        else:  # a border the patches do not cover: nearest patch
            up = F.interpolate(grid[:, None], size=(H, W), mode="nearest")[:, 0]
        return up[:, None].expand(-1, x.shape[1], -1, -1).to(x.device, x.dtype).contiguous()
    n = x.shape[1]
    if s.shape[-1] != n:
        s = e.full_row.detach()[:, e.prefix:e.prefix + n]
    if s.shape[-1] != n:
        raise ValueError(f"the {e.method!r} scores cover {s.shape[-1]} tokens, the input has {n}")
    out = s.to(x.device, torch.float32)
    return out[..., None].expand(-1, -1, x.shape[-1]).to(x.dtype).contiguous() if kind == "embeddings" else out
