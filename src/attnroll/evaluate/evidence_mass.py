"""Evidence-token mass: the share of a map's positive relevance that falls on the evidence tokens.

``mass = sum(max(s, 0) over evidence) / sum(max(s, 0) over units)``, units = the real, non-special tokens
(:mod:`._rationale`), so relevance a method puts on [CLS] / [SEP] counts neither for nor against it. A row
with no positive relevance on any unit gets NaN. Chance (uniformly random map): m / N, m evidence tokens of
N units. The text counterpart of the image metric ``mass`` (Arras et al. 2022, relevance mass accuracy).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._callable import make_callable as _make_callable
from ._rationale import rationale_inputs, rationale_values
from .registry import MetricInputs, MetricValues, register_metric

__all__ = ["evidence_mass"]


def evidence_mass(scores: Any, evidence: Any, units: Any = None) -> np.ndarray:
    """(B,) float64 in [0, 1]: positive relevance on the evidence / positive relevance on all units (NaN
    where no unit has positive relevance).

    Args:
        scores: an ``Explanation`` or (B, n) token saliency.
        evidence: (B, n) bool, the evidence tokens (at least one per example, all of them units).
        units: (B, n) bool, the tokens that count (default: all).
    """
    s, ev, u = rationale_inputs(scores, evidence, units)
    pos = s.clamp(min=0) * u
    total = pos.sum(dim=1)
    inside = (pos * ev).sum(dim=1)
    return torch.where(total > 0, inside / torch.where(total > 0, total, torch.ones_like(total)), torch.nan).numpy()


@register_metric("evidence_mass", kind="text", higher_is_better=True, needs_masks=True,
                 description="share of the positive relevance on the evidence tokens (special tokens excluded)")
def _evidence_mass_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return rationale_values(inp, scores, evidence_mass)


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
