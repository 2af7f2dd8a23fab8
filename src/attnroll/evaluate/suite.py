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
from .._modes import in_eval_mode
from ..methods import batch_size_of, explain_batches, method_info, take_rows
from ._common import batched_logits, chunks, image_forward, logits_of, nanmean, scoring_progress
from .registry import METRICS, MetricInputs, metric_info, metric_names

#: Default methods of ``attnroll evaluate`` (the random control last).
DEFAULT_METHODS = ("rollout", "flow", "gae", "grad_rollout", "raw", "integrated_gradients", "random")

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
        higher = metric_info(metric).higher_is_better
        vals = {m: self.values[m][metric] for m in self.methods if not math.isnan(self.values[m][metric])}
        return (max if higher else min)(vals, key=vals.get)

    def heading(self, metric: str) -> str:
        """The column heading of ``metric``: its name and an arrow saying which way is better."""
        return f"{metric} {'↑' if metric_info(metric).higher_is_better else '↓'}"

    def cell(self, method: str, metric: str) -> str:
        """"mean±stderr" of ``method`` on ``metric``, in the metric's table format."""
        fmt = metric_info(metric).fmt
        return f"{self.values[method][metric]:{fmt}}±{self.stderr[method][metric]:{fmt}}"

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
        head = ["method"] + [self.heading(k) for k in self.metrics] + ["s"]
        body = []
        for m in self.methods:
            cells = [m] + [self.cell(m, k) for k in self.metrics]
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
        kinds = [k for k in self.metrics if metric_info(k).curve is not None]
        if not kinds:
            raise ValueError("no perturbation or AOPC metric was computed, so there are no curves to plot")
        if fig is None:
            fig = plt.figure(figsize=(4.2 * len(kinds), 3.6))
        axes = fig.subplots(1, len(kinds), squeeze=False)[0]
        for ax, k in zip(axes, kinds):
            info = metric_info(k)
            for m in self.methods:
                f, c = self.curves[m][k]
                style = dict(color="0.5", linestyle="--") if m == "random" else {}
                ax.plot(f, c, label=f"{m} ({self.values[m][k]:.3g})", **style)
            ax.set_title(f"{k} ({'higher' if info.higher_is_better else 'lower'} is better)", fontsize=10)
            ax.set_xlabel(info.curve[0], fontsize=9)
            ax.set_ylabel(info.curve[1], fontsize=9)
            if info.ylim is not None:
                ax.set_ylim(*info.ylim)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        return fig


def explain_scores(model: Any, pixel_values: Any, method: str, *, target: Any = None,
                   batch_size: int = 64, **options: Any) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """Explain ``pixel_values`` (B, 3, H, W) — or a tokenizer's dict of (B, n) tensors — in chunks with one
    method; returns scores (B, units) float32 and the patch grid (None for text). Gradient methods run with gradients
    enabled (and only they). ``target`` None / int / list of B
    ints; the ``random`` control gets a distinct seed per example (``seed`` + index), so chunking does not
    repeat maps."""
    r = explain_batches(model, pixel_values, method, target=target, batch_size=batch_size, **options)
    return r.scores, r.grid


def _model_inputs(inputs: Any) -> tuple[str, Any, Any, int]:
    """(kind "image" / "text", what the model and the methods see, what the metrics see, B), validated."""
    if isinstance(inputs, Mapping):
        enc = _checks.check_text_inputs(inputs)
        full = dict(inputs)  # the AOPC metrics read special_tokens_mask from it; the model must not see it
        x = {k: v for k, v in full.items() if k != "special_tokens_mask"}
        return "text", x, full, int(enc["input_ids"].shape[0])
    x, _ = _checks.as_tensor("inputs", inputs)
    if x.ndim != 4 or not x.is_floating_point():
        raise ValueError(
            "inputs must be float pixel values (B, C, H, W) or a tokenizer's dict with input_ids, got "
            f"{_checks.describe(inputs)}"
        )
    return "image", x, x, int(x.shape[0])


def _method_names(methods: Any) -> list[str]:
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("methods is empty; give at least one name from attnroll.methods()")
    for m in methods:
        method_info(m)  # an unknown name fails here, before any work, with the list of methods
    return methods


def _metric_list(metrics: Sequence[str] | None, kind: str, has_masks: bool) -> list[str]:
    """The metrics asked for (default: every one that applies to ``kind``, those needing masks only with
    masks), validated against the registry."""
    if metrics is None:
        metrics = [k for k in metric_names(kind) if has_masks or not metric_info(k).needs_masks]
    metrics = [_checks.check_choice("metrics", k, tuple(METRICS)) for k in metrics]
    if not metrics:
        raise ValueError(f"metrics is empty; choose from {', '.join(METRICS)}")
    wrong = [k for k in metrics if not metric_info(k).applies_to(kind)]
    if wrong:
        what = "a text classifier's tokens" if kind == "text" else "image patches"
        raise ValueError(f"metrics {wrong} do not apply to {what}; use {', '.join(metric_names(kind))}")
    if any(metric_info(k).needs_masks for k in metrics) and not has_masks:
        raise ValueError(f"the localisation metrics ({', '.join(metric_names(masks=True))}) need masks= (object "
                         "masks per unit)")
    return metrics


def _predictions(model: Any, x: Any, kind: str, batch_size: int) -> torch.Tensor:
    """The model's logits (B, C), float32 on the CPU, ``batch_size`` inputs at a time."""
    if kind == "text":
        B = batch_size_of(x)
        with torch.no_grad():
            return torch.cat([logits_of(model(**take_rows(x, sl, B))).float().cpu() for sl in chunks(B, batch_size)])
    return batched_logits(image_forward(model), x, batch_size)


def _probe(model: Any, x: Any, methods: list[str], tgt: Any, method_options: dict) -> None:
    """A method that cannot serve this model (an encoder-decoder method on a ViT, CLIP's on a classifier)
    fails here on one example, before minutes of work on the others."""
    t0 = tgt[:1] if isinstance(tgt, (list, tuple)) else (tgt.tolist()[:1] if isinstance(tgt, torch.Tensor) else tgt)
    for m in methods:
        opts = method_options.get(m, {})
        try:
            explain_scores(model, take_rows(x, slice(0, 1)), m, target=t0, **opts)
        except (ValueError, TypeError, RuntimeError) as e:
            # the options are quoted: a bad option value fails here too, not only an unsuitable model
            given = f" with {', '.join(f'{k}={v!r}' for k, v in opts.items())}" if opts else ""
            raise ValueError(f"method {m!r}{given} cannot explain this model: {e}") from e


@in_eval_mode
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
    progress: Callable[[str], None] | bool | None = None, maps: dict[str, Any] | None = None,
) -> EvaluationResult:
    """Score several methods' maps on one classifier, side by side, with the registered metrics
    (:mod:`attnroll.evaluate.registry`).

    Image models (``inputs`` = pixel values (B, C, H, W)): deletion / insertion AUC and positive / negative
    perturbation AUC over patches. Text classifiers (``inputs`` = a tokenizer's dict / BatchEncoding with
    ``input_ids``): AOPC comprehensiveness and sufficiency over tokens. Given ``masks``: images, the pointing
    game, relevance mass and top-k IoU against the object patches; text, the evidence-token mass, pointing
    game and top-k F1 against the evidence tokens (special tokens and padding excluded).

    Args:
        model: a classifier ``explain`` supports, in eval mode.
        inputs: (B, 3, H, W) preprocessed pixel values, or a dict of (B, n) tensors (``input_ids``,
            ``attention_mask``, optionally ``token_type_ids`` / ``special_tokens_mask``).
        methods: registered method names (see ``attnroll.methods()``), or one comma-separated string.
        labels: (B,) true classes: reported as the model's accuracy; the metrics still explain and score the
            *predicted* class (Chefer et al.'s "predicted class" protocol).
        masks: (B, h, w) or (B, units) bool masks over the units (e.g. ``patch_masks(masks)`` on the shapes
            data); enables the localisation metrics.
        metrics: registered metric names (see :data:`METRICS`; default: every metric of the input kind, plus
            those needing masks when ``masks`` is given).
        target: classes to explain and score (None = predicted class; an int or B ints).
        method_options: method name -> options for that method (e.g. ``{"flow": {"n_jobs": 2}}``).
        fill: images: what replaces removed patches (deletion, positive, negative), in model-input space: a
            float (0.0 = the mean for inputs normalised to zero mean) or a tensor broadcastable to one image,
            e.g. a black picture run through the model's preprocessing (Chefer et al. zero pixels before
            normalisation; ``attnroll evaluate`` does that by default). Insertion starts from a blurred image.
        steps: images: deletion / insertion steps (None = one per patch).
        bins, keep: text: the AOPC bins (default ERASER's 1, 5, 10, 20, 50%) and the (B, n) tokens never
            removed (default the special tokens); see :mod:`attnroll.evaluate.text`.
        batch_size: inputs per forward pass when explaining. Scoring runs many perturbed copies of small
            images per forward pass: at least ``batch_size``, up to about 32 MB of pixels (a 64x64 image: 682
            copies), which is several times faster when a pass of a small model costs little (fewer passes,
            and far less time lost between threads on a busy machine); the scores are the same.
        progress: a callable, called with a short message before each method (e.g. ``print``); or True: a
            progress bar on stderr over the whole run (explaining and scoring), with the time left.
        maps: method -> precomputed maps (an Explanation of the B inputs): scored, not run (see _given_maps).

    Returns:
        an :class:`EvaluationResult` (``summary()``, ``to_csv()``, ``plot()``, ``best(metric)``).
    """
    kind, x, full, B = _model_inputs(inputs)
    if B == 0:
        raise ValueError("inputs hold no examples (B = 0); nothing to evaluate")
    methods = _method_names(methods)
    metrics = _metric_list(metrics, kind, masks is not None)
    method_options = dict(method_options or {})
    unknown = set(method_options) - set(methods)
    if unknown:
        raise ValueError(f"method_options names methods that are not evaluated: {sorted(unknown)}")
    batch_size, given = _checks.check_int("batch_size", batch_size, low=1), _given_maps(maps, methods, B)
    pred = _predictions(model, x, kind, batch_size).argmax(dim=1)
    accuracy = _accuracy(pred, labels, B)
    tgt = pred.tolist() if target is None else target
    _probe(model, x, [m for m in methods if m not in given], tgt, method_options)
    inp = MetricInputs(model, full, tgt, masks, scoring_batch_size(batch_size, kind, x),
                       {"fill": fill, "steps": steps, "bins": bins, "keep": keep})
    res = EvaluationResult(methods, list(metrics), {}, {}, {}, {}, {}, {}, B, accuracy)
    with _Progress(progress, len(methods) * (1 + len(metrics))) as report:
        for m in methods:
            _run_method(res, m, inp, x, given, batch_size, method_options.get(m, {}), report)
    return res


def _run_method(res: EvaluationResult, m: str, inp: MetricInputs, x: Any, given: dict, batch_size: int,
                options: dict, report: "_Progress") -> None:
    """Explain the inputs with method ``m`` (or take its given maps), time it, and score its maps."""
    report.stage(f"{m}: explaining {res.n} inputs", announce=True)
    t0 = time.perf_counter()
    scores, grid = given[m] if m in given else explain_scores(inp.model, x, m, target=inp.target,
                                                              batch_size=batch_size, **options)
    res.seconds[m] = time.perf_counter() - t0
    report.stage_done()
    _score_method(res, m, inp, scores, grid, report)


#: Pixels (elements) of the perturbed copies one scoring forward pass takes at most, unless ``batch_size``
#: asks for more: 32 MB of float32.
SCORING_ELEMENTS = 1 << 23


def scoring_batch_size(batch_size: int, kind: str, x: Any) -> int:
    """Copies per scoring forward pass: images, at least ``batch_size`` and up to :data:`SCORING_ELEMENTS`
    pixels; text, ``batch_size`` (a sequence's cost grows with the model, not with what is visible here)."""
    if kind != "image":
        return batch_size
    per_copy = max(1, int(np.prod(x.shape[1:])))
    return max(batch_size, SCORING_ELEMENTS // per_copy)


class _Progress:
    """The progress of ``evaluate_methods``: messages to a callable (one per method), or a bar over the whole
    run (``progress=True``) advanced by one per stage (a method explained, one metric scored), fractionally
    while a metric scores its perturbed copies."""

    def __init__(self, progress: Any, stages: int) -> None:
        from .._system import ProgressBar

        self.say = progress if callable(progress) else None
        self.bar = ProgressBar(stages, True, "evaluate", unit="stages") if progress is True else None
        self.part = 0.0  # how much of the running stage the bar has been advanced by

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()

    def stage(self, text: str, announce: bool = False) -> None:
        """A stage begins: its text on the bar; ``announce``: also as a message to the callable."""
        if self.say is not None and announce:
            self.say(text)
        if self.bar is not None:
            self.bar.describe(text)

    def tick(self, done: int, total: int) -> None:
        if self.bar is not None and total > 0:
            step = min(done / total, 1.0 - self.part)
            self.part += step
            self.bar(step)

    def stage_done(self) -> None:
        if self.bar is not None:
            self.bar(1.0 - self.part)
        self.part = 0.0


def _accuracy(pred: torch.Tensor, labels: Any, B: int) -> float | None:
    """Share of predictions equal to ``labels`` (B,), or None without labels."""
    if labels is None:
        return None
    lab = torch.as_tensor(labels).reshape(-1)
    if lab.shape[0] != B:
        raise ValueError(f"labels has {lab.shape[0]} entries but the inputs hold B={B} examples")
    return float((pred == lab).float().mean())


def _given_maps(maps: Any, methods: list[str], B: int) -> dict[str, tuple[torch.Tensor, Any]]:
    """``maps=`` checked: method -> (scores (B, units) float32, grid or None); every key is an evaluated method.
    A value is an :class:`~attnroll.Explanation` of the B inputs (e.g. ``attnroll.batch.explanations(DIR,
    method)[0]`` of an ``attnroll batch`` output) or a (B, units) tensor; its method's ``seconds`` are 0."""
    out = {}
    for m, v in (maps or {}).items():
        if m not in methods:
            raise ValueError(f"maps has maps of {m!r}, which is not among the evaluated methods {methods}")
        grid = getattr(v, "grid", None)
        scores = _checks.check_scores(f"maps[{m!r}]", v, batch=B)
        out[m] = (scores.detach().to(torch.float32).cpu(), None if grid is None else (int(grid[0]), int(grid[1])))
    return out


def _score_method(res: EvaluationResult, m: str, inp: MetricInputs, scores: torch.Tensor, grid: Any,
                  report: _Progress | None = None) -> None:
    """Every metric of ``res`` for method ``m``'s scores, filled into ``res``."""
    res.curves[m], per = {}, {}
    for k in res.metrics:
        if report is not None:
            report.stage(f"{m}: scoring {k}")
        with scoring_progress(None if report is None else report.tick):
            v = metric_info(k).compute(inp, scores, grid)
        if report is not None:
            report.stage_done()
        per[k] = np.asarray(v.per_example, dtype=np.float64)
        if v.curve is not None:
            res.curves[m][k] = v.curve
        if v.chance is not None:
            res.chance[k] = nanmean(v.chance)
    res.per_example[m] = per
    res.values[m] = {k: nanmean(v) for k, v in per.items()}
    res.stderr[m] = {k: _stderr(v) for k, v in per.items()}


def _stderr(v: np.ndarray) -> float:
    v = v[np.isfinite(v)]
    return float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
