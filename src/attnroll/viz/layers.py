"""The per-layer rollout trajectory: the explained row after each layer of the product."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _checks
from . import deps
from ._explanation import image_index
from .overlay import overlay


def _check_layers(expl: Any) -> torch.Tensor:
    if getattr(expl, "layers", None) is None:
        raise ValueError(
            f"this explanation (method {getattr(expl, 'method', '?')!r}) has no layers; ask for them with "
            "explain(..., return_layers=True) (methods rollout, per_head_rollout, grad_rollout, gae, raw)"
        )
    return expl.layers


def plot_layers(
    expl: Any,
    image: Any = None,
    index: int | None = None,
    *,
    cmap: str = "inferno",
    alpha: float = 0.6,
    cell: int = 120,
    max_cols: int = 6,
    dpi: int = 100,
) -> Any:
    """How the explained row builds up over the layers.

    ``expl.layers`` (L, B, n) holds the row after layers 1..k of the product (``explain(...,
    return_layers=True)``). Image models: one patch map per layer (each scaled to [0, 1] on its own), over
    ``image`` when given (then ``index=`` names the example it shows, needed when there are several), in
    rows of ``max_cols``; text: an (L, tokens) heatmap with the tokens on the x axis. Without an image,
    ``index`` defaults to example 0.

    Returns:
        a PIL RGB image (image models: about ``cell`` pixels per map).
    """
    _checks.check_figure(cell=cell, dpi=dpi, max_cols=max_cols, alpha=alpha)
    plt = deps.pyplot("attnroll.viz.plot_layers")
    layers = _check_layers(expl)
    index = image_index(index, layers.shape[1], "plot_layers") if image is not None else (index or 0)
    L = layers[:, index].to(torch.float64)  # (L, n)
    p = expl.prefix
    start = int((expl.options or {}).get("start_layer") or 0)
    labels = [f"layers {start + 1}–{start + k + 1}" if k else f"layer {start + 1}" for k in range(L.shape[0])]
    if expl.grid is not None:
        h, w = expl.grid
        maps = L[:, p:].reshape(L.shape[0], h, w)
        cols = min(max_cols, L.shape[0])
        nrows = -(-L.shape[0] // cols)
        inch = cell / dpi
        fig, axes = plt.subplots(nrows, cols, figsize=(cols * inch, nrows * (inch + 0.25)), dpi=dpi, squeeze=False)
        for k in range(nrows * cols):
            ax = axes[k // cols][k % cols]
            ax.axis("off")
            if k >= L.shape[0]:
                continue
            if image is not None:
                ax.imshow(np.asarray(overlay(maps[k], image, cmap=cmap, alpha=alpha, size=cell)))
            else:
                ax.imshow(maps[k].numpy(), cmap=cmap, interpolation="nearest")
            ax.set_title(labels[k], fontsize=8)
        fig.suptitle(f"{expl.method}: row after each layer", fontsize=9)
        fig.tight_layout()
        return deps.figure_to_image(fig)
    toks = _token_labels(expl, index)
    vals = L[:, p:p + len(toks)].numpy()
    d = np.abs(vals).max(axis=1, keepdims=True)
    vals = np.where(d > 0, vals / np.where(d > 0, d, 1), 0)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(toks) + 1.5), 0.3 * len(labels) + 1.6), dpi=dpi)
    ax.imshow(vals, cmap=cmap, aspect="auto", vmin=0, vmax=1)
    ax.set_xticks(range(len(toks)), toks, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(f"{expl.method}: row after each layer (each row scaled to its max)", fontsize=9)
    fig.tight_layout()
    return deps.figure_to_image(fig)


def _token_labels(expl: Any, index: int) -> list[str]:
    n = expl.scores.shape[-1]
    toks = expl.tokens[index][expl.prefix:] if expl.tokens else [f"#{j}" for j in range(n)]
    if expl.attention_mask is not None:
        real = int(expl.attention_mask[index, expl.prefix:].sum())
        toks = toks[:real]
    return list(toks)
