"""Shared pieces of the evaluation modules: running a model to logits, ordering units by relevance, rank
correlation. Nothing here knows a metric."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ..capture.outputs import main_logits


def logits_of(output: Any) -> torch.Tensor:
    """The class logits (B, C) in a model's output (:func:`attnroll.capture.outputs.main_logits`: ``.logits``,
    a tensor, the first element of a tuple). Raises TypeError naming what was found when there are none,
    ValueError when they are not (B, C)."""
    y = main_logits(output)
    if y is None:
        raise TypeError(
            f"cannot find class logits in the model's output ({type(output).__name__}); expected a tensor or an "
            "object with .logits. Pass forward=lambda x: ... returning (B, classes) logits."
        )
    if y.ndim != 2:
        raise ValueError(f"the model must return (B, classes) logits for evaluation, got shape {tuple(y.shape)}")
    return y


def image_forward(model: nn.Module | Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function pixel_values (B, 3, H, W) -> logits (B, C) for a transformers image model (keyword
    ``pixel_values``), a timm / plain module (positional) or a callable."""
    from ..capture import model_facts

    facts = model_facts(model) if isinstance(model, nn.Module) else None
    key = facts.input_key if facts is not None and facts.keyword_call else None

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return logits_of(model(**{key: x}) if key else model(x))

    return fwd


@torch.no_grad()
def batched_logits(fwd: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Run ``fwd`` over the first axis of ``x`` in chunks of ``batch_size``; float32 CPU logits."""
    outs = [fwd(x[i : i + batch_size]).detach().float().cpu() for i in range(0, x.shape[0], batch_size)]
    return torch.cat(outs) if outs else torch.zeros(0, 0)


def nanmean(a: Any) -> float:
    """The mean of the entries that are not NaN, as a float; NaN (without a warning) when there are none."""
    a = np.asarray(a, dtype=np.float64)
    keep = ~np.isnan(a)
    return float(a[keep].mean()) if keep.any() else float("nan")


def chunks(n: int, size: int) -> Iterator[slice]:
    for i in range(0, n, size):
        yield slice(i, min(n, i + size))


def relevance_order(scores: torch.Tensor, descending: bool = True) -> torch.Tensor:
    """Unit indices per example, most relevant first (``descending``) or least relevant first; ties keep
    position order (earlier unit first) either way, so results never depend on the sort's luck."""
    key = -scores if descending else scores
    return torch.sort(key, dim=1, stable=True).indices


def spearman_rows(a: Any, b: Any, units: Any = None) -> np.ndarray:
    """Spearman rank correlation between matching rows of two (B, units) arrays (average ranks for ties).
    A row that is constant in either input gets NaN (correlation undefined).

    ``units``: None = every entry; a (B, units) bool array = row i correlates only the entries where
    ``units[i]`` is True (padding of a text batch left out; the ranks are taken among those entries)."""
    from scipy.stats import rankdata

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if units is not None:
        u = np.asarray(units, dtype=bool)
        return np.array([spearman_rows(a[i : i + 1, u[i]], b[i : i + 1, u[i]])[0] if u[i].sum() > 1 else np.nan
                         for i in range(a.shape[0])], dtype=np.float64)
    ra, rb = rankdata(a, axis=1), rankdata(b, axis=1)
    ra -= ra.mean(axis=1, keepdims=True)
    rb -= rb.mean(axis=1, keepdims=True)
    den = np.sqrt((ra**2).sum(axis=1) * (rb**2).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(axis=1) / np.where(den > 0, den, 1), np.nan)


#: Where a metric reports its forward passes while it runs (``evaluate_methods``' progress bar): a callable
#: ``tick(done, total)`` (copies just scored, copies of this metric), or None.
_SCORE_TICK: ContextVar[Callable[[int, int], None] | None] = ContextVar("attnroll_score_tick", default=None)


def tick(done: int, total: int) -> None:
    """Report ``done`` more scored copies of ``total`` to the progress of the running evaluation, if any."""
    f = _SCORE_TICK.get()
    if f is not None:
        f(done, total)


@contextlib.contextmanager
def scoring_progress(f: Callable[[int, int], None] | None) -> Iterator[None]:
    """Within the block, the metrics' :func:`tick` calls go to ``f``."""
    token = _SCORE_TICK.set(f)
    try:
        yield
    finally:
        _SCORE_TICK.reset(token)
