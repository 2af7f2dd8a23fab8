"""Any-resolution tiles put back on the user's image: LLaVA-NeXT and LLaVA-OneVision.

The processor gives each image a base view (the whole image resized to the tower's square input) and the
tiles of a resized, centre-padded copy at the best pinpoint resolution. The model's own ``pack_image_features``
turns the tiles' features into one grid: the tiles put side by side, the padding cut off (``unpad_image``), the
grid bilinearly shrunk (OneVision, above ``anyres_max_N``), a learned newline token closing every row; the base
view's tokens come first. Running it on one-hot tags (every tile token its own channel) gives, for every image
token of the language sequence, the tile tokens it is made of (its row of F) and its place: the unpadded grid
covers the original image, so the canvas is that grid (rows, cols).

Placement on the canvas:
- a tile token: the cells whose packed tokens it went into, in proportion (one cell without the shrink);
- a base-view token (r, c) of the p×p base grid: the canvas cells its square covers, by area (the base view
  is the whole image squashed to a square);
- tile tokens the packing dropped (padding) and CLS tokens: prefix slot 0 (no place on the image);
- a newline token: an image token that comes from no vision token; its share goes evenly to the cells of the
  row it closes (``Placement.direct``; the single-view case, one newline after the image: every cell).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn

from .record import Placement

__all__ = ["tile_counts", "anyres_map", "area_overlap"]


def tile_counts(model: nn.Module, inputs: dict[str, Any]) -> list[int] | str:
    """The vision items (base view + tiles) of each image, as the model's own ``get_image_features`` counts
    them from ``image_sizes`` (OneVision: one item for every image of a multi-image prompt)."""
    sizes = inputs.get("image_sizes")
    if not isinstance(sizes, torch.Tensor):
        return "image_sizes is missing: the tiles of an any-resolution image are counted from it"
    to_patches = getattr(sys.modules[type(model.model).__module__], "image_size_to_num_patches", None)
    if to_patches is None:
        return f"{type(model.model).__module__} has no image_size_to_num_patches: the tiles cannot be counted"
    cfg = model.config
    per_prompt = inputs.get("batch_num_images")
    patching = [True] * sizes.shape[0] if per_prompt is None else [int(n) == 1 for n in per_prompt
                                                                    for _ in range(int(n))]
    return [to_patches(image_size=s, grid_pinpoints=cfg.image_grid_pinpoints, patch_size=cfg.vision_config.image_size)
            if p else 1 for s, p in zip(sizes, patching)]


def area_overlap(n_in: int, n_out: int) -> torch.Tensor:
    """(n_in, n_out): the share of each of n_in equal intervals of [0, 1) that falls in each of n_out ones."""
    a = torch.arange(n_in + 1, dtype=torch.float64) / n_in
    b = torch.arange(n_out + 1, dtype=torch.float64) / n_out
    lo = torch.maximum(a[:-1, None], b[None, :-1])
    hi = torch.minimum(a[1:, None], b[None, 1:])
    return ((hi - lo).clamp(min=0) * n_in).to(torch.float32)


def _pack(model: nn.Module, feats: list[torch.Tensor], inputs: dict[str, Any], strategy: str) -> list[torch.Tensor]:
    pack = model.model.pack_image_features
    D = feats[0].shape[-1]
    kw: dict[str, Any] = {"image_newline": torch.zeros(D)}
    params = inspect.signature(pack).parameters
    if "vision_feature_select_strategy" in params:
        kw["vision_feature_select_strategy"] = strategy
    if "vision_aspect_ratio" in params:
        kw["vision_aspect_ratio"] = inputs.get("vision_aspect_ratio") or getattr(
            model.config, "vision_aspect_ratio", "anyres_max_9")
    with torch.no_grad():
        return list(pack(feats, inputs["image_sizes"], **kw)[0])


def anyres_map(model: nn.Module, inputs: dict[str, Any], n_v: int, first: int,
               strategy: str) -> tuple[torch.Tensor, Placement, list[tuple[int, torch.Tensor, torch.Tensor]]] | str:
    """(F (T, N, n_v - first), placement without ``direct``, newlines [(image, row index in F, cells)]) or the
    reason there is none."""
    counts = tile_counts(model, inputs)
    if isinstance(counts, str):
        return counts
    N = sum(counts)
    n = n_v - first
    rows, newlines, place = [], [], []
    offset = 0
    for g, k in enumerate(counts):
        D = k * n
        one = {**inputs, "image_sizes": inputs["image_sizes"][g:g + 1]}
        packed = _pack(model, [torch.eye(D).reshape(k, n, D)] * 1, one, strategy)[0]
        F_g = torch.zeros(packed.shape[0], N, n)
        F_g[:, offset:offset + k] = packed.reshape(-1, k, n)
        grid, cells = _canvas(packed, k, n)
        for q in torch.nonzero(packed.abs().sum(dim=-1) == 0).reshape(-1).tolist():
            newlines.append((g, sum(r.shape[0] for r in rows) + q, cells[q]))
        place.append(_tile_places(packed, k, n, grid, cells, g, offset, first, n_v))
        rows.append(F_g)
        offset += k
    grids = {p[0] for p in place}
    if len(grids) != 1:
        return (f"the images' canvases differ ({sorted(grids)}): one map per call is drawn on one grid; explain "
                "one image at a time")
    cat = lambda i: torch.cat([p[i] for p in place])  # noqa: E731
    P = Placement(image=torch.tensor([g for g, k in enumerate(counts) for _ in range(k)]), item=cat(1), token=cat(2),
                  cell=cat(3), weight=cat(4), grid=place[0][0], prefix=1, n_images=len(counts),
                  note="tiles and base view put back on the original image (unpadded tile grid); slot 0: CLS and "
                       "tile padding; newline tokens spread over the row they close")
    return torch.cat(rows), P, newlines


def _canvas(packed: torch.Tensor, k: int, n: int) -> tuple[tuple[int, int], list[torch.Tensor]]:
    """(canvas grid, per packed row the canvas cells it covers: one cell, the base view's cells, or for a
    newline the cells of its row)."""
    is_new = packed.abs().sum(dim=-1) == 0
    side = int(round(n ** 0.5))
    if k == 1:  # the base view alone, one newline after it
        every = torch.arange(n)
        return (side, side), [torch.tensor([q]) if q < n else every for q in range(packed.shape[0])]
    rest = is_new[n:].tolist()
    width = rest.index(True)
    height = sum(rest)
    cells: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * n
    r = c = 0
    for new in rest:
        if new:
            cells.append(torch.arange(r * width, (r + 1) * width))
            r, c = r + 1, 0
        else:
            cells.append(torch.tensor([r * width + c]))
            c += 1
    return (height, width), cells


def _tile_places(packed: torch.Tensor, k: int, n: int, grid: tuple[int, int], cells: list[torch.Tensor], g: int,
                 offset: int, first: int, n_v: int) -> tuple:
    """(grid, item, token, cell, weight) of every vision token of image g's items."""
    H, W = grid
    C = 1 + H * W
    share = torch.zeros(k * n, C)  # per (tile, read token): its mass over the canvas slots
    side = int(round(n ** 0.5))
    if k > 1:
        over = torch.einsum("ri,cj->rcij", area_overlap(side, H), area_overlap(side, W)).reshape(n, H * W)
        share[:n, 1:] = over
    for q in range(n if k > 1 else 0, packed.shape[0]):
        if cells[q].numel() == 1 and bool(packed[q].abs().sum() > 0):
            share[:, 1 + int(cells[q])] += packed[q]
    total = share.sum(dim=-1, keepdim=True)
    share = torch.where(total > 0, share / total.clamp(min=1e-12), torch.zeros_like(share))
    share[:, 0] = torch.where(total[:, 0] > 0, share[:, 0], torch.ones(k * n))  # dropped by the packing
    full = torch.zeros(k, n_v, C)
    full[:, :first, 0] = 1.0  # CLS
    full[:, first:] = share.reshape(k, n, C)
    it, tok, cell = torch.nonzero(full, as_tuple=True)
    return grid, it + offset, tok, cell, full[it, tok, cell]
