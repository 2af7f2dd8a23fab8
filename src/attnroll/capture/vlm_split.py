"""Image splitting put back on the user's image: Idefics3 / SmolVLM (``do_image_splitting``), InternVL and Aya
Vision (``crop_to_patches``).

With splitting on, each image becomes ``rows × cols`` tiles of one resized copy of it, in raster order, and then
one global view (the whole image squashed to the tower's square input; Idefics3 / SmolVLM call it the global
image, InternVL / Aya Vision the thumbnail). The tiles cover the resized image exactly, and the resized image is
the user's image (stretched by at most the rounding to whole tiles), so the canvas is the tiles' patch grids put
side by side: ``(rows · g, cols · g)`` cells for a g × g patch grid per view.

What the model receives does not say how the tiles lie (only how many views there are), so the caller passes it:

- ``rows`` and ``cols``: tiles per column and per row of each image (what the Idefics3 / SmolVLM image processor
  returns with ``return_row_col_info=True``; an int, a list per image, or the processor's list per prompt of
  lists per image). The models ignore these keys.
- InternVL / Aya Vision: or ``image_sizes`` ((height, width) of each image the user gave): the grid is the one
  the processor's own ``get_optimal_tiled_canvas`` picks for that size among the grids of the tile count the
  prompt holds (its image tokens / tokens per view − the thumbnail).

Placement on the canvas: tile (r, c)'s patch (i, j) covers cell (r·g + i, c·g + j) alone; a global-view patch
(i, j) covers the cells its square spans, by area; a CLS token (InternVL) goes to prefix slot 0.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .record import Placement
from .vlm_tiles import area_overlap

__all__ = ["SPLITTING", "layout_given", "split_placement", "flat_ints"]

#: The families whose processors split an image into tiles plus a global view.
SPLITTING = ("idefics3", "smolvlm", "internvl", "aya_vision")


def layout_given(inputs: dict[str, Any], model_type: str) -> bool:
    """Whether the inputs say how each image's tiles lie (``rows`` / ``cols``, or InternVL / Aya Vision's
    ``image_sizes``)."""
    if model_type not in SPLITTING:
        return False
    if inputs.get("rows") is not None or inputs.get("cols") is not None:
        return True
    return model_type in ("internvl", "aya_vision") and inputs.get("image_sizes") is not None


def flat_ints(value: Any, name: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    out: list[int] = []
    if isinstance(value, (list, tuple)):
        for v in value:
            out.extend(flat_ints(v, name))
        return out
    raise ValueError(f"{name} must be an int, a list of ints per image or the image processor's list per prompt of "
                     f"lists per image, got {type(value).__name__}")


def _grid_from_size(size: Any, tiles: int, side: int) -> tuple[int, int] | str:
    """(rows, cols) the GOT-OCR2 image processor (InternVL, Aya Vision) picks for an image of ``size`` among the
    grids of ``tiles`` tiles."""
    try:
        got_ocr2 = importlib.import_module("transformers.models.got_ocr2.image_processing_got_ocr2")
        canvas = got_ocr2.get_optimal_tiled_canvas
    except (ImportError, AttributeError) as e:
        return f"transformers' get_optimal_tiled_canvas (got_ocr2) is not importable ({e}): pass rows= and cols="
    h, w = (int(v) for v in size)
    cols, rows = canvas((h, w), (side, side), tiles, tiles)
    return rows, cols


def grids(model_type: str, inputs: dict[str, Any], views: list[int], side: int) -> list[tuple[int, int]] | str:
    """(rows, cols) per image ((0, 0): one view, no tiles), checked against the views each image has."""
    if inputs.get("rows") is not None or inputs.get("cols") is not None:
        if inputs.get("rows") is None or inputs.get("cols") is None:
            return "rows= and cols= go together: tiles per column and per row of each image"
        rows, cols = flat_ints(inputs["rows"], "rows"), flat_ints(inputs["cols"], "cols")
        if len(rows) != len(views) or len(cols) != len(views):
            return (f"rows= / cols= give {len(rows)} / {len(cols)} value(s), but the prompts hold {len(views)} "
                    "image(s): one (rows, cols) per image")
        out = list(zip(rows, cols))
    else:
        sizes = inputs["image_sizes"]
        sizes = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
        if len(sizes) != len(views):
            return f"image_sizes= gives {len(sizes)} size(s) for {len(views)} image(s): one (height, width) per image"
        out = []
        for s, k in zip(sizes, views):
            g = _grid_from_size(s, k - 1, side) if k > 1 else (0, 0)
            if isinstance(g, str):
                return g
            out.append(g)
    for g, ((r, c), k) in enumerate(zip(out, views)):
        want = 1 if r * c <= 1 else r * c + 1
        if want != k:
            return (f"image {g} has {k} view(s) in the prompt, but rows={r}, cols={c} means {want} (rows × cols tiles "
                    "and a global view, or one view without tiles)")
    return out


def split_placement(model_type: str, inputs: dict[str, Any], views: list[int], n_v: int,
                    first: int) -> Placement | str:
    """The placement of every view's tokens (``views``: the vision items of each image, in order) on its image's
    canvas, or the reason there is none."""
    g = int(round((n_v - first) ** 0.5))
    if g * g != n_v - first:
        return f"a view has {n_v - first} patch tokens, not a square grid: its tiles cannot be put side by side"
    layout = grids(model_type, inputs, views, g)
    if isinstance(layout, str):
        return layout
    shapes = {(max(r, 1) * g, max(c, 1) * g) for r, c in layout}
    if len(shapes) != 1:
        return (f"the images' canvases differ ({sorted(shapes)}): one map per call is drawn on one grid; explain one "
                "image at a time")
    (H, W), = shapes
    parts = []
    offset = 0
    for image, ((r, c), k) in enumerate(zip(layout, views)):
        parts.append(_image_places(r, c, k, g, H, W, first, offset, image))
        offset += k
    cat = lambda i: torch.cat([p[i] for p in parts])  # noqa: E731
    return Placement(image=torch.tensor([i for i, k in enumerate(views) for _ in range(k)]), item=cat(0),
                     token=cat(1), cell=cat(2), weight=cat(3), grid=(H, W), prefix=1, n_images=len(views),
                     note="tiles (rows × cols, raster order) and the global view put back on the original image; "
                          "slot 0: CLS")


def _image_places(r: int, c: int, k: int, g: int, H: int, W: int, first: int, offset: int,
                  image: int) -> tuple[torch.Tensor, ...]:
    """(item, token, cell, weight) of one image's k views."""
    C = 1 + H * W
    full = torch.zeros(k, first + g * g, C)
    full[:, :first, 0] = 1.0
    ii, jj = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
    for t in range(k - 1 if k > 1 else 0):
        tr, tc = divmod(t, c)
        cells = 1 + (tr * g + ii) * W + tc * g + jj
        full[t, first + (ii * g + jj).reshape(-1), cells.reshape(-1)] = 1.0
    over = torch.einsum("ri,cj->rcij", area_overlap(g, H), area_overlap(g, W)).reshape(g * g, H * W)
    full[k - 1, first:, 1:] = over  # the global view (the only view without tiles)
    it, tok, cell = torch.nonzero(full, as_tuple=True)
    return it + offset, tok, cell, full[it, tok, cell]
