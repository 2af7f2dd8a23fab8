"""Checkpoint audits: how a model's explanations shift between two checkpoints of it (``audit``).

Both models explain the same inputs with the same method. Each map's positive part is normalised to sum 1,
so that it reads as a distribution of relevance over the input units, and the two distributions are compared
per example (Jensen-Shannon divergence, Spearman rank correlation, top-k overlap) and per *region* (the
share of the map inside a set of units: "object", "marker", "background" for the shapes data, or
"centre" / "border" / "corners" of the patch grid for any image model). A shift of mass between regions that
is larger than ``shift_threshold`` and whose paired bootstrap confidence interval excludes zero flags the
pair, as does a mean divergence above ``js_threshold``: e.g. a fine-tuned copy that learnt to read a corner
marker instead of the object moves its mass onto the marker's patch.
"""

from __future__ import annotations

import base64
import html
import io
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import _checks
from .._callable import make_callable as _make_callable
from .._io import atomic_write
from .._modes import eval_mode
from ..methods import explain_batches, method_info
from ..viz.notebook import NotebookView
from ._common import batched_logits, chunks, image_forward, logits_of, nanmean, relevance_order, spearman_rows

__all__ = ["AuditReport", "audit", "shapes_regions", "grid_regions", "js_divergence"]

_SUFFIXES = (".html", ".png")


# ------------------------------------------------------------------------------------------------ report
@dataclass
class AuditReport(NotebookView):
    """How the explanations of model B differ from those of model A on the same inputs.

    Attributes:
        method: the explanation method; ``grid``: the patch grid (h, w) (None for token units); ``k``: the
            top-k size.
        maps_a, maps_b: (B, units) float64: each map's positive part divided by its sum (a map with no
            positive mass becomes uniform).
        js: (B,) Jensen-Shannon divergence between the two maps, base 2, in [0, 1] (0 = identical).
        spearman: (B,) Spearman rank correlation of the two normalised maps (NaN where one is constant).
        topk: (B,) share of the k most relevant units (ties by position) that the two maps have in common.
        regions: name -> (B, units) bool region masks; ``mass_a`` / ``mass_b``: name -> (B,) map mass inside
            the region; ``shift``: name -> mean of ``mass_b - mass_a``; ``shift_ci``: name -> paired bootstrap
            95% percentile interval of that mean.
        flagged: whether the reliance changed (see :func:`audit`); ``reasons``: one line per cause.
        order: example indices, highest JS first (ties by index).
        pred_a, pred_b: (B,) the class each model predicts.
        settings: the thresholds and bootstrap settings used (for ``summary`` / ``as_dict``).
    """

    method: str
    grid: tuple[int, int] | None
    k: int
    maps_a: np.ndarray
    maps_b: np.ndarray
    js: np.ndarray
    spearman: np.ndarray
    topk: np.ndarray
    regions: dict[str, np.ndarray]
    mass_a: dict[str, np.ndarray]
    mass_b: dict[str, np.ndarray]
    shift: dict[str, float]
    shift_ci: dict[str, tuple[float, float]]
    flagged: bool
    reasons: list[str]
    order: np.ndarray
    pred_a: np.ndarray
    pred_b: np.ndarray
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.js.shape[0])

    def summary(self) -> str:
        """Several lines: the mean similarity statistics, each region's mass shift with its CI, the verdict."""
        grid = f", grid {self.grid[0]}x{self.grid[1]}" if self.grid else ""
        verdict = "FLAGGED: reliance changed" if self.flagged else "not flagged: no clear change of reliance"
        lines = [
            f"audit of {self.method!r} maps, model A -> model B, {self.n} examples{grid}: {verdict}",
            f"  Jensen-Shannon divergence: mean {self.js.mean():.4f}, median {np.median(self.js):.4f}, max "
            f"{self.js.max():.4f} (threshold {self.settings.get('js_threshold', float('nan'))})",
            f"  Spearman rank correlation: mean {nanmean(self.spearman):.3f}; top-{self.k} overlap: mean "
            f"{self.topk.mean():.3f}",
            f"  predictions: A and B agree on {np.mean(self.pred_a == self.pred_b):.1%} of the examples",
        ]
        if self.regions:
            lines.append("  map mass per region, A -> B, shift with paired bootstrap 95% CI:")
            width = max(len(r) for r in self.regions)
            for r in self.regions:
                lo, hi = self.shift_ci[r]
                lines.append(
                    f"    {r:<{width}}  {self.mass_a[r].mean():.3f} -> {self.mass_b[r].mean():.3f}  "
                    f"shift {self.shift[r]:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                )
        lines += [f"  reason: {r}" for r in self.reasons]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: means, per-region shifts and CIs, verdict, and the per-example statistics."""
        return {
            "method": self.method,
            "grid": None if self.grid is None else list(self.grid),
            "n": self.n,
            "k": self.k,
            "mean_js": float(self.js.mean()),
            "mean_spearman": nanmean(self.spearman),
            "mean_topk": float(self.topk.mean()),
            "prediction_agreement": float(np.mean(self.pred_a == self.pred_b)),
            "mass_a": {r: float(v.mean()) for r, v in self.mass_a.items()},
            "mass_b": {r: float(v.mean()) for r, v in self.mass_b.items()},
            "shift": {r: float(v) for r, v in self.shift.items()},
            "shift_ci": {r: [float(lo), float(hi)] for r, (lo, hi) in self.shift_ci.items()},
            "flagged": bool(self.flagged),
            "reasons": list(self.reasons),
            "settings": dict(self.settings),
            "js": [float(v) for v in self.js],
            "spearman": [None if np.isnan(v) else float(v) for v in self.spearman],
            "topk": [float(v) for v in self.topk],
            "order": [int(i) for i in self.order],
            "pred_a": [int(v) for v in self.pred_a],
            "pred_b": [int(v) for v in self.pred_b],
        }

    def figure(self, images: Any = None, n: int = 8, class_names: Any = None) -> Any:
        """A matplotlib ``Figure``: one row per example for the ``n`` most changed ones (highest JS), columns
        = the image (when ``images`` is given), map A and map B beside it (jet colours on one scale per example:
        both divided by the larger of their two maxima, so a map that lost mass looks fainter; one block per
        patch). Titles give the example index, each model's predicted class
        (``class_names[c]`` when given) and the map mass in the region with the largest mean |shift|.

        ``images``: the B input images as pictures ((B, 3, H, W) in [0, 1] or uint8, or a sequence of images),
        not the preprocessed ``pixel_values``; None draws the bare maps.
        """
        if self.grid is None:
            raise ValueError("AuditReport.figure needs image maps over a patch grid; these maps are over tokens")
        n = _checks.check_int("n", n, low=1)
        if images is not None and len(images) < self.n:
            raise ValueError(f"images holds {len(images)} images but the audit has B={self.n} examples")
        from matplotlib.figure import Figure

        from ..viz import deps as _deps
        from ..viz.overlay import to_rgb_array

        _deps.pyplot("AuditReport.figure")  # the Agg backend, and one clear error without matplotlib
        rows = [int(i) for i in self.order[:n]]
        key = max(self.shift, key=lambda r: abs(self.shift[r])) if self.shift else None
        cols = 3 if images is not None else 2
        cell = 1.9
        fig = Figure(figsize=(cols * cell, len(rows) * (cell + 0.35) + 0.3), dpi=100)
        h, w = self.grid

        def name(c: int) -> str:
            return str(class_names[c]) if class_names is not None else str(c)

        for r, b in enumerate(rows):
            cells = []
            if images is not None:
                img = to_rgb_array(images[b])
                cells.append((img, f"#{b}  JS {self.js[b]:.3f}"))
            top = max(float(self.maps_a[b].max()), float(self.maps_b[b].max()))
            for tag, maps, pred, mass in (
                ("A", self.maps_a, self.pred_a, self.mass_a),
                ("B", self.maps_b, self.pred_b, self.mass_b),
            ):
                g = maps[b].reshape(h, w) / (top if top > 0 else 1.0)  # one scale for A and B
                title = f"{tag}: {name(int(pred[b]))}" + (f", {key} {mass[key][b]:.2f}" if key else "")
                # Bare maps beside the picture rather than overlays: a blend with the image hides a small bright
                # cue (a red patch over a green marker reads as olive).
                pic = _deps.colormap("jet")(g)[..., :3]
                cells.append((pic, title))
            for c, (pic, title) in enumerate(cells):
                ax = fig.add_subplot(len(rows), cols, r * cols + c + 1)
                ax.imshow(pic, interpolation="nearest")
                ax.set_title(title, fontsize=7)
                ax.set_xticks([])
                ax.set_yticks([])
        fig.suptitle(f"{self.method}: the {len(rows)} most changed examples (A -> B)", fontsize=8)
        fig.tight_layout()
        return fig

    def save(self, path: str | os.PathLike, images: Any = None, *, n: int = 8, class_names: Any = None) -> str:
        """Write ``.html`` (the summary as a table, reasons, and the figure as an embedded PNG) or ``.png``
        (the figure; ``images``, ``n``, ``class_names`` as in :meth:`figure`), atomically. Any other suffix:
        ValueError, nothing written. Returns the path."""
        ext = os.path.splitext(os.fspath(path))[1].lower()
        if ext not in _SUFFIXES:
            raise ValueError(
                f"path must end in .html or .png (the audit's report or its figure), got {os.fspath(path)!r}"
            )
        png = _figure_png(self, images, n, class_names) if self.grid is not None else None
        if ext == ".png":
            if png is None:
                raise ValueError("a .png needs image maps over a patch grid; save token maps as .html")
            return atomic_write(path, png)
        return atomic_write(path, self._html(png))

    def _notebook_html(self) -> str:
        """The HTML report (with the figure of the most changed examples when the maps are over a patch grid
        and matplotlib is there)."""
        png = None
        if self.grid is not None:
            try:
                png = _figure_png(self, None, 8, None)
            except ImportError:
                png = None
        return self._html(png)

    def _plain_text(self) -> str:
        return self.summary()

    def _html(self, png: bytes | None) -> str:
        e = html.escape
        d = self.as_dict()
        stats = [
            ("examples", str(self.n)),
            ("method", self.method),
            ("mean Jensen-Shannon divergence", f"{d['mean_js']:.4f}"),
            ("mean Spearman rank correlation", f"{d['mean_spearman']:.3f}"),
            (f"mean top-{self.k} overlap", f"{d['mean_topk']:.3f}"),
            ("prediction agreement A/B", f"{d['prediction_agreement']:.1%}"),
            ("verdict", "FLAGGED" if self.flagged else "not flagged"),
        ]
        rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in stats)
        reg = "".join(
            f"<tr><td>{e(r)}</td><td>{d['mass_a'][r]:.3f}</td><td>{d['mass_b'][r]:.3f}</td>"
            f"<td>{self.shift[r]:+.3f}</td><td>[{self.shift_ci[r][0]:+.3f}, {self.shift_ci[r][1]:+.3f}]</td></tr>"
            for r in self.regions
        )
        reasons = "".join(f"<li>{e(r)}</li>" for r in self.reasons) or "<li>none</li>"
        img = (
            f'<img alt="most changed examples" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
            if png
            else ""
        )
        return (
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>attnroll audit</title><style>"
            "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin:0.8em 0}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}</style></head><body>\n"
            f"<h1>Checkpoint audit: {e(self.method)} maps, model A &rarr; model B</h1>\n"
            f"<table>{rows}</table>\n"
            + (
                "<h2>Map mass per region</h2><table><tr><th>region</th><th>A</th><th>B</th><th>shift</th>"
                f"<th>95% bootstrap CI</th></tr>{reg}</table>\n"
                if reg
                else ""
            )
            + f"<h2>Reasons</h2><ul>{reasons}</ul>\n{img}\n<pre>{e(self.summary())}</pre>\n</body></html>\n"
        )


def _figure_png(report: AuditReport, images: Any, n: int, class_names: Any) -> bytes:
    fig = report.figure(images, n=n, class_names=class_names)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ audit
def audit(
    model_a: Any,
    model_b: Any,
    pixel_values: Any,
    *,
    method: str = "rollout",
    target: Any = None,
    regions: dict[str, Any] | None = None,
    top_k: int = 5,
    batch_size: int = 64,
    js_threshold: float = 0.05,
    shift_threshold: float = 0.05,
    n_boot: int = 1000,
    seed: int = 0, maps_a: Any = None, maps_b: Any = None,
    **options: Any,
) -> AuditReport:
    """Compare the explanations of two checkpoints of an image model on the same inputs.

    Args:
        model_a, model_b: the two models (e.g. before and after fine-tuning), anything ``attnroll.explain``
            supports; they must explain the same input units (same patch grid). Both run in eval mode
            (their training/eval state is restored afterwards); neither is modified.
        pixel_values: (B, C, H, W) model inputs (preprocessed), B >= 1; or a text classifier's tokenizer dict.
        method: the explanation method (gradient methods run with autograd enabled, in chunks).
        target: None = each model explains the class *it* predicts (so a model that changed its answer is
            explained for its new answer); an int = that class for every example and both models; a list /
            tensor of B ints = one class per example; a callable ``f(outputs) -> (B,)``.
        regions: name -> (B, units) or (B, h, w) bool masks of input units, e.g. :func:`shapes_regions`; None
            = :func:`grid_regions` ("centre", "border", "corners") for maps over a patch grid, none for
            token maps. Regions need not be disjoint; an example may have an empty region (mass 0).
        top_k: k of the top-k overlap (1 <= k <= units).
        batch_size: examples per ``explain`` call.
        js_threshold: flag when the mean JS divergence exceeds it (in [0, 1]).
        shift_threshold: flag when a region's mean mass shift exceeds it in absolute value *and* its
            bootstrap CI excludes 0 (in [0, 1]).
        n_boot: bootstrap resamples of the examples (paired: the same resample for A and B and every region).
        seed: seed of the bootstrap (``numpy.random.default_rng``).
        maps_a, maps_b: precomputed maps used instead of running that model: see :func:`_given`.
        **options: the method's options, passed to ``explain`` for both models.

    Returns:
        an :class:`AuditReport`. Two identical models give identical maps: JS 0, shifts 0, not flagged.

    Raises:
        ValueError: empty inputs, maps of the two models over different grids / unit counts, regions of the
            wrong shape, thresholds outside [0, 1], top_k larger than the number of units, a target list of
            the wrong length; plus whatever ``explain`` raises for the method and options.
    """
    x = _audit_inputs(pixel_values)
    B = _batch_of(x)
    top_k, batch_size, n_boot, seed = (_checks.check_int(k, v, low=lo) for k, v, lo in (
        ("top_k", top_k, 1), ("batch_size", batch_size, 1), ("n_boot", n_boot, 1), ("seed", seed, 0)))
    js_threshold, shift_threshold = (_checks.check_real(k, v, low=0.0, high=1.0) for k, v in (
        ("js_threshold", js_threshold), ("shift_threshold", shift_threshold)))
    target, info = _checks.check_audit_target(target, B), method_info(method)
    with eval_mode(model_a, model_b):
        sa, grid_a, pred_a = _maps_of(model_a, maps_a, "maps_a", x, info, target, batch_size, options)
        sb, grid_b, pred_b = _maps_of(model_b, maps_b, "maps_b", x, info, target, batch_size, options)
    _checks.check_audit_maps(grid_a, grid_b, sa.shape[1], sb.shape[1])
    units = sa.shape[1]
    if top_k > units:
        raise ValueError(f"top_k must be at most the number of units per map ({units}), got {top_k}")
    maps_a, maps_b = _to_distribution(sa), _to_distribution(sb)
    js = js_divergence(maps_a, maps_b)
    if regions is None:
        regions = grid_regions(grid_a, B) if grid_a is not None else {}
    regions = _checks.check_audit_regions(regions, B, units)
    mass_a, mass_b, shift, shift_ci = _region_shifts(maps_a, maps_b, regions, n_boot, seed)
    reasons = _reasons(js, js_threshold, shift, shift_ci, shift_threshold)
    settings = {
        "js_threshold": js_threshold, "shift_threshold": shift_threshold, "n_boot": n_boot, "seed": seed,
        "target": "predicted" if target is None else ("callable" if callable(target) else "given"),
        "options": {k: v for k, v in options.items() if isinstance(v, (int, float, str, bool, type(None)))},
    }
    return AuditReport(
        method=info.name, grid=grid_a, k=top_k, maps_a=maps_a, maps_b=maps_b, js=js,
        spearman=spearman_rows(maps_a, maps_b), topk=_topk_overlap(maps_a, maps_b, top_k), regions=regions,
        mass_a=mass_a, mass_b=mass_b, shift=shift, shift_ci=shift_ci, flagged=bool(reasons), reasons=reasons,
        order=np.argsort(-js, kind="stable"), pred_a=pred_a, pred_b=pred_b, settings=settings,
    )


def _audit_inputs(inputs: Any) -> Any:
    """Pixel values (B, C, H, W), or a tokenizer's dict (checked as text inputs, B >= 1)."""
    if not hasattr(inputs, "keys"):
        return _checks.check_audit_inputs(inputs)
    _checks.check_text_inputs(inputs)
    if int(inputs["input_ids"].shape[0]) == 0:
        raise ValueError("inputs hold no text (B = 0): an audit needs at least one example")
    return {k: v for k, v in dict(inputs).items() if k != "special_tokens_mask"}


def _batch_of(x: Any) -> int:
    """B of pixel values (B, C, H, W) or of a tokenizer's dict."""
    return int((x["input_ids"] if isinstance(x, dict) else x).shape[0])


def _region_shifts(maps_a: np.ndarray, maps_b: np.ndarray, regions: dict, n_boot: int, seed: int) -> tuple:
    """Per region: the mass of A's and B's maps in it (B,), the mean shift B − A, its bootstrap 95% CI."""
    mass_a = {r: (maps_a * m).sum(axis=1) for r, m in regions.items()}
    mass_b = {r: (maps_b * m).sum(axis=1) for r, m in regions.items()}
    diffs = {r: mass_b[r] - mass_a[r] for r in regions}
    shift = {r: float(d.mean()) for r, d in diffs.items()}
    return mass_a, mass_b, shift, _bootstrap_ci(diffs, n_boot, seed)


def _reasons(js: np.ndarray, js_threshold: float, shift: dict, shift_ci: dict, shift_threshold: float) -> list[str]:
    """Why the audit flags a shift: the mean JS divergence over its threshold, and each region whose mean
    mass shift exceeds its threshold with a bootstrap CI excluding 0 (empty: not flagged)."""
    reasons = []
    if js.mean() > js_threshold:
        reasons.append(f"mean Jensen-Shannon divergence {js.mean():.3f} > js_threshold {js_threshold:g}")
    for r in shift:
        lo, hi = shift_ci[r]
        if abs(shift[r]) > shift_threshold and (lo > 0 or hi < 0):
            way = "toward" if shift[r] > 0 else "away from"
            reasons.append(f"mass moved {way} {r!r}: {shift[r]:+.3f} [{lo:.3f}, {hi:.3f}]")
    return reasons


def _maps_of(model: Any, given: Any, name: str, x: torch.Tensor, info: Any, target: Any, batch_size: int,
             options: dict) -> tuple[np.ndarray, tuple[int, int] | None, np.ndarray]:
    """The maps of one side: the ``given`` ones (``maps_a`` / ``maps_b``), else ``model``'s, explained here."""
    if given is not None:
        return _given(given, _batch_of(x), name)
    return _explain_all(model, x, info, target, batch_size, options)


def _given(maps: Any, B: int, name: str) -> tuple[np.ndarray, tuple[int, int] | None, np.ndarray]:
    """Scores (B, units) float64, grid and predicted classes (B,) of precomputed maps: an
    :class:`~attnroll.Explanation` of the B inputs whose target is each one's predicted class, e.g.
    ``attnroll.batch.explanations(DIR, method)[0]`` of an ``attnroll batch`` output."""
    scores = _checks.check_scores(name, maps, batch=B).numpy()
    target = getattr(maps, "target", None)
    if not (isinstance(target, list) and len(target) == B and all(isinstance(t, int) for t in target)):
        raise ValueError(f"{name} must be an Explanation of the B={B} inputs whose target is the predicted class "
                         f"of each (B ints), got target {str(target)[:60]}")
    grid = getattr(maps, "grid", None)
    return scores, None if grid is None else (int(grid[0]), int(grid[1])), np.asarray(target, dtype=np.int64)


def _explain_all(
    model: Any, x: torch.Tensor, info: Any, target: Any, batch_size: int, options: dict
) -> tuple[np.ndarray, tuple[int, int] | None, np.ndarray]:
    """Scores (B, units) float64, grid and predicted classes (B,) of one model, explained in chunks."""
    r = explain_batches(model, x, info.name, target=target, batch_size=batch_size, **options)
    if target is None and r.targets is not None:
        preds = np.asarray(r.targets, dtype=np.int64)  # the target *is* the predicted class
    elif isinstance(x, dict):
        with torch.no_grad():
            preds = torch.cat([logits_of(model(**{k: v[sl] for k, v in x.items()})).argmax(dim=1)
                               for sl in chunks(_batch_of(x), batch_size)]).numpy()
    else:
        preds = batched_logits(image_forward(model), x, batch_size).argmax(dim=1).numpy()
    return r.scores.to(torch.float64).numpy(), r.grid, preds


# ------------------------------------------------------------------------------------------- statistics
def _to_distribution(scores: np.ndarray) -> np.ndarray:
    """Each row's positive part divided by its sum; a row without positive mass becomes uniform."""
    p = np.clip(np.asarray(scores, dtype=np.float64), 0.0, None)
    s = p.sum(axis=1, keepdims=True)
    uniform = np.full_like(p, 1.0 / p.shape[1]) if p.shape[1] else p
    return np.where(s > 0, p / np.where(s > 0, s, 1.0), uniform)


def js_divergence(p: Any, q: Any) -> np.ndarray:
    """Jensen-Shannon divergence, base 2, between matching rows of two (B, units) distributions (each row
    non-negative, summing to 1): ``JS = KL(p || m) / 2 + KL(q || m) / 2`` with ``m = (p + q) / 2``; in [0, 1],
    exactly 0 for identical rows. Terms with p = 0 contribute 0."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    m = (p + q) / 2

    def kl(a: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(a > 0, a * np.log2(np.where(a > 0, a, 1.0) / np.where(m > 0, m, 1.0)), 0.0)
        return t.sum(axis=1)

    return np.clip(0.5 * kl(p) + 0.5 * kl(q), 0.0, 1.0)


def _topk_overlap(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """|top-k(a) ∩ top-k(b)| / k per row; top-k by relevance_order (ties by position)."""
    top = lambda m: relevance_order(torch.from_numpy(m))[:, :k].numpy()  # noqa: E731
    ia, ib = top(a), top(b)
    inside = np.zeros(a.shape, dtype=bool)
    np.put_along_axis(inside, ia, True, axis=1)
    return np.take_along_axis(inside, ib, axis=1).sum(axis=1) / k


def _bootstrap_ci(diffs: dict[str, np.ndarray], n_boot: int, seed: int) -> dict[str, tuple[float, float]]:
    """Paired percentile bootstrap 95% CI of each region's mean difference: every resample draws B example
    indices with replacement (the same draw for every region), in blocks so memory stays bounded."""
    if not diffs:
        return {}
    names = list(diffs)
    d = np.stack([diffs[r] for r in names])  # (R, B)
    B = d.shape[1]
    rng = np.random.default_rng(seed)
    block = max(1, min(n_boot, 2_000_000 // max(1, B * len(names))))
    means = []
    for start in range(0, n_boot, block):
        idx = rng.integers(0, B, (min(block, n_boot - start), B))
        means.append(d[:, idx].mean(axis=2))  # (R, block)
    means = np.concatenate(means, axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5], axis=1)
    return {r: (float(lo[i]), float(hi[i])) for i, r in enumerate(names)}


# ----------------------------------------------------------------------------------------------- regions
def shapes_regions(object_masks: Any, marker_masks: Any = None, *, patch_size: int = 8) -> dict[str, np.ndarray]:
    """Disjoint regions over the patch grid from pixel masks of the shapes data.

    ``object_masks`` (B, H, W) (``make_dataset``'s masks) and optionally ``marker_masks`` (B, H, W)
    (``add_marker``'s) are pooled to patches with ``patch_masks(reduce="any")``: a patch belongs to a mask
    when it holds at least one of its pixels. Rule for disjointness: **marker beats object** (a patch holding
    marker pixels is "marker" even if the object reaches into it, since the marker is painted over the
    object), "object" is every other patch touching the object, "background" the rest.

    Returns name -> (B, units) bool numpy arrays, units = (H / patch_size) * (W / patch_size) in row-major
    order: "object", "marker" (only when marker masks are given), "background".
    """
    from ..models.shapes import patch_masks

    obj = patch_masks(_checks.check_pixel_masks("object_masks", object_masks), patch_size).numpy()
    B = obj.shape[0]
    obj = obj.reshape(B, -1)
    out: dict[str, np.ndarray] = {}
    if marker_masks is not None:
        mk = _checks.check_pixel_masks("marker_masks", marker_masks)
        if tuple(mk.shape) != tuple(object_masks.shape):
            raise ValueError(
                f"marker_masks must have the shape of object_masks {tuple(object_masks.shape)}, got {tuple(mk.shape)}"
            )
        marker = patch_masks(mk, patch_size).numpy().reshape(B, -1)
        obj = obj & ~marker
        out["object"], out["marker"] = obj, marker
        out["background"] = ~(obj | marker)
    else:
        out["object"], out["background"] = obj, ~obj
    return out


def grid_regions(grid: Any, batch: int) -> dict[str, np.ndarray]:
    """Default regions of any image model: "centre", "border", "corners", disjoint and covering the grid.

    The outer ring of the (h, w) patch grid, ``r = max(1, min(h, w) // 8)`` patches wide, is split into its
    four r x r corner blocks ("corners") and the rest of the ring ("border"); "centre" is everything inside
    the ring (empty for grids narrower than 2r + 1). For the shapes ViT's 8x8 grid: 4 corner patches, 24
    border patches, 36 centre patches. Returns name -> (batch, h*w) bool numpy arrays (the same mask in every
    row).
    """
    if not isinstance(grid, (tuple, list)) or len(grid) != 2:
        raise TypeError(f"grid must be a pair (h, w) of patch rows and columns, got {_checks.describe(grid)}")
    h, w = (_checks.check_int("grid", g, low=1) for g in grid)
    batch = _checks.check_int("batch", batch, low=0)
    r = max(1, min(h, w) // 8)
    i, j = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    ring = (i < r) | (i >= h - r) | (j < r) | (j >= w - r)
    corners = ((i < r) | (i >= h - r)) & ((j < r) | (j >= w - r))
    masks = {"centre": ~ring, "border": ring & ~corners, "corners": corners}
    return {k: np.tile(v.reshape(1, -1), (batch, 1)) for k, v in masks.items()}


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
