"""The composition of a linked stream (a VLM's language row) down to the source stream's tokens and, when the
source items are tiles or resized copies of the user's images, onto those images (``capture.record.Placement``).

Steps (the maths is :mod:`attnroll.core.multimodal`): the language row's shares of the image tokens are split
over their sources (``StreamLink.weight``: pixel shuffle, patch merging, pooling), grouped by the vision layer
the sources were read after (``StreamLink.layers``: VipLLaVA), each group pushed through the vision stream's
relevance up to that layer, the groups summed per item; then, with a placement, every item token's relevance is
put on its image's canvas and the shares of tokens placed straight on the image (newline tokens) added.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..capture.readout import Readout
from ..capture.record import StreamLink
from ..core import multimodal

__all__ = ["compose_link"]


def item_maps(row: torch.Tensor, link: StreamLink, shape: tuple[int, ...], source: Callable,
              stream: str) -> torch.Tensor:
    """(N, n_v): each source item's relevance, summed over the link's layer groups; sums to the image share."""
    K = link.example.shape[0]
    M = torch.zeros(shape[0], shape[-1], dtype=torch.float32)
    for k, sel in multimodal.layer_groups(link.layers, link.source_layers, K):
        w = None if link.weight is None else link.weight[sel]
        W = multimodal.source_weights(row, link.example[sel], link.position[sel], link.item[sel], link.token[sel],
                                      shape[0], shape[-1], weight=w)
        weights, totals = multimodal.split_mass(W)
        src = source(link.source, Readout("weights", weights, f"the {stream} stream's shares of the image tokens"), k)
        M = M + multimodal.push_through(src.detach().to(torch.float32).cpu(), totals)
    return M


def compose_link(row: torch.Tensor, link: StreamLink, shape: tuple[int, ...], source: Callable,
                 stream: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(image (B, units), text (B, n_l), extra): the per-prompt image map (on the source grid, or on the
    placement's canvas), the text positions' shares and what the Explanation records of the composition."""
    M = item_maps(row, link, shape, source, stream)
    kept = kept_shares(row, link)
    P = link.placement
    positions = [link.position[link.example == b] for b in range(row.shape[0])]
    if P is None:
        owners = multimodal.item_examples(link.example, link.item, shape[0])
        text = multimodal.unlinked(row, link.example, link.position)
        return multimodal.per_example(M, owners, row.shape[0]), text, {
            "image_positions": [torch.unique(p).tolist() for p in positions], **kept}
    n_cells = P.prefix + P.grid[0] * P.grid[1]
    canvas = multimodal.place(M, P.image, P.item, P.token, P.cell, P.weight, P.n_images, n_cells)
    owners = multimodal.item_examples(link.example, P.image[link.item], P.n_images)
    text = multimodal.unlinked(row, link.example, link.position)
    extra: dict = dict(kept)
    if P.direct is not None:
        ex, pos, img, cell, w = P.direct
        canvas = multimodal.place_direct(row, ex, pos, img, cell, w, canvas)
        text = multimodal.unlinked(text, ex, pos)
        placed = torch.zeros(row.shape[0], dtype=row.dtype)
        placed.index_add_(0, ex, row[ex, pos] * w.to(row.dtype))
        extra["newline_share"] = placed
        positions = [torch.cat([p, pos[ex == b]]) for b, p in enumerate(positions)]
        owners = [o if o is not None else _direct_owner(ex, img, g) for g, o in enumerate(owners)]
    extra["image_positions"] = [torch.unique(p).tolist() for p in positions]
    extra["placement"] = P.note
    image = multimodal.per_example(canvas, owners, row.shape[0])
    if P.views:
        extra.update(split_views(image, P.prefix, P.views))
    return image, text, extra


def split_views(image: torch.Tensor, prefix: int, views: list[tuple[int, int]]) -> dict:
    """Several images on one canvas (``Placement.views``): each prompt's canvas (B, prefix + cells) cut into one
    (rows, cols) map per image (``image_maps``, ``image_grids``)."""
    sizes = [h * w for h, w in views]
    maps = [[m.reshape(v) for m, v in zip(image[b, prefix:].split(sizes), views)] for b in range(image.shape[0])]
    return {"image_maps": maps, "image_grids": [[list(v) for v in views] for _ in range(image.shape[0])]}


def kept_shares(row: torch.Tensor, link: StreamLink) -> dict:
    """extra[name + "_scores"] (B, m) and extra[name + "_share"] (B,) of each share the link keeps on sources of
    neither stream (``StreamLink.kept``: a Q-Former's learned queries, its instruction)."""
    out: dict = {}
    for k in link.kept:
        vals = row[k.example, k.position][:, None] * k.share.to(row.dtype)
        scores = torch.zeros(row.shape[0], k.share.shape[-1], dtype=row.dtype).index_add_(0, k.example, vals)
        out[k.name + "_scores"], out[k.name + "_share"] = scores, scores.sum(dim=-1)
    return out


def _direct_owner(example: torch.Tensor, image: torch.Tensor, g: int) -> int | None:
    hit = example[image == g]
    return int(hit[0]) if hit.numel() else None
