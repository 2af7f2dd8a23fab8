"""Encoder-decoder explanations for every target position: the rows of the source × target matrix."""

from __future__ import annotations

from typing import Any


def explain_targets(model: Any, inputs: Any, method: str = "encdec_rollout", positions: Any = None,
                    **options: Any) -> list:
    """One Explanation per decoder position (``explain(..., position=t)``), the rows the viewer's source ×
    target matrix shows. ``inputs`` must hold ``decoder_input_ids``; ``positions`` defaults to every decoder
    position. Other keyword arguments go to :func:`attnroll.explain` (``target=``, ``tokenizer=``, ...)."""
    from ..methods.base import explain

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
