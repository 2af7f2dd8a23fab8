"""Per-head maps: one picture per attention head (per-head rollout, or one layer's raw attention)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _checks
from . import deps
from ._explanation import image_index, is_explanation
from .layers import _token_labels
from .overlay import overlay


def head_rows(source: Any, index: int = 0, *, row: int = 0) -> torch.Tensor:
    """The per-head rows (H, n) of example ``index``.

    ``source``: an Explanation of ``per_head_rollout`` (its ``extra["heads"]`` (B, H, n)); or a tensor / array
    (H, n), (B, H, n), or attention (B, H, n, n) / (H, n, n) of which row ``row`` is taken (e.g. one layer of
    ``attnroll.capture(...).attentions``).
    """
    if is_explanation(source):
        heads = source.extra.get("heads")
        if heads is None:
            raise ValueError(
                f"this explanation (method {source.method!r}) has no per-head rows; use "
                "explain(..., method='per_head_rollout'), or pass one layer's attention (B, H, n, n)"
            )
        return torch.as_tensor(heads)[index].to(torch.float64)
    t = torch.as_tensor(np.asarray(source) if not isinstance(source, torch.Tensor) else source).detach().cpu()
    t = t.to(torch.float64)
    if t.ndim == 4:
        return t[index, :, row]
    if t.ndim == 3 and t.shape[-1] == t.shape[-2]:
        return t[:, row]
    if t.ndim == 3:
        return t[index]
    if t.ndim == 2:
        return t
    raise ValueError(f"per-head input must be (H, n), (B, H, n) or attention (B, H, n, n), got shape {tuple(t.shape)}")


def _batch_of(source: Any) -> int:
    """How many examples a per-head source holds (1 for one example's (H, n) / (H, n, n))."""
    if is_explanation(source):
        return source.batch_size
    shape = tuple(getattr(source, "shape", None) or np.shape(source))
    if len(shape) == 4 or (len(shape) == 3 and shape[-1] != shape[-2]):
        return shape[0]
    return 1


def plot_heads(
    source: Any,
    image: Any = None,
    index: int | None = None,
    *,
    grid: tuple[int, int] | None = None,
    prefix: int | None = None,
    tokens: list[str] | None = None,
    row: int = 0,
    cmap: str = "inferno",
    alpha: float = 0.6,
    cell: int = 110,
    max_cols: int = 6,
    dpi: int = 100,
) -> Any:
    """One map per head.

    Image models (a patch grid, from the Explanation or ``grid=(h, w)``): a grid of H patch maps, each scaled
    to [0, 1] on its own, over ``image`` when given (then ``index=`` names the example it shows, needed when
    there are several; without an image it defaults to example 0). Text: an (H, tokens) heatmap. ``prefix``
    (number of leading prefix tokens dropped, default the Explanation's or 1 with a grid, else 0) and ``tokens`` label
    raw arrays.

    Returns:
        a PIL RGB image.
    """
    _checks.check_figure(cell=cell, dpi=dpi, max_cols=max_cols, alpha=alpha)
    _checks.check_int("row", row)
    plt = deps.pyplot("attnroll.viz.plot_heads")
    index = image_index(index, _batch_of(source), "plot_heads") if image is not None else (index or 0)
    rows = head_rows(source, index, row=row)  # (H, n)
    is_expl = is_explanation(source)
    if is_expl:
        grid = source.grid if grid is None else grid
        prefix = source.prefix if prefix is None else prefix
    if prefix is None:
        prefix = 1 if grid is not None else 0
    H = rows.shape[0]
    title = f"{source.method}: per head" if is_expl else "per head"
    if grid is not None:
        h, w = grid
        maps = rows[:, prefix:].reshape(H, h, w)
        cols = min(max_cols, H)
        nrows = -(-H // cols)
        inch = cell / dpi
        fig, axes = plt.subplots(nrows, cols, figsize=(cols * inch, nrows * (inch + 0.25)), dpi=dpi, squeeze=False)
        for k in range(nrows * cols):
            ax = axes[k // cols][k % cols]
            ax.axis("off")
            if k >= H:
                continue
            if image is not None:
                ax.imshow(np.asarray(overlay(maps[k], image, cmap=cmap, alpha=alpha, size=cell)))
            else:
                ax.imshow(maps[k].numpy(), cmap=cmap, interpolation="nearest")
            ax.set_title(f"head {k}", fontsize=8)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        return deps.figure_to_image(fig)
    if is_expl and tokens is None:
        tokens = _token_labels(source, index)
    vals = rows[:, prefix:].numpy()
    if tokens is None:
        tokens = [f"#{j}" for j in range(vals.shape[1])]
    vals = vals[:, : len(tokens)]
    d = np.abs(vals).max(axis=1, keepdims=True)
    vals = np.where(d > 0, vals / np.where(d > 0, d, 1), 0)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(tokens) + 1.5), 0.3 * H + 1.6), dpi=dpi)
    ax.imshow(vals, cmap=cmap, aspect="auto", vmin=0, vmax=1)
    ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(H), [f"head {k}" for k in range(H)], fontsize=8)
    ax.set_title(title + " (each row scaled to its max)", fontsize=9)
    fig.tight_layout()
    return deps.figure_to_image(fig)
