"""Faithfulness of image saliency by perturbation: deletion / insertion (Petsiuk et al. 2018, RISE) and the
positive / negative perturbation tests of Chefer et al. 2021.

Every metric takes the model, its ``pixel_values`` (B, C, H, W) as the model takes them (already
preprocessed) and saliency ``scores`` over patches (an ``Explanation``, or (B, units) / (B, h, w)). Units are
the patches of a grid (h, w) in row-major order; patch (i, j) covers pixels [i·H/h, (i+1)·H/h) x
[j·W/w, (j+1)·W/w). The metric replaces whole patches, following the relevance order of the scores (ties
by position, see :func:`attnroll.evaluate._common.relevance_order`), and records the model's response.

All copies of a batch are built with tensor operations and run through the model ``batch_size`` images at
a time, under ``torch.no_grad()``, in eval mode (dropout off: every call gives the same curve); the
model's own train/eval flags are restored afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from .. import _checks
from .._modes import in_eval_mode
from ._common import chunks, image_forward, relevance_order, tick
from .registry import MetricInputs, MetricValues, register_metric

__all__ = [
    "PerturbationResult",
    "Curve",
    "perturbation_curve",
    "deletion",
    "insertion",
    "positive_perturbation",
    "negative_perturbation",
    "gaussian_blur",
    "BLUR_SIGMA",
    "CHEFER_FRACTIONS",
    "trapezoid",
]

#: Standard deviation of the insertion metric's blurred baseline, as a fraction of the shorter image side
#: (11.2 px at 224, 3.2 px at 64). About the size of one ViT patch: detail inside a patch is gone, colours
#: and the layout of large regions stay (RISE blurs with sigma 5 px at 224, through an 11-tap kernel).
BLUR_SIGMA = 0.05

#: Chefer et al.'s removal fractions: 0% (the unperturbed input), 10%, ..., 90%.
CHEFER_FRACTIONS = tuple(i / 10 for i in range(10))

_LABELS = {
    "deletion": "deletion AUC",
    "insertion": "insertion AUC",
    "positive": "positive perturbation AUC",
    "negative": "negative perturbation AUC",
    "comprehensiveness": "comprehensiveness AOPC",
    "sufficiency": "sufficiency AOPC",
}


# ------------------------------------------------------------------------------------------------ result
@dataclass
class PerturbationResult:
    """The outcome of one perturbation metric over a batch.

    Attributes:
        kind: "deletion" | "insertion" | "positive" | "negative" | "comprehensiveness" | "sufficiency".
        fractions: (S,) the share of units removed (or inserted / kept) at each step; for text AOPC the bins.
        curves: (B, S) per example: the target's softmax probability (deletion / insertion), 1.0 / 0.0 for a
            correct top-1 prediction (positive / negative), or the probability drop p(x) - p(x') (AOPC).
        per_example: (B,) the metric per example.
        value: the metric, the mean of ``per_example``.
        higher_is_better: whether larger values mean a more faithful map.
        target: (B,) the class indices used (the labels, for positive / negative with ``labels=``).
    """

    kind: str
    fractions: np.ndarray
    curves: np.ndarray
    per_example: np.ndarray
    value: float
    higher_is_better: bool
    target: np.ndarray

    def mean_curve(self) -> np.ndarray:
        """(S,) the curve averaged over examples."""
        return self.curves.mean(axis=0)

    def summary(self) -> str:
        """One line, e.g. ``deletion AUC 0.213 (lower is better, B=200)``."""
        label = _LABELS.get(self.kind, self.kind)
        fmt = ".2f" if self.kind in ("positive", "negative") else ".3f"
        better = "higher" if self.higher_is_better else "lower"
        return f"{label} {self.value:{fmt}} ({better} is better, B={len(self.per_example)})"

    def as_dict(self, include_curves: bool = False) -> dict:
        """JSON-able record: kind, value, direction, B, fractions, mean curve, per-example values, targets
        (and every example's curve with ``include_curves``)."""
        out = {
            "kind": self.kind,
            "value": float(self.value),
            "higher_is_better": bool(self.higher_is_better),
            "batch_size": int(len(self.per_example)),
            "fractions": [float(v) for v in self.fractions],
            "mean_curve": [float(v) for v in self.mean_curve()],
            "per_example": [float(v) for v in self.per_example],
            "target": [int(v) for v in self.target],
        }
        if include_curves:
            out["curves"] = [[float(v) for v in row] for row in self.curves]
        return out


def _result(kind: str, fractions: np.ndarray, curves: np.ndarray, per_example: np.ndarray, higher: bool,
            target: Any) -> PerturbationResult:
    return PerturbationResult(
        kind=kind,
        fractions=np.asarray(fractions, dtype=np.float64),
        curves=np.asarray(curves, dtype=np.float64),
        per_example=np.asarray(per_example, dtype=np.float64),
        value=float(np.mean(per_example)),
        higher_is_better=higher,
        target=np.asarray(target, dtype=np.int64),
    )


def trapezoid(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Trapezoid-rule area under ``y`` (..., S) over ``x`` (S,), along the last axis (numpy-version proof:
    numpy 2 renamed ``trapz`` to ``trapezoid``)."""
    y = np.asarray(y, dtype=np.float64)
    dx = np.diff(np.asarray(x, dtype=np.float64))
    return ((y[..., 1:] + y[..., :-1]) * 0.5 * dx).sum(axis=-1)


# ------------------------------------------------------------------------------------------------- blur
def gaussian_blur(pixel_values: torch.Tensor, sigma: float) -> torch.Tensor:
    """Blur each channel of (B, C, H, W) images with a Gaussian of standard deviation ``sigma`` pixels.

    The kernel is sampled at integer offsets up to radius ``int(3 * sigma + 0.5)`` and normalised to sum 1;
    borders repeat the edge pixel (what ``scipy.ndimage.gaussian_filter(mode="nearest", truncate=3)``
    does on the two spatial axes). ``sigma`` 0 returns a copy."""
    sigma = _checks.check_real("sigma", sigma, low=0.0)
    radius = int(3 * sigma + 0.5)
    if radius == 0:
        return pixel_values.clone()
    b, c, h, w = pixel_values.shape
    offs = torch.arange(-radius, radius + 1, dtype=torch.float64)
    k = torch.exp(-0.5 * (offs / sigma) ** 2)
    k = (k / k.sum()).to(pixel_values.dtype).to(pixel_values.device)
    x = pixel_values.reshape(b * c, 1, h, w)
    x = torch.nn.functional.pad(x, (radius, radius, 0, 0), mode="replicate")
    x = torch.nn.functional.conv2d(x, k.view(1, 1, 1, -1))
    x = torch.nn.functional.pad(x, (0, 0, radius, radius), mode="replicate")
    x = torch.nn.functional.conv2d(x, k.view(1, 1, -1, 1))
    return x.reshape(b, c, h, w)


# ------------------------------------------------------------------------------------------- the engine
class Curve(NamedTuple):
    """What :func:`perturbation_curve` measured.

    Attributes:
        counts: (S,) number of units taken from the donor at each step.
        units: units per example (h·w).
        probs: (B, S) softmax probability of ``target`` on each perturbed copy.
        predicted: (B, S) argmax class of each perturbed copy.
        target: (B,) the class tracked by ``probs``.
        clean_predicted: (B,) argmax class of the unperturbed images.
    """

    counts: np.ndarray
    units: int
    probs: np.ndarray
    predicted: np.ndarray
    target: np.ndarray
    clean_predicted: np.ndarray


class _Setup(NamedTuple):
    fwd: Callable[[torch.Tensor], torch.Tensor]
    x: torch.Tensor
    scores: torch.Tensor
    grid: tuple[int, int]
    clean_logits: torch.Tensor


def _setup(model: Any, pixel_values: Any, scores: Any, grid: Any, batch_size: Any) -> _Setup:
    """Validate the common inputs and run the unperturbed images once (their logits give the default target
    and the number of classes)."""
    x = _checks.check_pixel_values(pixel_values)
    batch_size = _checks.check_int("batch_size", batch_size, low=1)
    own_grid = getattr(scores, "grid", None) if hasattr(scores, "full_row") else None
    raw = scores.scores if hasattr(scores, "full_row") and hasattr(scores, "scores") else scores
    if own_grid is None and isinstance(raw, (torch.Tensor, np.ndarray)) and raw.ndim == 3:
        own_grid = tuple(int(v) for v in raw.shape[1:])  # (B, h, w) maps carry their grid
    s = _checks.check_scores("scores", scores, batch=x.shape[0])
    g = _checks.check_grid(grid, s.shape[1], x.shape[2], x.shape[3], from_scores=own_grid)
    fwd = image_forward(model)
    with torch.no_grad():
        clean = torch.cat([fwd(x[sl]).detach().to("cpu", torch.float64) for sl in chunks(x.shape[0], batch_size)])
    return _Setup(fwd, x, s, g, clean)


def _resolve_target(target: Any, clean_logits: torch.Tensor) -> list[int]:
    if isinstance(target, np.ndarray):
        target = target.tolist()
    b, c = clean_logits.shape
    return _checks.check_target(target, b, c, default=clean_logits.argmax(dim=1).tolist())


def _run(
    st: _Setup,
    counts: Sequence[int],
    *,
    descending: bool,
    donor: float | torch.Tensor | None,
    base: float | torch.Tensor | None,
    target: list[int],
    batch_size: int,
) -> Curve:
    """The engine. Copy s of example b is ``base`` with the first ``counts[s]`` units of b's relevance order
    taken from ``donor`` (None = the images themselves). Pairs (example, step) are flattened and processed
    ``batch_size`` copies per forward, so memory is bounded by one forward batch."""
    x, (h, w) = st.x, st.grid
    B, _, H, W = x.shape
    U = h * w
    dev = x.device
    order = relevance_order(st.scores, descending=descending)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(U).expand(B, U).contiguous())  # rank[b, u]: place of unit u
    rank = rank.to(dev)
    counts_t = torch.as_tensor(list(counts), dtype=torch.long, device=dev)
    S = counts_t.numel()
    tgt = torch.as_tensor(target, dtype=torch.long)

    def on_device(v: float | torch.Tensor | None) -> torch.Tensor:
        if v is None:
            return x
        if isinstance(v, torch.Tensor):
            return v.to(device=dev, dtype=x.dtype)
        return torch.tensor(v, dtype=x.dtype, device=dev)

    donor_t, base_t = on_device(donor), on_device(base)

    def source(v: torch.Tensor, ex: torch.Tensor) -> torch.Tensor:
        return v[ex] if v.ndim == 4 else v  # per-example images, or one image / value broadcast to all

    ex_all = torch.arange(B, device=dev).repeat_interleave(S)
    step_all = torch.arange(S, device=dev).repeat(B)
    probs = torch.empty(B * S, dtype=torch.float64)
    pred = torch.empty(B * S, dtype=torch.long)
    with torch.no_grad():
        for sl in chunks(B * S, batch_size):
            ex, step = ex_all[sl], step_all[sl]
            m = rank[ex] < counts_t[step][:, None]  # (n, U): units taken from the donor
            m = m.view(-1, h, w).repeat_interleave(H // h, dim=1).repeat_interleave(W // w, dim=2)[:, None]
            xb = torch.where(m, source(donor_t, ex), source(base_t, ex))
            logits = st.fwd(xb).detach().to("cpu", torch.float64)
            p = torch.softmax(logits, dim=1)
            probs[sl] = p.gather(1, tgt[ex.cpu()][:, None])[:, 0]
            pred[sl] = logits.argmax(dim=1)
            tick(sl.stop - sl.start, B * S)
    return Curve(
        counts=counts_t.cpu().numpy(),
        units=U,
        probs=probs.view(B, S).numpy(),
        predicted=pred.view(B, S).numpy(),
        target=tgt.numpy(),
        clean_predicted=st.clean_logits.argmax(dim=1).numpy(),
    )


@in_eval_mode
def perturbation_curve(
    model: Any,
    pixel_values: Any,
    scores: Any,
    counts: Sequence[int] | Callable[[int], Sequence[int]],
    *,
    descending: bool = True,
    donor: Any = 0.0,
    base: Any = None,
    target: Any = None,
    grid: Any = None,
    batch_size: int = 64,
) -> Curve:
    """The model's response as units are replaced in relevance order: the shared engine of the four image
    metrics.

    Copy s of example b is ``base`` (None = the images themselves) with the first ``counts[s]`` units of b's
    relevance order (``descending``: most relevant first; else least relevant first) replaced by ``donor``
    (None = the images themselves). Deletion: base None, donor = fill. Insertion: base = a blurred image,
    donor None.

    Args:
        counts: ints in [0, units], one per step; or a function units -> those ints.
        donor, base: None, a float in model-input space, a tensor broadcastable to one image (C, H, W), or
            (B, C, H, W) one per example.
        target: None (the class predicted on the unperturbed images), an int, or B ints.

    Returns:
        A :class:`Curve` with (B, S) target probabilities and predicted classes.
    """
    st = _setup(model, pixel_values, scores, grid, batch_size)
    U = st.grid[0] * st.grid[1]
    counts = _check_counts(counts(U) if callable(counts) else counts, U)
    shape = tuple(st.x.shape)
    donor = None if donor is None else _checks.check_image_fill("donor", donor, shape[0], shape[1:])
    base = None if base is None else _checks.check_image_fill("base", base, shape[0], shape[1:])
    tgt = _resolve_target(target, st.clean_logits)
    return _run(st, counts, descending=_checks.check_bool("descending", descending), donor=donor, base=base,
                target=tgt, batch_size=batch_size)


def _check_counts(counts: Any, units: int) -> list[int]:
    out = [_checks.check_int("counts", c, low=0, high=units) for c in list(counts)]
    if not out:
        raise ValueError("counts must hold at least one step")
    return out


def _step_counts(steps: Any, units: int) -> list[int]:
    """Units replaced at each step: one step per unit (steps None), or ``steps`` equal steps with
    round(k·units/steps) units at step k = 0..steps (exact rational rounding, half to even)."""
    if steps is None:
        return list(range(units + 1))
    steps = _checks.check_int("steps", steps, low=1)
    return [round(Fraction(k * units, steps)) for k in range(steps + 1)]


# --------------------------------------------------------------------------------- deletion / insertion
@in_eval_mode
def deletion(
    model: Any,
    pixel_values: Any,
    scores: Any,
    *,
    target: Any = None,
    grid: Any = None,
    steps: int | None = None,
    fill: Any = 0.0,
    batch_size: int = 64,
) -> PerturbationResult:
    """Deletion (Petsiuk et al. 2018): replace the most relevant patches first with ``fill`` and track the
    softmax probability of the target class. A faithful map makes it fall fast: lower AUC is better.

    Args:
        model: image classifier (transformers image model, timm / plain module, or a callable x -> logits),
            in eval mode.
        pixel_values: (B, C, H, W) model inputs.
        scores: an ``Explanation`` or (B, units) / (B, h, w) saliency over patches.
        target: None (the class predicted on the unperturbed images), an int, or B ints.
        grid: (h, w) patch grid; default: the Explanation's grid, a (B, h, w) map's shape, or square.
        steps: None = one step per patch (fractions k/units, k = 0..units); an int = that many equal steps,
            round(k·units/steps) patches removed at step k (half to even).
        fill: replacement value in model-input space (0.0 = the dataset mean after the usual normalisation),
            or a tensor broadcastable to one image (C, H, W), or (B, C, H, W).
        batch_size: images per forward pass.

    Returns:
        :class:`PerturbationResult` with ``fractions`` = patches removed / units (S = steps + 1), ``curves``
        the target probabilities, ``per_example`` the trapezoid AUC over [0, 1].
    """
    st = _setup(model, pixel_values, scores, grid, batch_size)
    U = st.grid[0] * st.grid[1]
    counts = _step_counts(steps, U)
    fill = _checks.check_image_fill("fill", fill, st.x.shape[0], tuple(st.x.shape[1:]))
    tgt = _resolve_target(target, st.clean_logits)
    c = _run(st, counts, descending=True, donor=fill, base=None, target=tgt, batch_size=batch_size)
    fr = c.counts / U
    return _result("deletion", fr, c.probs, trapezoid(c.probs, fr), False, c.target)


@in_eval_mode
def insertion(
    model: Any,
    pixel_values: Any,
    scores: Any,
    *,
    target: Any = None,
    grid: Any = None,
    steps: int | None = None,
    baseline: Any = "blur",
    batch_size: int = 64,
) -> PerturbationResult:
    """Insertion (Petsiuk et al. 2018): start from ``baseline`` and put the most relevant patches of the
    image back first, tracking the softmax probability of the target class. Higher AUC is better.

    ``baseline``: "blur" = each image blurred by :func:`gaussian_blur` with sigma = ``BLUR_SIGMA`` (0.05) x
    the shorter image side in pixels (11.2 px at 224, 3.2 px at 64), blurred in model-input space; or a
    float (a constant image); or a tensor broadcastable to one image (C, H, W), or (B, C, H, W).
    Other arguments as :func:`deletion`; ``fractions`` = patches inserted / units.
    """
    st = _setup(model, pixel_values, scores, grid, batch_size)
    U = st.grid[0] * st.grid[1]
    counts = _step_counts(steps, U)
    B, C, H, W = st.x.shape
    if isinstance(baseline, str):
        _checks.check_choice("baseline", baseline, ("blur",))
        with torch.no_grad():
            base = gaussian_blur(st.x, BLUR_SIGMA * min(H, W))
    else:
        base = _checks.check_image_fill("baseline", baseline, B, (C, H, W))
    tgt = _resolve_target(target, st.clean_logits)
    c = _run(st, counts, descending=True, donor=None, base=base, target=tgt, batch_size=batch_size)
    fr = c.counts / U
    return _result("insertion", fr, c.probs, trapezoid(c.probs, fr), True, c.target)


# ------------------------------------------------------------------------ positive / negative (Chefer)
def _chefer(
    kind: str,
    model: Any,
    pixel_values: Any,
    scores: Any,
    target: Any,
    labels: Any,
    grid: Any,
    fractions: Any,
    fill: Any,
    batch_size: int,
) -> PerturbationResult:
    st = _setup(model, pixel_values, scores, grid, batch_size)
    U = st.grid[0] * st.grid[1]
    fr = _checks.check_fractions("fractions", fractions)
    # Python's round (half to even) on the float product: 10% of 64 patches is 6, of 196 is 20.
    counts = [round(float(f) * U) for f in fr]
    B = st.x.shape[0]
    fill = _checks.check_image_fill("fill", fill, B, tuple(st.x.shape[1:]))
    if labels is not None:
        if target is not None:
            raise ValueError(
                "give either target= (accuracy against these classes) or labels= (accuracy against the true "
                "labels), not both: both only set the class a prediction must match"
            )
        tgt = _checks.check_labels(labels, B, st.clean_logits.shape[1])
    else:
        tgt = _resolve_target(target, st.clean_logits)
    c = _run(st, counts, descending=(kind == "positive"), donor=fill, base=None, target=tgt, batch_size=batch_size)
    correct = (c.predicted == c.target[:, None]).astype(np.float64)
    return _result(kind, fr, correct, 100.0 * trapezoid(correct, fr), kind == "negative", c.target)


@in_eval_mode
def positive_perturbation(
    model: Any,
    pixel_values: Any,
    scores: Any,
    *,
    target: Any = None,
    labels: Any = None,
    grid: Any = None,
    fractions: Sequence[float] = CHEFER_FRACTIONS,
    fill: Any = 0.0,
    batch_size: int = 64,
) -> PerturbationResult:
    """Positive perturbation (Chefer et al. 2021): remove the most relevant patches first (replace them with
    ``fill``) and measure top-1 accuracy at each fraction. Lower AUC is better.

    Args:
        target: the class a prediction must match: None = the class predicted on the unperturbed input (so
            the 0% point is 1.0), an int, or B ints.
        labels: B true labels; accuracy is then measured against them (as Chefer's scripts do; the 0% point
            is the model's accuracy). Give target or labels, not both.
        fractions: increasing shares of patches removed; round(f·units) patches (Python's round, half to
            even) at fraction f. Default 0, 0.1, ..., 0.9 as in the paper.
        fill, grid, batch_size: as :func:`deletion`.

    Returns:
        :class:`PerturbationResult`; ``curves`` are 1.0 / 0.0 (correct or not), ``per_example`` =
        100 · trapezoid(curve, fractions), so ``value`` = 100 · area under the mean accuracy curve (in
        [0, 90] with the default fractions; the paper reports 20.05 for rollout on ViT-B / ImageNet).
    """
    return _chefer("positive", model, pixel_values, scores, target, labels, grid, fractions, fill, batch_size)


@in_eval_mode
def negative_perturbation(
    model: Any,
    pixel_values: Any,
    scores: Any,
    *,
    target: Any = None,
    labels: Any = None,
    grid: Any = None,
    fractions: Sequence[float] = CHEFER_FRACTIONS,
    fill: Any = 0.0,
    batch_size: int = 64,
) -> PerturbationResult:
    """Negative perturbation (Chefer et al. 2021): remove the least relevant patches first; a faithful map
    keeps accuracy high, so higher AUC is better (the paper reports 53.1 for rollout on ViT-B / ImageNet).
    Arguments and result as :func:`positive_perturbation`."""
    return _chefer("negative", model, pixel_values, scores, target, labels, grid, fractions, fill, batch_size)


# ------------------------------------------------------------------------------------------- registration
_UNIT = (-0.02, 1.02)  # probabilities and accuracies


@register_metric("deletion", kind="image", higher_is_better=False, ylim=_UNIT,
                 curve=("share of patches removed", "target probability"),
                 description="deletion AUC (Petsiuk et al. 2018): target probability as the most relevant patches "
                             "are removed")
def _deletion_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return MetricValues.of_curves(deletion(inp.model, inp.inputs, scores, steps=inp.option("steps"),
                                           fill=inp.option("fill", 0.0), target=inp.target, grid=grid,
                                           batch_size=inp.batch_size))


@register_metric("insertion", kind="image", higher_is_better=True, ylim=_UNIT,
                 curve=("share of patches restored", "target probability"),
                 description="insertion AUC (Petsiuk et al. 2018): target probability as the most relevant patches "
                             "are restored")
def _insertion_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return MetricValues.of_curves(insertion(inp.model, inp.inputs, scores, steps=inp.option("steps"),
                                            target=inp.target, grid=grid, batch_size=inp.batch_size))


def _chefer_values(fn: Callable, inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return MetricValues.of_curves(fn(inp.model, inp.inputs, scores, fill=inp.option("fill", 0.0), target=inp.target,
                                     grid=grid, batch_size=inp.batch_size))


@register_metric("positive", kind="image", higher_is_better=False, ylim=_UNIT, fmt=".1f",
                 curve=("share removed (most relevant first)", "accuracy"),
                 description="positive-perturbation AUC x100 (Chefer et al. 2021): accuracy, 0-90% most relevant "
                             "removed")
def _positive_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return _chefer_values(positive_perturbation, inp, scores, grid)


@register_metric("negative", kind="image", higher_is_better=True, ylim=_UNIT, fmt=".1f",
                 curve=("share removed (least relevant first)", "accuracy"),
                 description="negative-perturbation AUC x100 (Chefer et al. 2021): accuracy, 0-90% least relevant "
                             "removed")
def _negative_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return _chefer_values(negative_perturbation, inp, scores, grid)
