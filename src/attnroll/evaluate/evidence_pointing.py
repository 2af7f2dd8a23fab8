"""Pointing game on text: whether a map's top token is an evidence token.

Among the units (real, non-special tokens, :mod:`._rationale`), the token with the highest score must be an
evidence token. Ties at the maximum count as a hit only when every tied unit is evidence (as the image
``pointing`` metric: a flat map never scores by luck). Chance (uniformly random map): m / N.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._callable import make_callable as _make_callable
from ._rationale import rationale_inputs, rationale_values
from .registry import MetricInputs, MetricValues, register_metric

__all__ = ["evidence_pointing"]


def evidence_pointing(scores: Any, evidence: Any, units: Any = None) -> np.ndarray:
    """(B,) bool: the highest-scoring unit (every one of them, under ties) is an evidence token.

    Args: as :func:`attnroll.evaluate.evidence_mass.evidence_mass`.
    """
    s, ev, u = rationale_inputs(scores, evidence, units)
    s = torch.where(u, s, torch.full_like(s, -torch.inf))
    at_max = (s == s.amax(dim=1, keepdim=True)) & u
    return (~(at_max & ~ev).any(dim=1)).numpy()


@register_metric("evidence_pointing", kind="text", higher_is_better=True, needs_masks=True,
                 description="pointing game on tokens: the top token (special tokens excluded) is evidence")
def _evidence_pointing_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return rationale_values(inp, scores, evidence_pointing)


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
