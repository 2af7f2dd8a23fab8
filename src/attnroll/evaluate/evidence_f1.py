"""Top-k token F1 against the evidence (ERASER's token-level plausibility, DeYoung et al. 2020, with k fixed).

The k = m highest-scoring units (m = the number of evidence tokens of the example; ties by position, earlier
first; units = the real, non-special tokens, :mod:`._rationale`) are the predicted rationale T; with the
evidence M, precision = |T ∩ M| / k, recall = |T ∩ M| / m, F1 = their harmonic mean, which for k = m is
|T ∩ M| / m. Chance (uniformly random k-subset of N units): E|T ∩ M| / m = m / N.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._callable import make_callable as _make_callable
from ._common import relevance_order
from ._rationale import rationale_inputs, rationale_values
from .registry import MetricInputs, MetricValues, register_metric

__all__ = ["evidence_f1"]


def evidence_f1(scores: Any, evidence: Any, units: Any = None) -> np.ndarray:
    """(B,) float64 in [0, 1]: F1 of the top-k units (k = the example's evidence count) with the evidence.

    Args: as :func:`attnroll.evaluate.evidence_mass.evidence_mass`.
    """
    s, ev, u = rationale_inputs(scores, evidence, units)
    order = relevance_order(torch.where(u, s, torch.full_like(s, -torch.inf)))
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(s.shape[1]).expand_as(order).contiguous())
    m = ev.sum(dim=1)
    top = (rank < m[:, None]) & u
    inter = (top & ev).sum(dim=1).double()
    precision, recall = inter / top.sum(dim=1).double(), inter / m.double()
    f1 = torch.where(inter > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0)
    return f1.numpy()


@register_metric("evidence_f1", kind="text", higher_is_better=True, needs_masks=True,
                 description="F1 of the top-k tokens with the evidence tokens (k = their number)")
def _evidence_f1_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return rationale_values(inp, scores, evidence_f1)


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
