"""Explanations (or an audit report) -> the viewer's payload (see :mod:`.payload` for its shape)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import media
from .payload import _first, check_same_inputs, map_entry, matrix_entry, named_explanations, pick, real_units
from .quant import encode_rows


def _indices(index: Any, batch: int) -> list[int]:
    if index is None:
        return list(range(batch))
    idx = [index] if isinstance(index, (int, np.integer)) else list(index)
    bad = [i for i in idx if not isinstance(i, (int, np.integer)) or not 0 <= int(i) < batch]
    if bad:
        raise ValueError(f"index must be example indices in [0, {batch}), got {index!r}")
    return [int(i) for i in idx]


def _segments(segments: Any, b: int, batch: int, keep: np.ndarray, units: int) -> list | None:
    """Caller segments (label, start, end) over unit indices [start, end) -> the same over the shown units."""
    if segments is None:
        return None
    segs = list(segments)
    if segs and isinstance(segs[0], (list, tuple)) and segs[0] and isinstance(segs[0][0], (list, tuple)):
        segs = pick(segs, b, batch, "segments (one list per example)")
    out = []
    for s in segs:
        if not (isinstance(s, (list, tuple)) and len(s) == 3):
            raise ValueError(f"segments must be (label, start, end) triples, got {s!r}")
        label, start, end = s
        if not (
            isinstance(start, (int, np.integer)) and isinstance(end, (int, np.integer)) and 0 <= start < end <= units
        ):
            raise ValueError(f"segment {label!r}: start and end must be ints with 0 <= start < end <= {units} "
                             f"(token indices, end exclusive), got {start!r}, {end!r}")
        a, z = (int(np.searchsorted(keep, v)) for v in (start, end))
        out.append([str(label), a, z])
    return out


def _label(labels: Any, b: int, batch: int, expl: Any) -> str:
    given = pick(labels, b, batch, "labels")
    if given is not None:
        return str(given)
    tgt = expl.target[b] if isinstance(expl.target, list) and len(expl.target) == batch else expl.target
    return f"example {b}" + (f" · target {tgt}" if tgt is not None else "")


def _image_fields(images: list | None, masks: list | None, b: int, batch: int) -> dict[str, Any]:
    img, msk = pick(images, b, batch, "images"), pick(masks, b, batch, "masks")
    out: dict[str, Any] = {"image": None, "size": None, "outline": None}
    if img is not None:
        out["image"], w, h = media.image_uri(img)
        out["size"] = [w, h]
    if msk is not None:
        out["outline"] = media.mask_bits(msk)
    return out


def _tokens_fields(first: Any, b: int, keep: np.ndarray, skip: Any) -> dict[str, Any]:
    n = first.scores.shape[-1]
    toks = list(first.tokens[b][first.prefix:]) if first.tokens else [f"#{j}" for j in range(n)]
    shown = [toks[j] if j < len(toks) else f"#{j}" for j in keep]
    skip = set(skip or ())
    return {"tokens": shown, "skip": [i for i, t in enumerate(shown) if t in skip]}


def _matrix_example(named: dict, b: int, precision: str, skip: Any, label: str) -> dict[str, Any]:
    first = _first(next(iter(named.values())))
    keep = real_units(first, b)
    ex = {"label": label, "kind": "matrix", "maps": {}, **_tokens_fields(first, b, keep, skip)}
    positions = None
    for name, expls in named.items():
        ex["maps"][name], positions = matrix_entry(expls, b, precision)
    dec = first.extra.get("decoder_tokens")
    dec_toks = list(dec[b]) if dec is not None else None
    width = len(first.extra["target_scores"][b]) if first.extra.get("target_scores") is not None else max(positions) + 1
    ex["target_tokens"] = [dec_toks[j] if dec_toks and j < len(dec_toks) else f"#{j}" for j in range(width)]
    ex["positions"] = positions
    return ex


def explanations_payload(explanations: Any, *, images: Any = None, masks: Any = None, segments: Any = None,
                         skip: Any = None, labels: Any = None, index: Any = None, precision: str = "uint16") -> dict:
    """The payload's "methods" and "examples" for Explanations (see :func:`attnroll.viz.view`)."""
    named = named_explanations(explanations)
    kind, batch = check_same_inputs(named)
    images, masks = media.as_list(images, 3), media.as_list(masks, 2)
    if kind != "image" and (images is not None or masks is not None):
        raise ValueError(f"images= and masks= are for image models; these explanations are over {kind}")
    if kind != "tokens" and segments is not None:
        raise ValueError("segments= are for token explanations (a long prompt); these are over " + kind)
    examples = []
    for b in _indices(index, batch):
        first = _first(next(iter(named.values())))
        label = _label(labels, b, batch, first)
        if kind == "matrix":
            examples.append(_matrix_example(named, b, precision, skip, label))
            continue
        keep = real_units(first, b)
        ex = {"label": label, "kind": kind, "panels": [[None, None, None]],
              "maps": {name: map_entry(e, b, keep, precision) for name, e in named.items()}}
        if kind == "image":
            ex.update(grid=list(first.grid), **_image_fields(images, masks, b, batch))
        else:
            ex.update(_tokens_fields(first, b, keep, skip))
            ex["segments"] = _segments(segments, b, batch, keep, first.scores.shape[-1])
        examples.append(ex)
    return {"methods": list(named), "examples": examples}


def sections_payload(sections: Any, *, skip: Any = None, precision: str = "uint16") -> dict:
    """``{section: {name: Explanation}}``: several groups of explanations over different inputs (e.g. each
    sentence of a pair explained for its similarity to the other) on one page, one method switcher; each
    example's heading starts with its section."""
    methods: list[str] = []
    examples: list[dict] = []
    for title, group in sections.items():
        part = explanations_payload(group, skip=skip, precision=precision)
        methods += [m for m in part["methods"] if m not in methods]
        for ex in part["examples"]:
            own = ex["label"].split(" · ", 1)[1] if len(part["examples"]) == 1 and " · " in ex["label"] else ex["label"]
            ex["label"] = f"{title} · {own}"
        examples += part["examples"]
    if not examples:
        raise ValueError("explanations is empty: give at least one section with an Explanation")
    return {"methods": methods, "examples": examples}


def audit_payload(
    report: Any,
    *,
    images: Any = None,
    masks: Any = None,
    names: tuple[str, str] = ("model A", "model B"),
    index: Any = None,
    precision: str = "uint16",
) -> dict:
    """Two models side by side from an :class:`~attnroll.evaluate.audit.AuditReport`: per example the map of
    each model and their difference (B − A), examples in the report's order (largest divergence first)."""
    a_name, b_name = (str(n) for n in names)
    diff = f"{b_name} − {a_name}"
    batch = int(report.maps_a.shape[0])
    images, masks = media.as_list(images, 3), media.as_list(masks, 2)
    order = [int(i) for i in report.order] if index is None else _indices(index, batch)
    examples = []
    for b in order:
        pa, pb = np.asarray(report.maps_a[b], np.float64), np.asarray(report.maps_b[b], np.float64)
        maps = {a_name: pa, b_name: pb, diff: pb - pa}
        ex = {
            "label": f"example {b} · JS {float(report.js[b]):.3f} · Spearman {float(report.spearman[b]):.2f} · "
                     f"predicted {int(report.pred_a[b])} / {int(report.pred_b[b])}",
            "kind": "image" if report.grid is not None else "tokens",
            "panels": [[a_name, a_name, False], [b_name, b_name, False], [diff, diff, True]],
            "maps": {k: {"final": encode_rows(v, precision), "layers": None, "heads": None, "signed": k == diff}
                     for k, v in maps.items()},
        }
        if report.grid is not None:
            ex.update(grid=list(report.grid), **_image_fields(images, masks, b, batch))
        else:
            ex.update(tokens=[f"#{j}" for j in range(pa.shape[0])], skip=[], segments=None)
        examples.append(ex)
    return {"methods": [report.method], "examples": examples, "fixed": True}
