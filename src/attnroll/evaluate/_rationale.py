"""Shared inputs of the rationale metrics (evidence mass, pointing, top-k F1): saliency over tokens compared
with ground-truth evidence tokens, counting only the *units* of a text: its real tokens that are not special
(the same tokens the AOPC metrics may delete, :mod:`.text`). Nothing here is a metric."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _checks
from .registry import MetricInputs, MetricValues

__all__ = ["rationale_inputs", "units_of", "rationale_values"]


def rationale_inputs(scores: Any, evidence: Any, units: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validated (scores (B, n) float64, evidence (B, n) bool, units (B, n) bool).

    ``units`` None = every token. Raises ValueError when an example has no evidence token, or an evidence
    token that is not a unit (a special token or padding cannot be evidence)."""
    s = _checks.check_scores("scores", scores)
    ev = _checks.check_unit_masks("evidence", evidence, s.shape[0], s.shape[1])
    if units is None:
        u = torch.ones_like(ev)
    else:
        u, _ = _checks.as_tensor("units", units)
        if tuple(u.shape) != tuple(s.shape):
            raise ValueError(f"units must be (B, n) = {tuple(s.shape)} like the scores, got shape {tuple(u.shape)}")
        u = _checks.check_binary("units", u, "0/1 or bool values").to("cpu")
    outside = (ev & ~u).any(dim=1).nonzero().flatten().tolist()
    if outside:
        raise ValueError(f"evidence: examples {outside[:10]} mark tokens that are not units (special tokens or "
                         "padding) as evidence")
    return s, ev, u


def units_of(inp: MetricInputs) -> torch.Tensor:
    """(B, n) bool: the tokens of ``inp.inputs`` that count (attention mask 1, not special / not in ``keep``)."""
    from .text import text_units

    return text_units(inp.model, _checks.check_text_inputs(inp.inputs), inp.option("keep"))


def rationale_values(inp: MetricInputs, scores: Any, metric: Any) -> MetricValues:
    """A registered rationale metric's values: ``metric(scores, evidence, units)`` per example (as float64) with
    the chance level m / N of a uniformly random map (m evidence tokens among N units)."""
    u = units_of(inp)
    ev = torch.as_tensor(inp.masks).to(torch.bool)
    return MetricValues(np.asarray(metric(scores, ev, u), dtype=np.float64),
                        chance=(ev.sum(1) / u.sum(1)).double().numpy())
