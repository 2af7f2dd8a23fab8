"""Explaining many inputs in batches: the one loop that ``evaluate``, ``audit``, ``sanity`` and batch jobs use.

:func:`iter_explanations` yields one :class:`~attnroll.Explanation` per chunk of inputs; :func:`explain_batches`
gathers the chunks' scores into one (B, units) tensor. Both

- slice a pixel tensor (B, ...) or a tokenizer's dict of batch-first tensors (other entries passed as they are),
  and a target given per example (a list, tuple or 1-D tensor of B class indices);
- run gradient methods with autograd enabled and the others under ``torch.no_grad()`` (no graph is built);
- give the ``random`` control the seed ``seed + start`` of its chunk, so that example i's map is the same
  whatever the batch size (the map of one call over all inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from .. import _checks
from .explainer import explain
from .explanation import Explanation
from .registry import method_info

__all__ = ["BatchScores", "batch_size_of", "take_rows", "iter_explanations", "explain_batches", "explain_targets"]


def batch_size_of(inputs: Any) -> int:
    """B of a pixel tensor (its first axis) or of a tokenizer's dict (the first batch-first tensor in it)."""
    if isinstance(inputs, torch.Tensor):
        if inputs.ndim == 0:
            raise ValueError("inputs must have a batch axis, got a 0-d tensor")
        return int(inputs.shape[0])
    if isinstance(inputs, Mapping):
        for v in inputs.values():
            if isinstance(v, torch.Tensor) and v.ndim >= 1:
                return int(v.shape[0])
    raise TypeError(
        "inputs must be a pixel tensor (B, 3, H, W) or what the model's processor / tokenizer returns (a dict of "
        f"batch-first tensors), got {_checks.describe(inputs)}"
    )


def take_rows(inputs: Any, sl: slice, batch: int | None = None) -> Any:
    """Examples ``sl`` of a pixel tensor, or of every tensor of a dict whose first axis is the batch (B =
    ``batch``, default :func:`batch_size_of`); other dict entries are passed unchanged."""
    if isinstance(inputs, torch.Tensor):
        return inputs[sl]
    batch = batch_size_of(inputs) if batch is None else batch
    return {k: v[sl] if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == batch else v
            for k, v in inputs.items()}


def _target_rows(target: Any, sl: slice) -> Any:
    if isinstance(target, torch.Tensor) and target.ndim == 1:
        return target[sl].tolist()
    if isinstance(target, (list, tuple)):
        return list(target[sl])
    return target  # None, an int or a callable


def iter_explanations(model: Any, inputs: Any, method: str, *, target: Any = None, batch_size: int = 64,
                      tokenizer: Any = None, **options: Any) -> Iterator[tuple[slice, Explanation]]:
    """Explain ``inputs`` chunk by chunk; yields ``(slice of the examples, Explanation of that chunk)``.

    Args:
        model, method, tokenizer, **options: as for :func:`attnroll.explain`.
        inputs: a pixel tensor (B, 3, H, W) or a tokenizer's dict of (B, n) tensors.
        target: None / an int / a callable (the same for every chunk), or B class indices (sliced).
        batch_size: examples per ``explain`` call (>= 1).
    """
    batch_size = _checks.check_int("batch_size", batch_size, low=1)
    m = method_info(method)
    B = batch_size_of(inputs)
    for start in range(0, B, batch_size):
        sl = slice(start, min(B, start + batch_size))
        opts = dict(options)
        if m.name == "random":
            opts["seed"] = int(options.get("seed", 0)) + start
        with torch.set_grad_enabled(m.needs_grad):  # gradient methods refuse no_grad; the others need no graph
            e = explain(model, take_rows(inputs, sl, B), m.name, _target_rows(target, sl), tokenizer=tokenizer,
                        **opts)
        yield sl, e


@dataclass
class BatchScores:
    """The scores of many inputs explained in chunks.

    Attributes:
        scores: (B, units) float32 CPU tensor, the chunks' ``Explanation.scores`` in input order.
        grid: the patch grid (h, w) of image maps, None for tokens.
        targets: the resolved class index per example (B ints) when every chunk resolved to class indices
            (None for a callable target or a model without class scores).
    """

    scores: torch.Tensor
    grid: tuple[int, int] | None
    targets: list[int] | None


def explain_batches(model: Any, inputs: Any, method: str, *, target: Any = None, batch_size: int = 64,
                    on_chunk: Callable[[int, int], None] | None = None, **options: Any) -> BatchScores:
    """Explain every example of ``inputs`` with ``method``, ``batch_size`` at a time (see
    :func:`iter_explanations`), and return the scores of all of them as one :class:`BatchScores`.
    ``on_chunk(done, total)`` is called after each chunk (a progress bar, a log line)."""
    scores, targets, grid = [], [], None
    total = batch_size_of(inputs)
    for sl, e in iter_explanations(model, inputs, method, target=target, batch_size=batch_size, **options):
        scores.append(e.scores.detach().float().cpu())
        grid = None if e.grid is None else (int(e.grid[0]), int(e.grid[1]))
        targets.append(e.target if isinstance(e.target, list) and len(e.target) == sl.stop - sl.start else None)
        if on_chunk is not None:
            on_chunk(sl.stop, total)
    if not scores:
        raise ValueError("inputs hold no examples (B = 0); nothing to explain")
    resolved = None if any(t is None for t in targets) else [int(v) for t in targets for v in t]
    return BatchScores(torch.cat(scores), grid, resolved)


def explain_targets(model: Any, inputs: Any, method: str = "encdec_rollout", positions: Any = None,
                    **options: Any) -> list:
    """One Explanation per decoder position (``explain(..., position=t)``), the rows the viewer's source ×
    target matrix shows. ``inputs`` must hold ``decoder_input_ids``; ``positions`` defaults to every decoder
    position. Other keyword arguments go to :func:`attnroll.explain` (``target=``, ``tokenizer=``, ...)."""
    dec = inputs.get("decoder_input_ids") if hasattr(inputs, "get") else None
    if dec is None:
        raise ValueError("explain_targets needs inputs with decoder_input_ids (an encoder-decoder's source and "
                         f"target), got {type(inputs).__name__} without them")
    if "position" in options:
        raise TypeError("explain_targets sets position= itself; give positions=[...] instead")
    n = int(dec.shape[-1])
    pos = list(range(n)) if positions is None else [int(p) for p in positions]
    if not pos or any(not 0 <= p < n for p in pos):
        raise ValueError(f"positions must be decoder positions in [0, {n}), got {positions!r}")
    target = options.pop("target", None)
    return [explain(model, inputs, method, target, position=p, **options) for p in pos]
