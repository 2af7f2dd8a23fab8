"""A patch-grid map upsampled over its image, coloured with a colormap and blended with an alpha."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _checks
from .._callable import make_callable as _make_callable
from . import deps
from ._explanation import image_index, is_explanation
from .pixels import to_rgb_array  # noqa: F401 - its old home; overlays use it

_RESAMPLE = ("nearest", "bilinear", "bicubic")


def grid_map(source: Any, index: int = 0, kind: str = "minmax") -> np.ndarray:
    """The (h, w) map of example ``index`` scaled to [0, 1].

    ``source``: an :class:`~attnroll.Explanation` of an image model (its ``as_grid()``, rescaled with
    ``normalized(kind)``), or a 2-D array / tensor (h, w) rescaled the same way ("minmax": min to 0 and max
    to 1; "max": divided by the largest absolute value, negatives clipped to 0; "none": taken as already on
    a [0, 1] scale, only clipped, so that several maps can share one scale).
    """
    if is_explanation(source):
        index = _checks.check_index("index", index, source.batch_size, "examples")
        g = source.normalized(kind).as_grid()[index].to(torch.float64).numpy()
    else:
        g = source.detach().cpu().numpy() if isinstance(source, torch.Tensor) else np.asarray(source)
        g = np.asarray(g, dtype=np.float64)
        if g.ndim != 2:
            raise ValueError(f"a map must be 2-D (h, w), got shape {g.shape}")
        if kind == "minmax":
            g = g - g.min()
            d = g.max()
        elif kind == "max":
            d = np.abs(g).max()
        elif kind == "none":
            d = 1.0
        else:
            raise ValueError(f"kind must be 'minmax', 'max' or 'none' for a raw map, got {kind!r}")
        g = g / d if d > 0 else np.zeros_like(g)
    return np.clip(np.nan_to_num(g), 0.0, 1.0)


def colorize(grid: np.ndarray, size: tuple[int, int], cmap: str = "jet", resample: str = "bilinear") -> np.ndarray:
    """A [0, 1] map (h, w) upsampled to ``size`` = (W, H) pixels and coloured: (H, W, 3) float in [0, 1]."""
    Image = deps.pil()
    if resample not in _RESAMPLE:
        raise ValueError(f"resample must be one of {_RESAMPLE}, got {resample!r}")
    mode = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}[resample]
    up = Image.fromarray(np.asarray(grid, dtype=np.float32), mode="F").resize(size, mode)
    h = np.clip(np.asarray(up, dtype=np.float64), 0.0, 1.0)
    return deps.colormap(cmap)(h)[..., :3]


def outline_pixels(mask: Any, size: tuple[int, int], thickness: int | None = None) -> np.ndarray:
    """The boundary of a binary mask (H, W) resized (nearest) to ``size`` = (W, H): (H, W) bool, True on
    the mask's pixels that touch a pixel outside it (``thickness`` pixels wide; default ~1/128 of the side)."""
    Image = deps.pil()
    m = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if m.ndim != 2:
        raise ValueError(f"outline mask must be 2-D (H, W), got shape {m.shape}")
    m = np.asarray(Image.fromarray((m > 0).astype(np.uint8) * 255).resize(size, Image.NEAREST)) > 0
    t = thickness if thickness is not None else max(1, max(size) // 128)
    inner = m.copy()
    for _ in range(t):
        p = np.pad(inner, 1, constant_values=False)
        inner = inner & p[:-2, 1:-1] & p[2:, 1:-1] & p[1:-1, :-2] & p[1:-1, 2:]
    return m & ~inner


def overlay(
    source: Any,
    image: Any,
    index: int | None = None,
    *,
    cmap: str = "jet",
    alpha: float = 0.5,
    kind: str = "minmax",
    size: int | tuple[int, int] | None = None,
    resample: str = "bilinear",
    outline: Any = None,
    outline_color: tuple[int, int, int] = (255, 255, 255),
) -> Any:
    """Colour the patch map of example ``index`` and blend it over its image.

    Args:
        source: an :class:`~attnroll.Explanation` of an image model (grid (h, w)) or a 2-D map (h, w).
        image: the input image: PIL, or an array / tensor (H, W, 3) or (3, H, W), uint8 or float in [0, 1].
        index: the example of the Explanation that ``image`` shows; may be left out when it holds one example
            (with several, leaving it out is a ValueError: one image cannot say which map is its own).
        cmap: a matplotlib colormap name; alpha: weight of the map in [0, 1] (0 = the image alone).
        kind: how the map is scaled to [0, 1] before colouring (see :func:`grid_map`).
        size: output size in pixels, an int (square) or (W, H); default the image's size. The image is
            resized bicubically, the map with ``resample`` ("bilinear" smooth, "nearest" shows the patches).
        outline: an optional binary mask (H, W) at the image's resolution (e.g. a ground-truth object mask)
            drawn as a contour in ``outline_color``.

    Returns:
        a PIL RGB image of ``size`` (W, H) pixels.
    """
    Image = deps.pil()
    alpha = _checks.check_real("alpha", alpha, low=0.0, high=1.0)
    base = Image.fromarray(to_rgb_array(image))
    if size is None:
        out_size = base.size
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        out_size = (_checks.check_int("size[0]", size[0], low=1), _checks.check_int("size[1]", size[1], low=1))
    else:
        side = _checks.check_int("size", size, low=1)
        out_size = (side, side)
    if is_explanation(source):
        index = image_index(index, source.batch_size, "overlay")
    if base.size != out_size:
        base = base.resize(out_size, Image.BICUBIC)
    heat = colorize(grid_map(source, index or 0, kind), out_size, cmap, resample)
    out = (1.0 - alpha) * (np.asarray(base, dtype=np.float64) / 255.0) + alpha * heat
    out = (np.clip(out, 0, 1) * 255).round().astype(np.uint8)
    if outline is not None:
        out[outline_pixels(outline, out_size)] = np.asarray(outline_color, dtype=np.uint8)
    return Image.fromarray(out, mode="RGB")


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
