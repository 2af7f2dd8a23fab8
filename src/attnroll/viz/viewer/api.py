"""``view``: explanations -> one interactive, self-contained HTML page (the public entry of the viewer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .build import audit_payload, explanations_payload, sections_payload
from .page import ViewerPage, render
from .payload import is_audit_report


def view(
    explanations: Any,
    images: Any = None,
    *,
    masks: Any = None,
    segments: Any = None,
    skip: Any = None,
    labels: Any = None,
    index: Any = None,
    names: tuple[str, str] = ("model A", "model B"),
    title: str = "attnroll viewer",
    notes: str | None = None,
    precision: str = "uint16",
    path: Any = None,
    height: int = 720,
) -> ViewerPage:
    """An interactive viewer of explanations in one HTML file: no network, no external file, works from
    ``file://``, offline and in a notebook cell (the returned page displays itself).

    Args:
        explanations: an Explanation; a list of them or ``{name: Explanation}`` (several methods on the same
            inputs: the page gets a method switcher); for an encoder-decoder, ``{name: [Explanation, ...]}``
            with one Explanation per explained target position (see :func:`attnroll.methods.explain_targets`): the page
            shows
            the source × target matrix; ``{section: {name: Explanation}}`` for groups over different inputs
            (e.g. both sentences of a pair, each explained for its similarity to the other); or an
            :class:`~attnroll.evaluate.audit.AuditReport`: two models side by side with their difference.
        images: the pictures of image explanations, one per example ((B, 3, H, W) / (B, H, W, 3) tensor or
            array in [0, 1] or uint8, or a list of PIL images), drawn under the map; optional.
        masks: ground-truth masks (B, H, W) bool, drawn as an outline (e.g. ``shapes.make_dataset``'s).
        segments: for a long token sequence, ``[(label, start, end), ...]`` token ranges (end exclusive;
            indices into ``scores``), or one such list per example: the page ranks them by relevance and
            shows each collapsed until opened.
        skip: token strings (e.g. ``tokenizer.all_special_tokens``) shown uncoloured and left out of the
            colour scale and the segment ranking.
        labels: one heading per example; ``index``: an example index or list of them (default all);
            ``names``: the two models of an AuditReport.
        precision: "uint16" (default: square-root companded, so a value v of a row whose largest |value| is
            a is off by at most sqrt(a·|v|)/65535, about 1/65535 of a at the top and 0.15% of v at v = a/10⁴;
            see :mod:`attnroll.viz.viewer.quant`), "uint8" (half the size, 256 codes) or "float32" (exact, twice
            the size).
        path: also write the page there (atomically).
        height: the notebook frame's height in pixels.

    What is carried: per example and map only the final row, the row after each layer (``layers``, from
    ``explain(..., return_layers=True)``) and the per-head rows (``extra["heads"]``, per_head_rollout), over
    the real units, quantised; never a full attention tensor.

    Returns:
        a :class:`ViewerPage` (``.html``, ``.save(path)``, ``.nbytes``).
    """
    if is_audit_report(explanations):
        if segments is not None or skip is not None or labels is not None:
            raise ValueError("segments=, skip= and labels= are for Explanations, not for an AuditReport")
        payload = audit_payload(explanations, images=images, masks=masks, names=names, index=index,
                                precision=precision)
    elif (
        isinstance(explanations, Mapping)
        and explanations
        and all(isinstance(v, Mapping) for v in explanations.values())
    ):
        if any(x is not None for x in (images, masks, segments, labels, index)):
            raise ValueError("sections ({section: {name: Explanation}}) take only skip= and precision=; "
                             "give images, masks, segments, labels or index to one group at a time")
        payload = sections_payload(explanations, skip=skip, precision=precision)
    else:
        payload = explanations_payload(explanations, images=images, masks=masks, segments=segments, skip=skip,
                                       labels=labels, index=index, precision=precision)
    payload["title"] = str(title)
    payload["notes"] = None if notes is None else str(notes)
    payload["layers"] = max((_layer_count(m) for ex in payload["examples"] for m in ex["maps"].values()), default=0)
    page = ViewerPage(render(payload), height=height)
    if path is not None:
        page.save(path)
    return page


def _layer_count(entry: dict) -> int:
    lay = entry.get("layers")
    return len(lay["a"]) if lay else 0
