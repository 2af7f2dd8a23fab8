"""What a forward pass computed along every block's value path, for the value-aware methods.

:func:`record_states` runs one forward pass and keeps, per layer, the block's input hidden states, the
inputs of its two norms (the actual pre-norm vectors, hence the statistics) and its output, together with
the attention probabilities (an :class:`AttentionRecord`). Where the blocks and norms are comes only from
the layer anatomy (:mod:`attnroll.capture.anatomy`, re-exported here). Hooks, eval mode and the attention
implementation are restored afterwards, also when the forward raises.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .. import _checks
from .anatomy import VALUE_AWARE_FAMILIES, anatomy, anatomy_or_reason
from .layers import LayerAnatomy, ModelAnatomy, linear_params, norm_params
from .record import AttentionRecord

__all__ = ["LayerAnatomy", "ModelAnatomy", "LayerStates", "anatomy", "record_states", "VALUE_AWARE_FAMILIES",
           "linear_params", "norm_params", "anatomy_or_reason", "value_anatomy"]


@dataclass(kw_only=True)
class LayerStates:
    """What one forward pass computed, per layer l (each (B, n, d), detached): ``inputs`` the block's input
    hidden states, ``norm1_in`` / ``norm2_in`` the vectors entering its two norms, ``outputs`` its output;
    ``final_in`` what enters the per-token final norm (pre-LN models, :attr:`ModelAnatomy.stream_norm`) or
    None."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    norm1_in: list[torch.Tensor] = field(default_factory=list)
    norm2_in: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    final_in: torch.Tensor | None = None
    routing: list[torch.Tensor | None] = field(default_factory=list)


def value_anatomy(anat: ModelAnatomy | None, reason: str, model: Any) -> ModelAnatomy:
    """``anat`` when the value-aware methods can use it, else UnsupportedModelError naming the model, why
    (``reason``, or the anatomy's ``value_aware``), and the families they support."""
    if anat is None or anat.value_aware:
        why = reason if anat is None else anat.value_aware
        raise _checks.UnsupportedModelError(
            f"the value-aware methods cannot explain {type(model).__name__}: {why}. "
            f"Supported: {VALUE_AWARE_FAMILIES}"
        )
    return anat


# ------------------------------------------------------------------------------------------- states
def _first_tensor(args: tuple, kwargs: dict, key: str = "hidden_states") -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get(key, kwargs.get("x"))
    if not isinstance(value, torch.Tensor):
        raise _checks.CaptureError(f"could not find the hidden states entering a block (keys {sorted(kwargs)})")
    return value


def _install_state_hooks(stack: ExitStack, anat: ModelAnatomy, states: LayerStates, L: int) -> None:
    """Forward hooks that fill ``states`` (each list indexed by layer; reset at the first block)."""
    slots = {"inputs": [None] * L, "norm1_in": [None] * L, "norm2_in": [None] * L, "outputs": [None] * L}

    def keep(name: str, i: int, t: torch.Tensor) -> None:
        slots[name][i] = t.detach()
        setattr(states, name, slots[name])

    def add(mod: nn.Module, fn: Callable, pre: bool) -> None:
        h = (mod.register_forward_pre_hook(fn, with_kwargs=True) if pre
             else mod.register_forward_hook(fn, with_kwargs=True))
        stack.callback(h.remove)

    for layer in anat.layers:
        i = layer.index
        add(layer.module, lambda m, a, k, i=i: keep("inputs", i, _first_tensor(a, k)), True)
        add(layer.module, lambda m, a, k, o, i=i: keep("outputs", i, o[0] if isinstance(o, (tuple, list)) else o),
            False)
        add(layer.norm1, lambda m, a, k, i=i: keep("norm1_in", i, _first_tensor(a, k)), True)
        add(layer.norm2, lambda m, a, k, i=i: keep("norm2_in", i, _first_tensor(a, k)), True)
    if anat.stream_norm is not None:
        add(anat.stream_norm, lambda m, a, k: setattr(states, "final_in", _first_tensor(a, k).detach()), True)
    _install_routing_hooks(add, anat, states, L)


def _install_routing_hooks(add: Callable, anat: ModelAnatomy, states: LayerStates, L: int) -> None:
    """Hooks that fill ``states.routing`` for the layers whose MLP is a mixture of experts: the chosen experts'
    indices and weights as the experts module receives them, the shared experts' gate (sigmoid of its output)."""
    states.routing = [None] * L
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def gated(i: int, out: torch.Tensor) -> None:  # a hook returning None: the module's output flows on
        seen[(i, "shared")] = torch.sigmoid(out.detach())
        _fill_routing(states, anat.layers[i], seen)

    def chosen(i: int, args: tuple, kwargs: dict) -> None:
        rest = list(args[1:3]) + [v for k, v in kwargs.items() if "ind" in k] + [
            v for k, v in kwargs.items() if "weight" in k or "score" in k]
        seen[(i, "idx")], seen[(i, "w")] = rest[0].detach(), rest[1].detach()
        _fill_routing(states, anat.layers[i], seen)

    for layer in anat.layers:
        if layer.experts is None:
            continue
        i = layer.index
        add(layer.experts.source, lambda m, a, k, i=i: chosen(i, a, k), True)
        if layer.experts.shared_gate is not None:
            add(layer.experts.shared_gate, lambda m, a, k, o, i=i: gated(i, o), False)


def _fill_routing(states: LayerStates, layer: LayerAnatomy, seen: dict) -> None:
    """Once a layer's routing (and its shared gate, if any) were seen: its (B, n, E) weights in ``states``."""
    i, ex = layer.index, layer.experts
    if ex is None or (i, "idx") not in seen or (ex.shared_gate is not None and (i, "shared") not in seen):
        return
    idx, w = seen[(i, "idx")], seen[(i, "w")]
    E = len(ex.routed)
    dense = w.new_zeros(idx.shape[0], E + 1).scatter_add_(1, idx.long().clamp(max=E), w.to(w.dtype))[:, :E]
    shared = [seen[(i, "shared")].to(dense.dtype)] if ex.shared_gate is not None else [
        dense.new_ones(idx.shape[0], 1) for _ in ex.shared]
    dense = torch.cat([dense, *shared], dim=-1)
    x = states.inputs[i]
    states.routing[i] = dense.reshape(*x.shape[:-1], dense.shape[-1])


def record_states(model: nn.Module, inputs: Any, *, anat: ModelAnatomy | None = None,
                  tokenizer: Any = None) -> tuple[AttentionRecord, LayerStates, ModelAnatomy]:
    """One forward pass (no gradients) keeping the attention probabilities (per head) and, per layer, the
    states the value-aware methods need (see :class:`LayerStates`). Everything is restored on exit."""
    from . import capture as _capture
    from .hooks import run_forward

    anat = value_anatomy(*anatomy_or_reason(model), model) if anat is None else anat
    states = LayerStates()
    session = _capture(model, tokenizer=tokenizer)
    with ExitStack() as stack:
        rec = stack.enter_context(session)
        _install_state_hooks(stack, anat, states, len(anat.layers))
        with torch.no_grad():
            run_forward(model, session.adapter.call_inputs(inputs), session.adapter.input_hint)
    missing = [i for i, t in enumerate(states.inputs) if t is None] if states.inputs else list(range(len(anat.layers)))
    if missing or len(rec.attentions) != len(anat.layers):
        raise _checks.CaptureError(
            f"the forward pass did not run every block (missing layers {missing}, {len(rec.attentions)} attention "
            f"layers for {len(anat.layers)} blocks)"
        )
    return rec, states, anat
