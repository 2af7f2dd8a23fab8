"""The metric registry: every metric ``evaluate_methods`` can compute, with what it needs and how it reads.

A metric is a function ``compute(inp: MetricInputs, scores, grid) -> MetricValues`` registered with
:func:`register_metric` under a name, with

- ``kind``: the input it applies to, "image" (patches), "text" (tokens) or "both";
- ``higher_is_better``: which direction of its value is better (the table's arrow, the best method);
- ``needs_masks``: whether it compares maps against ground-truth unit masks (then ``masks=`` is required);
- ``curve``: (x label, y label) when it yields a curve (plotted by ``EvaluationResult.plot``), else None;
- ``fmt``: how its values are printed in tables (e.g. ".3f", ".1f" for values x100);
- ``ylim``: the y range of its curve's panel (None = matplotlib's choice).

Registration order is the column order of the tables. The built-in metrics register in
:mod:`.perturbation`, :mod:`.text` and :mod:`.localisation`; a new metric is one new module of this package
that calls :func:`register_metric` (``attnroll.evaluate`` imports every module of the package).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

__all__ = ["Metric", "MetricInputs", "MetricValues", "register_metric", "metric_info", "metric_names",
           "METRICS", "KINDS"]

#: Input kinds a metric can declare.
KINDS = ("image", "text", "both")


@dataclass(frozen=True)
class MetricInputs:
    """What ``evaluate_methods`` hands every metric, besides the scores.

    Attributes:
        model: the classifier.
        inputs: pixel values (B, C, H, W), or the tokenizer's dict of (B, n) tensors as given (including a
            ``special_tokens_mask`` the model itself must not see).
        target: the class scored per example (B ints; the predicted class unless the caller chose).
        masks: (B, h, w) or (B, units) ground-truth unit masks, or None.
        batch_size: inputs per forward pass.
        options: the metric-specific settings of ``evaluate_methods`` (fill, steps, bins, keep).
    """

    model: Any
    inputs: Any
    target: Any
    masks: Any = None
    batch_size: int = 64
    options: Mapping[str, Any] = None  # type: ignore[assignment]

    def option(self, name: str, default: Any = None) -> Any:
        return (self.options or {}).get(name, default)


@dataclass
class MetricValues:
    """A metric's result for one method: ``per_example`` (B,) float64 (NaN where undefined), optionally the
    mean ``curve`` (fractions (S,), mean values (S,)) and the per-example ``chance`` level (B,) of a
    uniformly random map."""

    per_example: np.ndarray
    curve: tuple[np.ndarray, np.ndarray] | None = None
    chance: np.ndarray | None = None

    @classmethod
    def of_curves(cls, result: Any) -> "MetricValues":
        """From a :class:`~attnroll.evaluate.PerturbationResult` (per-example values and the mean curve)."""
        return cls(np.asarray(result.per_example, dtype=np.float64),
                   (np.asarray(result.fractions), np.asarray(result.mean_curve())))


@dataclass(frozen=True)
class Metric:
    """A registered metric (see the module docstring)."""

    name: str
    compute: Callable[[MetricInputs, Any, Any], MetricValues]
    description: str
    kind: str
    higher_is_better: bool
    needs_masks: bool = False
    curve: tuple[str, str] | None = None
    fmt: str = ".3f"
    ylim: tuple[float, float] | None = None

    def applies_to(self, kind: str) -> bool:
        """Whether the metric applies to inputs of ``kind`` ("image" / "text")."""
        return self.kind in (kind, "both")


_REGISTRY: dict[str, Metric] = {}


def register_metric(name: str, *, description: str, kind: str, higher_is_better: bool, needs_masks: bool = False,
                    curve: tuple[str, str] | None = None, fmt: str = ".3f",
                    ylim: tuple[float, float] | None = None) -> Callable:
    """Decorator registering ``compute(inp, scores, grid) -> MetricValues`` under ``name``.

    Raises ValueError for a name registered already or a ``kind`` not in :data:`KINDS`."""
    if name in _REGISTRY:
        raise ValueError(f"metric name {name!r} is already registered (by {_REGISTRY[name].compute.__module__})")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")

    def deco(fn: Callable) -> Callable:
        _REGISTRY[name] = Metric(name, fn, description, kind, bool(higher_is_better), bool(needs_masks), curve, fmt,
                                 ylim)
        return fn

    return deco


def metric_info(name: str) -> Metric:
    """The registry entry of ``name``; ValueError listing the metrics if unknown."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"metrics must be among {', '.join(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def metric_names(kind: str | None = None, *, masks: bool | None = None) -> list[str]:
    """Registered metric names in table order; only those applying to ``kind`` ("image" / "text") when given,
    only those that need masks (``masks=True``) or do not (``masks=False``) when given."""
    return [n for n, m in _REGISTRY.items()
            if (kind is None or m.applies_to(kind)) and (masks is None or m.needs_masks == masks)]


class _MetricTable(Mapping):
    """``METRICS[name] -> (description, higher_is_better)``: the registry, read live, in table order."""

    def __getitem__(self, name: str) -> tuple[str, bool]:
        m = _REGISTRY[name]
        return m.description, m.higher_is_better

    def __iter__(self) -> Iterator[str]:
        return iter(list(_REGISTRY))

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return f"METRICS({dict(self)!r})"


#: metric name -> (what it is, whether higher is better), in table order (a live view of the registry).
METRICS: Mapping[str, tuple[str, bool]] = _MetricTable()
