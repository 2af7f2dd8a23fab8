"""Localisation: does a saliency map point at the ground-truth object?

Pure functions on saliency scores over input units (image patches or tokens) and ground-truth masks over the
same units; no model is involved. Every metric returns one value per example, together with what a uniformly
random map would score in expectation (the chance level), so a number can be read against its baseline.

Metrics (``N`` units per example, mask ``M`` of ``m`` units):

* pointing game -- the top-scoring unit lies inside ``M``. Ties at the maximum count as a hit only when every
  tied unit is inside the mask: a constant map then never hits unless the mask covers every unit, and the
  result never depends on how a sort happens to break ties. Chance: ``m / N`` (a random continuous map has a
  unique maximum, equally likely on any unit).
* relevance mass (Arras et al. 2022, "relevance mass accuracy") -- the share of the positive relevance that
  falls inside ``M``: ``sum(max(s, 0)[M]) / sum(max(s, 0))``. Negative scores count as no relevance. A row
  with no positive relevance at all has no share to measure and gets NaN (means skip it). Chance: ``m / N``
  (the units of a random map are exchangeable, so each holds 1/N of the mass in expectation).
* top-k IoU -- the ``k`` top-scoring units (ties by position, :func:`._common.relevance_order`) against the
  mask units: ``|T ∩ M| / |T ∪ M|``. ``k = None`` takes ``k = m`` per example, so ``|T| = |M|``; then
  precision = recall = ``I / m`` and IoU = ``I / (2m - I)``, a monotone function of them. Chance: the
  overlap ``I`` of a uniformly random k-subset is hypergeometric (population N, m successes, k draws), and
  the expected IoU ``E[I / (k + m - I)]`` is summed exactly over its distribution.

Masks come as (B, units) or (B, h, w) patch masks; pool pixel masks to the model's patch grid first with
:func:`attnroll.models.shapes.patch_masks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .. import _checks
from .._callable import make_callable as _make_callable
from ._common import nanmean, relevance_order
from .registry import MetricInputs, MetricValues, register_metric

__all__ = [
    "pointing_game",
    "mask_mass",
    "topk_iou",
    "chance_iou",
    "LocalisationResult",
    "localisation",
]


# ----------------------------------------------------------------------------------------------- inputs
def _inputs(scores: Any, masks: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated float64 scores (B, N) and bool masks (B, N)."""
    s = _checks.check_scores("scores", scores)
    m = _checks.check_unit_masks("masks", masks, s.shape[0], s.shape[1])
    return s, m


def _ks(k: Any, masks: torch.Tensor) -> np.ndarray:
    """k per example (B,): the mask's size when ``k`` is None, else the validated ``k``."""
    if k is None:
        return masks.sum(dim=1).numpy().astype(np.int64)
    k = _checks.check_topk("k", k, masks.shape[1])
    return np.full(masks.shape[0], k, dtype=np.int64)


# ----------------------------------------------------------------------------------------------- metrics
def pointing_game(scores: Any, masks: Any) -> np.ndarray:
    """Pointing game: whether the top-scoring unit lies inside the mask, per example.

    Args:
        scores: an ``Explanation`` or (B, units) / (B, h, w) saliency.
        masks: bool / 0-1 (B, units) or (B, h, w) patch masks, at least one unit inside per example.

    Returns:
        (B,) bool. Ties at the maximum (exactly equal scores) are a hit only if every tied unit is inside.
    """
    s, m = _inputs(scores, masks)
    at_max = s == s.amax(dim=1, keepdim=True)
    return (~(at_max & ~m).any(dim=1)).numpy()


def mask_mass(scores: Any, masks: Any) -> np.ndarray:
    """Relevance mass accuracy (Arras et al. 2022): the share of positive relevance inside the mask.

    Returns:
        (B,) float64 in [0, 1]: ``sum(max(s, 0)[mask]) / sum(max(s, 0))``; NaN for a row without any positive
        score (nothing to share out).
    """
    s, m = _inputs(scores, masks)
    pos = s.clamp(min=0)
    total = pos.sum(dim=1)
    inside = (pos * m).sum(dim=1)
    out = torch.where(total > 0, inside / torch.where(total > 0, total, torch.ones_like(total)), torch.nan)
    return out.numpy()


def topk_iou(scores: Any, masks: Any, k: int | None = None) -> np.ndarray:
    """IoU of the ``k`` top-scoring units with the mask units, per example.

    Args:
        k: number of top units, in [1, units]; None = each example's mask size (then IoU = I / (2m - I) with
            I the overlap, and precision = recall = I / m).

    Returns:
        (B,) float64 in [0, 1]. Ties in the scores are broken by position (earlier unit first).
    """
    s, m = _inputs(scores, masks)
    ks = _ks(k, m)
    order = relevance_order(s).numpy()
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(order.shape[1])[None, :].repeat(order.shape[0], 0), axis=1)
    top = ranks < ks[:, None]  # the k most relevant units of each row
    mk = m.numpy()
    inter = (top & mk).sum(axis=1)
    union = (top | mk).sum(axis=1)
    return inter / union


# ----------------------------------------------------------------------------------------------- chance
@lru_cache(maxsize=4096)
def _chance_iou(n: int, m: int, k: int) -> float:
    """E[I / (k + m - I)] with I ~ Hypergeometric(population n, m marked, k drawn), exactly (integer binomials,
    one float division per term)."""
    total = math.comb(n, k)
    acc = 0.0
    for i in range(max(0, k + m - n), min(k, m) + 1):
        if i == 0:
            continue  # IoU 0
        acc += (math.comb(m, i) * math.comb(n - m, k - i) / total) * (i / (k + m - i))
    return acc


def chance_iou(units: int, mask_sizes: Any, k: int | None = None) -> np.ndarray:
    """Expected top-k IoU of a uniformly random map: the k chosen units are a uniformly random k-subset of
    ``units``, so the overlap with a mask of m units is hypergeometric. ``mask_sizes`` (B,) ints in
    [1, units]; ``k`` None = the mask size per example. Returns (B,) float64."""
    units = _checks.check_int("units", units, low=1)
    sizes = np.asarray(mask_sizes, dtype=np.int64).reshape(-1)
    if sizes.size and (sizes.min() < 1 or sizes.max() > units):
        raise ValueError(f"mask_sizes must be in [1, units={units}], got values from {sizes.min()} to {sizes.max()}")
    kk = sizes if k is None else np.full(sizes.shape, _checks.check_topk("k", k, units), dtype=np.int64)
    return np.array([_chance_iou(units, int(m), int(q)) for m, q in zip(sizes, kk)], dtype=np.float64)


# ----------------------------------------------------------------------------------------------- result
def _json_float(v: float) -> float | None:
    return None if not np.isfinite(v) else float(v)


@dataclass
class LocalisationResult:
    """Per-example localisation scores and the chance levels of a uniformly random map.

    Attributes (all (B,) numpy arrays):
        pointing: bool, pointing-game hits.
        mass: float, relevance mass inside the mask (NaN where a map has no positive relevance).
        iou: float, top-k IoU.
        chance_pointing, chance_mass: the mask's share of the units, m / N.
        chance_iou: expected top-k IoU of a random k-subset (exact hypergeometric expectation).
        k: the k used for IoU (None = each mask's size).
    """

    pointing: np.ndarray
    mass: np.ndarray
    iou: np.ndarray
    chance_pointing: np.ndarray
    chance_mass: np.ndarray
    chance_iou: np.ndarray
    k: int | None = None

    def means(self) -> dict[str, float]:
        """Means over examples (NaN entries skipped): pointing, mass, iou and the three chance levels."""
        return {
            "pointing": nanmean(self.pointing.astype(np.float64)),
            "mass": nanmean(self.mass),
            "iou": nanmean(self.iou),
            "chance_pointing": nanmean(self.chance_pointing),
            "chance_mass": nanmean(self.chance_mass),
            "chance_iou": nanmean(self.chance_iou),
        }

    def summary(self) -> str:
        """One line: each metric's mean with its chance level."""
        mu = self.means()
        n_nan = int(np.isnan(self.mass).sum())
        skipped = f", {n_nan} without positive relevance" if n_nan else ""
        kk = "mask size" if self.k is None else str(self.k)
        return (
            f"localisation over {len(self.pointing)} examples: pointing {mu['pointing']:.3f} "
            f"(chance {mu['chance_pointing']:.3f}), mass {mu['mass']:.3f} (chance {mu['chance_mass']:.3f}"
            f"{skipped}), top-k IoU {mu['iou']:.3f} (chance {mu['chance_iou']:.3f}, k = {kk})"
        )

    def as_dict(self) -> dict:
        """JSON-able: ``means`` (NaN -> None), ``k``, ``n`` and the per-example lists (NaN -> None)."""
        return {
            "n": int(len(self.pointing)),
            "k": self.k,
            "means": {key: _json_float(v) for key, v in self.means().items()},
            "per_example": {
                "pointing": [bool(v) for v in self.pointing],
                **{
                    name: [_json_float(v) for v in getattr(self, name)]
                    for name in ("mass", "iou", "chance_pointing", "chance_mass", "chance_iou")
                },
            },
        }


def localisation(scores: Any, masks: Any, *, k: int | None = None) -> LocalisationResult:
    """Pointing game, relevance mass and top-k IoU of saliency against ground-truth unit masks, each with the
    chance level of a uniformly random map.

    Args:
        scores: an ``Explanation`` or (B, units) / (B, h, w) saliency.
        masks: (B, units) or (B, h, w) patch masks (bool or 0/1), non-empty per example.
        k: top-k size for IoU (None = each mask's size).

    Returns:
        a :class:`LocalisationResult`.
    """
    s, m = _inputs(scores, masks)
    if k is not None:
        k = _checks.check_topk("k", k, s.shape[1])
    sizes = m.sum(dim=1).numpy().astype(np.int64)
    frac = sizes / s.shape[1]
    return LocalisationResult(
        pointing=pointing_game(s, m),
        mass=mask_mass(s, m),
        iou=topk_iou(s, m, k),
        chance_pointing=frac.astype(np.float64),
        chance_mass=frac.astype(np.float64).copy(),
        chance_iou=chance_iou(int(s.shape[1]), sizes, k),
        k=k,
    )


# ------------------------------------------------------------------------------------------- registration
def _mask_share(scores: Any, masks: Any) -> np.ndarray:
    """(B,) the share of units inside each mask: the chance level of the pointing game and the mass."""
    s, m = _inputs(scores, masks)
    return (m.sum(dim=1).numpy().astype(np.int64) / s.shape[1]).astype(np.float64)


@register_metric("pointing", kind="image", higher_is_better=True, needs_masks=True,
                 description="pointing game: share of maps whose top patch lies on the object")
def _pointing_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return MetricValues(np.asarray(pointing_game(scores, inp.masks), dtype=np.float64),
                        chance=_mask_share(scores, inp.masks))


@register_metric("mass", kind="image", higher_is_better=True, needs_masks=True,
                 description="relevance mass inside the object mask (Arras et al. 2022)")
def _mass_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return MetricValues(np.asarray(mask_mass(scores, inp.masks), dtype=np.float64),
                        chance=_mask_share(scores, inp.masks))


@register_metric("iou", kind="image", higher_is_better=True, needs_masks=True,
                 description="IoU of the top-k patches with the object mask (k = mask size)")
def _iou_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    s, m = _inputs(scores, inp.masks)
    return MetricValues(np.asarray(topk_iou(s, m), dtype=np.float64),
                        chance=chance_iou(int(s.shape[1]), m.sum(dim=1).numpy().astype(np.int64), None))


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
