"""Side by side: several methods' maps over the same images (one row per image, one column per method)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .. import _checks
from .._callable import make_callable as _make_callable
from . import deps
from ._explanation import is_explanation
from .overlay import overlay, to_rgb_array


def _named(explanations: Any) -> list[tuple[str, Any]]:
    if isinstance(explanations, Mapping):
        return [(str(k), v) for k, v in explanations.items()]
    if is_explanation(explanations):
        explanations = [explanations]
    return [(e.method or f"map {i}", e) for i, e in enumerate(explanations)]


def panel(
    explanations: Any,
    images: Any,
    *,
    indices: Sequence[int] | None = None,
    outlines: Any = None,
    row_labels: Sequence[str] | None = None,
    cmap: str = "jet",
    alpha: float = 0.5,
    kind: str = "minmax",
    cell: int = 160,
    dpi: int = 100,
    show_input: bool = True,
) -> Any:
    """A grid of overlays: rows = images, columns = the input (optional) then each method.

    Args:
        explanations: ``{title: Explanation}`` or a list of Explanations (titled by their method), each over
            the same batch of images (B examples, a patch grid).
        images: the B input images, image b the picture of example b: a sequence of images (PIL /
            (H, W, 3) / (3, H, W)) or a (B, 3, H, W)
            tensor / array (float in [0, 1] or uint8).
        indices: which examples to show (default all).
        outlines: optional masks (B, H, W) at image resolution (e.g. ground-truth objects), drawn as contours
            on every cell.
        row_labels: a label per shown example (left of each row).
        cmap, alpha, kind: as :func:`~attnroll.viz.overlay`. cell: side of each cell in pixels; dpi: of the
            figure (the text scales with it).

    Returns:
        a PIL RGB image, about ``cell`` pixels per cell plus room for titles.
    """
    _checks.check_figure(cell=cell, dpi=dpi, alpha=alpha)
    show_input = _checks.check_bool("show_input", show_input)
    plt = deps.pyplot("attnroll.viz.panel")
    named = _named(explanations)
    if not named:
        raise ValueError("panel needs at least one explanation")
    n_img = len(images)
    rows = list(range(n_img)) if indices is None else _checks.check_indices("indices", indices, n_img, "images")
    for name, e in named:  # image b shows example b: counts that differ pair maps with other pictures
        if e.batch_size != n_img:
            raise ValueError(f"explanation {name!r} has {e.batch_size} examples, images has {n_img}: give the "
                             "images the explanation was computed on, one per example, in order (pick rows "
                             "with indices=)")
    cols = len(named) + int(show_input)
    inch = cell / dpi
    top = 0.32  # inches for the column titles
    left = 0.3 if row_labels else 0.05
    fig = plt.figure(figsize=(cols * inch + left + 0.05, len(rows) * inch + top + 0.05), dpi=dpi)
    W, H = fig.get_size_inches()
    for r, b in enumerate(rows):
        img = to_rgb_array(images[b])
        out = None if outlines is None else outlines[b]
        cells = []
        if show_input:
            cells.append(("input", overlay(np.zeros((1, 1)), img, alpha=0.0, size=cell, outline=out)))
        for name, e in named:
            cells.append((name, overlay(e, img, b, cmap=cmap, alpha=alpha, kind=kind, size=cell, outline=out)))
        for c, (name, im) in enumerate(cells):
            ax = fig.add_axes([(left + c * inch) / W, 1 - (top + (r + 1) * inch) / H, inch / W * 0.97, inch / H * 0.97])
            ax.imshow(np.asarray(im), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            for s in ax.spines.values():
                s.set_visible(False)
            if r == 0:
                ax.set_title(name, fontsize=max(7, cell // 16), pad=3)
            if c == 0 and row_labels:
                ax.set_ylabel(str(row_labels[r]), fontsize=max(6, cell // 18))
    return deps.figure_to_image(fig)


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
