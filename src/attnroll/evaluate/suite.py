"""Evaluate several methods on one image model and dataset: every perturbation and localisation metric, side by
side, as one table (``evaluate_methods``). This is what ``attnroll evaluate`` prints and EVALUATION.md records.

The metrics themselves live in :mod:`.perturbation` and :mod:`.localisation`; this module only explains the
inputs once per method (in batches, with gradients enabled for the methods that need them) and gathers results.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .. import _checks
from ._common import chunks

#: Default methods of ``attnroll evaluate`` (the random control last).
DEFAULT_METHODS = ("rollout", "flow", "gae", "grad_rollout", "raw", "integrated_gradients", "random")

#: metric name -> (what it is, whether higher is better). Order = column order of the table.
METRICS: dict[str, tuple[str, bool]] = {
    "deletion": ("deletion AUC (Petsiuk et al. 2018): target probability as the most relevant patches are removed", False),
    "insertion": ("insertion AUC (Petsiuk et al. 2018): target probability as the most relevant patches are restored", True),
    "positive": ("positive-perturbation AUC x100 (Chefer et al. 2021): accuracy, 0-90% most relevant removed", False),
    "negative": ("negative-perturbation AUC x100 (Chefer et al. 2021): accuracy, 0-90% least relevant removed", True),
    "comprehensiveness": ("AOPC comprehensiveness (DeYoung et al. 2020): probability drop without the top tokens", True),
    "sufficiency": ("AOPC sufficiency (DeYoung et al. 2020): probability drop with only the top tokens", False),
    "pointing": ("pointing game: share of maps whose top patch lies on the object", True),
    "mass": ("relevance mass inside the object mask (Arras et al. 2022)", True),
    "iou": ("IoU of the top-k patches with the object mask (k = mask size)", True),
}
PERTURBATION = ("deletion", "insertion", "positive", "negative")
TEXT = ("comprehensiveness", "sufficiency")
LOCALISATION = ("pointing", "mass", "iou")
CURVES = PERTURBATION + TEXT


@dataclass
class EvaluationResult:
    """Metrics of several methods on the same model and inputs.

    Attributes:
        methods: method names, in the order asked.
        metrics: the metric names computed (keys of :data:`METRICS`).
        values: method -> metric -> mean over examples.
        stderr: method -> metric -> standard error of that mean (NaN-aware; 0 for a single example).
        per_example: method -> metric -> (B,) values.
        curves: method -> perturbation metric -> (fractions (S,), mean curve (S,)).
        chance: localisation metric -> what a uniformly random map scores in expectation (mean over examples).
        seconds: method -> wall-clock seconds spent explaining the inputs (not scoring).
        n: number of examples; accuracy: share of examples the model classifies correctly (None without labels).
    """

    methods: list[str]
    metrics: list[str]
    values: dict[str, dict[str, float]]
    stderr: dict[str, dict[str, float]]
    per_example: dict[str, dict[str, np.ndarray]]
    curves: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]
    chance: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    n: int = 0
    accuracy: float | None = None

    def best(self, metric: str) -> str:
        """The method with the best mean on ``metric`` (lowest for deletion / positive, else highest)."""
        higher = METRICS[metric][1]
        vals = {m: self.values[m][metric] for m in self.methods if not math.isnan(self.values[m][metric])}
        return (max if higher else min)(vals, key=vals.get)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per method: method, each metric and its standard error (``<metric>_se``), seconds."""
        out = []
        for m in self.methods:
            row: dict[str, Any] = {"method": m}
            for k in self.metrics:
                row[k] = self.values[m][k]
                row[f"{k}_se"] = self.stderr[m][k]
            row["seconds"] = self.seconds.get(m, float("nan"))
            out.append(row)
        return out

    def to_csv(self) -> str:
        """The table as CSV text (header + one line per method; floats with 6 significant digits)."""
        rows = self.rows()
        keys = list(rows[0]) if rows else ["method"]
        lines = [",".join(keys)]
        for r in rows:
            lines.append(",".join(r[k] if isinstance(r[k], str) else f"{r[k]:.6g}" for k in keys))
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        """A plain-text table: mean ± standard error per method and metric, arrows saying which way is better,
        and the chance level of the localisation metrics."""
        head = ["method"] + [f"{k} {'↑' if METRICS[k][1] else '↓'}" for k in self.metrics] + ["s"]
        body = []
        for m in self.methods:
            cells = [m] + [f"{self.values[m][k]:.3f}±{self.stderr[m][k]:.3f}" if k not in ("positive", "negative")
                           else f"{self.values[m][k]:.1f}±{self.stderr[m][k]:.1f}" for k in self.metrics]
            body.append(cells + [f"{self.seconds.get(m, float('nan')):.2f}"])
        if self.chance:
            body.append(["(chance)"] + [f"{self.chance[k]:.3f}" if k in self.chance else "" for k in self.metrics]
                        + [""])
        widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
        fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
        acc = "" if self.accuracy is None else f", model accuracy {self.accuracy:.3f}"
        return "\n".join([f"{self.n} examples{acc}", fmt(head)] + [fmt(r) for r in body])

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: the table, the chance levels and the mean curves."""
        return {
            "n": self.n,
            "accuracy": self.accuracy,
            "rows": self.rows(),
            "chance": dict(self.chance),
            "curves": {m: {k: {"fractions": f.tolist(), "mean": c.tolist()} for k, (f, c) in cv.items()}
                       for m, cv in self.curves.items()},
        }

    def plot(self, fig: Any = None) -> Any:
        """A matplotlib figure of the mean perturbation curves: one panel per perturbation metric, one line per
        method (needs the ``viz`` extra)."""
        from ..viz import deps as _deps

        plt = _deps.pyplot("EvaluationResult.plot")
        kinds = [k for k in self.metrics if k in CURVES]
        if not kinds:
            raise ValueError("no perturbation or AOPC metric was computed, so there are no curves to plot")
        if fig is None:
            fig = plt.figure(figsize=(4.2 * len(kinds), 3.6))
        axes = fig.subplots(1, len(kinds), squeeze=False)[0]
        xlabel = {"deletion": "share of patches removed", "insertion": "share of patches restored",
                  "positive": "share removed (most relevant first)", "negative": "share removed (least relevant first)",
                  "comprehensiveness": "share of tokens deleted (top first)",
                  "sufficiency": "share of tokens kept (top first)"}
        ylabel = {"deletion": "target probability", "insertion": "target probability",
                  "positive": "accuracy", "negative": "accuracy",
                  "comprehensiveness": "probability drop", "sufficiency": "probability drop"}
        for ax, k in zip(axes, kinds):
            for m in self.methods:
                f, c = self.curves[m][k]
                style = dict(color="0.5", linestyle="--") if m == "random" else {}
                ax.plot(f, c, label=f"{m} ({self.values[m][k]:.3g})", **style)
            ax.set_title(f"{k} ({'higher' if METRICS[k][1] else 'lower'} is better)", fontsize=10)
            ax.set_xlabel(xlabel[k], fontsize=9)
            ax.set_ylabel(ylabel[k], fontsize=9)
            if k in PERTURBATION:
                ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        return fig


def explain_scores(model: Any, pixel_values: Any, method: str, *, target: Any = None,
                   batch_size: int = 64, **options: Any) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """Explain ``pixel_values`` (B, 3, H, W) — or a tokenizer's dict of (B, n) tensors — in chunks with one
    method; returns scores (B, units) float32 and the patch grid (None for text). Gradient methods run with gradients enabled (and only they). ``target`` None / int / list of B
    ints; the ``random`` control gets a distinct seed per example (``seed`` + index), so chunking does not
    repeat maps."""
    from ..methods import explain_batches

    r = explain_batches(model, pixel_values, method, target=target, batch_size=batch_size, **options)
    return r.scores, r.grid


def evaluate_methods(
    model: Any,
    inputs: Any,
    methods: Sequence[str] = DEFAULT_METHODS,
    *,
    labels: Any = None,
    masks: Any = None,
    metrics: Sequence[str] | None = None,
    target: Any = None,
    method_options: dict[str, dict[str, Any]] | None = None,
    fill: Any = 0.0,
    steps: int | None = None,
    bins: Sequence[float] | None = None,
    keep: Any = None,
    batch_size: int = 64,
    progress: Callable[[str], None] | None = None,
) -> EvaluationResult:
    """Score several methods' maps on one classifier, side by side.

    Image models (``inputs`` = pixel values (B, C, H, W)): deletion / insertion AUC and positive / negative
    perturbation AUC over patches. Text classifiers (``inputs`` = a tokenizer's dict / BatchEncoding with
    ``input_ids``): AOPC comprehensiveness and sufficiency over tokens. Either kind, given ``masks``: the
    pointing game, relevance mass and top-k IoU against them (object patches, or rationale tokens).

    Args:
        model: a classifier ``explain`` supports, in eval mode.
        inputs: (B, 3, H, W) preprocessed pixel values, or a dict of (B, n) tensors (``input_ids``,
            ``attention_mask``, optionally ``token_type_ids`` / ``special_tokens_mask``).
        methods: registered method names (see ``attnroll.methods()``), or one comma-separated string.
        labels: (B,) true classes: reported as the model's accuracy; the metrics still explain and score the
            *predicted* class (Chefer et al.'s "predicted class" protocol).
        masks: (B, h, w) or (B, units) bool masks over the units (e.g. ``patch_masks(masks)`` on the shapes
            data); enables the localisation metrics.
        metrics: subset of :data:`METRICS` (default: every faithfulness metric of the input kind, plus the
            localisation metrics when ``masks`` is given).
        target: classes to explain and score (None = predicted class; an int or B ints).
        method_options: method name -> options for that method (e.g. ``{"flow": {"n_jobs": 2}}``).
        fill: images: what replaces removed patches (deletion, positive, negative), in model-input space: a
            float (0.0 = the mean for inputs normalised to zero mean) or a tensor broadcastable to one image,
            e.g. a black picture run through the model's preprocessing (Chefer et al. zero pixels before
            normalisation; ``attnroll evaluate`` does that by default). Insertion starts from a blurred image.
        steps: images: deletion / insertion steps (None = one per patch).
        bins, keep: text: the AOPC bins (default ERASER's 1, 5, 10, 20, 50%) and the (B, n) tokens never
            removed (default the special tokens); see :mod:`attnroll.evaluate.text`.
        batch_size: inputs per forward pass, for explaining and for scoring.
        progress: called with a short message before each method (e.g. ``print``).

    Returns:
        an :class:`EvaluationResult` (``summary()``, ``to_csv()``, ``plot()``, ``best(metric)``).
    """
    from . import perturbation as pert
    from . import text as aopc
    from ._common import batched_logits, image_forward, logits_of
    from .localisation import localisation as localise  # (the package's `localisation` is this function)

    is_text = isinstance(inputs, Mapping)
    if is_text:
        enc = _checks.check_text_inputs(inputs)
        full = dict(inputs)  # the AOPC metrics read special_tokens_mask from it; the model must not see it
        x: Any = {k: v for k, v in full.items() if k != "special_tokens_mask"}
        B = int(enc["input_ids"].shape[0])
    else:
        x, _ = _checks.as_tensor("inputs", inputs)
        if x.ndim != 4 or not x.is_floating_point():
            raise ValueError(
                "inputs must be float pixel values (B, C, H, W) or a tokenizer's dict with input_ids, got "
                f"{_checks.describe(inputs)}"
            )
        B = int(x.shape[0])
    if B == 0:
        raise ValueError("inputs hold no examples (B = 0); nothing to evaluate")
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("methods is empty; give at least one name from attnroll.methods()")
    from ..methods.base import method_info

    for m in methods:
        method_info(m)  # an unknown name fails here, before any work, with the list of methods
    faithful = TEXT if is_text else PERTURBATION
    if metrics is None:
        metrics = list(faithful) + (list(LOCALISATION) if masks is not None else [])
    metrics = [_checks.check_choice("metrics", k, tuple(METRICS)) for k in metrics]
    if not metrics:
        raise ValueError(f"metrics is empty; choose from {', '.join(METRICS)}")
    wrong = [k for k in metrics if k in CURVES and k not in faithful]
    if wrong:
        kind = "a text classifier's tokens" if is_text else "image patches"
        raise ValueError(f"metrics {wrong} do not apply to {kind}; use {', '.join(faithful + LOCALISATION)}")
    if any(k in LOCALISATION for k in metrics) and masks is None:
        raise ValueError("the localisation metrics (pointing, mass, iou) need masks= (object masks per unit)")
    method_options = dict(method_options or {})
    unknown = set(method_options) - set(methods)
    if unknown:
        raise ValueError(f"method_options names methods that are not evaluated: {sorted(unknown)}")
    batch_size = _checks.check_int("batch_size", batch_size, low=1)

    if is_text:
        with torch.no_grad():
            logits = torch.cat([logits_of(model(**_take(x, sl))).float().cpu() for sl in chunks(B, batch_size)])
    else:
        logits = batched_logits(image_forward(model), x, batch_size)
    pred = logits.argmax(dim=1)
    accuracy = None
    if labels is not None:
        lab = torch.as_tensor(labels).reshape(-1)
        if lab.shape[0] != B:
            raise ValueError(f"labels has {lab.shape[0]} entries but the inputs hold B={B} examples")
        accuracy = float((pred == lab).float().mean())
    tgt = pred.tolist() if target is None else target
    # A method that cannot serve this model (an encoder-decoder method on a ViT, CLIP's on a classifier) fails
    # here on one example, before minutes of work on the others.
    t0_ = tgt[:1] if isinstance(tgt, (list, tuple)) else (tgt.tolist()[:1] if isinstance(tgt, torch.Tensor) else tgt)
    for m in methods:
        try:
            explain_scores(model, _take(x, slice(0, 1)), m, target=t0_, **method_options.get(m, {}))
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"method {m!r} cannot explain this model: {e}") from e

    values: dict[str, dict[str, float]] = {}
    stderr: dict[str, dict[str, float]] = {}
    per_example: dict[str, dict[str, np.ndarray]] = {}
    curves: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    seconds: dict[str, float] = {}
    chance: dict[str, float] = {}
    text_kw = {"target": tgt, "keep": keep, "batch_size": batch_size, **({"bins": bins} if bins is not None else {})}
    for m in methods:
        if progress is not None:
            progress(f"{m}: explaining {B} inputs")
        t0 = time.perf_counter()
        scores, grid = explain_scores(model, x, m, target=tgt, batch_size=batch_size, **method_options.get(m, {}))
        seconds[m] = time.perf_counter() - t0
        per: dict[str, np.ndarray] = {}
        curves[m] = {}
        common = dict(target=tgt, grid=grid, batch_size=batch_size)
        for k in metrics:
            if k not in CURVES:
                continue
            if k == "deletion":
                r = pert.deletion(model, x, scores, steps=steps, fill=fill, **common)
            elif k == "insertion":
                r = pert.insertion(model, x, scores, steps=steps, **common)
            elif k == "positive":
                r = pert.positive_perturbation(model, x, scores, fill=fill, **common)
            elif k == "negative":
                r = pert.negative_perturbation(model, x, scores, fill=fill, **common)
            elif k == "comprehensiveness":
                r = aopc.comprehensiveness(model, full, scores, **text_kw)
            else:
                r = aopc.sufficiency(model, full, scores, **text_kw)
            per[k] = np.asarray(r.per_example, dtype=np.float64)
            curves[m][k] = (np.asarray(r.fractions), np.asarray(r.mean_curve()))
        if any(k in LOCALISATION for k in metrics):
            lr = localise(scores, masks)
            got = {"pointing": lr.pointing, "mass": lr.mass, "iou": lr.iou}
            chance_all = {"pointing": lr.chance_pointing, "mass": lr.chance_mass, "iou": lr.chance_iou}
            for k in LOCALISATION:
                if k in metrics:
                    per[k] = np.asarray(got[k], dtype=np.float64)
                    chance[k] = float(np.nanmean(chance_all[k]))
        per_example[m] = {k: per[k] for k in metrics}
        values[m] = {k: float(np.nanmean(v)) if np.isfinite(v).any() else float("nan") for k, v in per.items()}
        stderr[m] = {k: _stderr(v) for k, v in per.items()}
    return EvaluationResult(methods, list(metrics), values, stderr, per_example, curves, chance, seconds, B, accuracy)


def _batch_size(inputs: Any) -> int:
    if isinstance(inputs, Mapping):
        return int(inputs["input_ids"].shape[0])
    return int(inputs.shape[0])


def _take(inputs: Any, sl: slice) -> Any:
    """Rows ``sl`` of a pixel tensor, or of every batched tensor in a tokenizer's dict."""
    if isinstance(inputs, Mapping):
        return {k: v[sl] if isinstance(v, torch.Tensor) and v.ndim >= 1 else v for k, v in inputs.items()}
    return inputs[sl]


def _stderr(v: np.ndarray) -> float:
    v = v[np.isfinite(v)]
    return float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
