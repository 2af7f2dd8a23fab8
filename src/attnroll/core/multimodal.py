"""Composing a language model's relevance row with a vision tower's, for vision-language models whose image
tokens are the vision tower's tokens one to one (LLaVA, PaliGemma).

Shapes: B prompts (the language stream's batch), n_l language positions, N images (the vision stream's
batch), n_v vision tokens. K linked tokens: the k-th image token sits at (example[k], position[k]) of the
language sequence and is vision token token[k] of image item[k].

The composition, for a language row r (B, n_l) (the readout's shares of every language position):

    W[i, v]   = Σ_k [item_k = i, token_k = v] · r[example_k, position_k]     (:func:`source_weights`)
    t_i       = Σ_v W[i, v]                                                   (image i's share)
    M[i]      = t_i · (W[i] / t_i) @ R_v[i] / Σ((W[i] / t_i) @ R_v[i])         (:func:`push_through`)

R_v is the vision tower's rollout up to the layer whose output the projector reads. Rollout rows sum to 1, so
the normalisation is a no-op there; for gradient relevance (rows that do not) it reads the vision tower's
relevance as a distribution over its tokens, so that M[i] sums to t_i: image share Σ_i t_i plus the text
share (r at the unlinked positions) is the row's total. The caller computes (W[i] / t_i) @ R_v[i] as a
weighted readout of the vision rollout (:func:`split_mass` gives the weights), so no n_v × n_v product is
formed.

Torch tensors in, torch tensors out; no model, no I/O.
"""

from __future__ import annotations

import torch

__all__ = ["source_weights", "layer_groups", "place", "place_direct", "split_mass", "push_through", "item_examples",
           "per_example", "unlinked"]


def _check_link(row: torch.Tensor, example: torch.Tensor, position: torch.Tensor, item: torch.Tensor,
                token: torch.Tensor) -> None:
    if row.ndim != 2:
        raise ValueError(f"row must be (B, n_l) shares of the language positions, got shape {tuple(row.shape)}")
    shapes = {tuple(t.shape) for t in (example, position, item, token)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"example, position, item and token must be (K,) tensors of one length, got {sorted(shapes)}")
    if example.numel() and (int(example.max()) >= row.shape[0] or int(position.max()) >= row.shape[1]
                            or int(example.min()) < 0 or int(position.min()) < 0):
        raise ValueError(f"linked (example, position) pairs must lie inside the row {tuple(row.shape)}")


def source_weights(row: torch.Tensor, example: torch.Tensor, position: torch.Tensor, item: torch.Tensor,
                   token: torch.Tensor, n_items: int, n_source: int,
                   weight: torch.Tensor | None = None) -> torch.Tensor:
    """W (n_items, n_source): the language share of each image token, placed at its (image, vision token);
    with ``weight`` (K,) the k-th entry carries that fraction of its token's share (a language token made of
    several vision tokens is listed once per source)."""
    _check_link(row, example, position, item, token)
    if item.numel() and (int(item.max()) >= n_items or int(token.max()) >= n_source or int(item.min()) < 0
                         or int(token.min()) < 0):
        raise ValueError(f"linked (item, token) pairs must lie inside ({n_items}, {n_source})")
    W = torch.zeros(n_items, n_source, dtype=row.dtype, device=row.device)
    vals = row[example.to(row.device), position.to(row.device)]
    if weight is not None:
        if tuple(weight.shape) != tuple(example.shape):
            raise ValueError(f"weight must be (K,) = {tuple(example.shape)}, got {tuple(weight.shape)}")
        vals = vals * weight.to(device=row.device, dtype=row.dtype)
    W.index_put_((item.to(row.device), token.to(row.device)), vals, accumulate=True)
    return W


def layer_groups(layers: torch.Tensor | None, default: int, count: int) -> list[tuple[int, torch.Tensor]]:
    """[(k, indices)]: the link entries grouped by how many source layers they passed through (one group of
    all ``count`` entries at ``default`` when ``layers`` is None), k ascending."""
    if layers is None:
        return [(default, torch.arange(count))]
    return [(int(k), torch.nonzero(layers == k).reshape(-1)) for k in torch.unique(layers).tolist()]


def place(M: torch.Tensor, image: torch.Tensor, item: torch.Tensor, token: torch.Tensor, cell: torch.Tensor,
          weight: torch.Tensor, n_images: int, n_cells: int) -> torch.Tensor:
    """(n_images, n_cells): the per-item maps M (N, n_v) put on the images' canvases; entry k sends share
    ``weight[k]`` of M[item[k], token[k]] to cell ``cell[k]`` of image ``image[item[k]]``. ValueError when an
    item token that holds relevance has no place (the canvas would lose mass)."""
    placed = torch.zeros_like(M)
    placed.index_put_((item, token), weight.to(M.dtype), accumulate=True)
    lost = (M != 0) & ~torch.isclose(placed, torch.ones_like(placed), atol=1e-5)
    if bool(lost.any()):
        i, v = (int(t) for t in torch.nonzero(lost)[0])
        raise ValueError(f"token {v} of item {i} holds relevance but its placement weights sum to "
                         f"{float(placed[i, v]):.4g}, not 1")
    out = torch.zeros(n_images, n_cells, dtype=M.dtype, device=M.device)
    out.index_put_((image[item], cell), M[item, token] * weight.to(M.dtype), accumulate=True)
    return out


def place_direct(row: torch.Tensor, example: torch.Tensor, position: torch.Tensor, image: torch.Tensor,
                 cell: torch.Tensor, weight: torch.Tensor, canvas: torch.Tensor) -> torch.Tensor:
    """The canvas (n_images, n_cells) plus the shares of tokens placed straight on an image (no source token):
    entry k sends ``weight[k]`` of row[example[k], position[k]] to cell ``cell[k]`` of image ``image[k]``."""
    out = canvas.clone()
    out.index_put_((image, cell), row[example, position] * weight.to(row.dtype), accumulate=True)
    return out


def split_mass(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, n_v) with rows summing to 1, totals (N,)): W = totals[:, None] · weights. A row of zero
    total gets uniform weights (its total 0 keeps it out of the result)."""
    totals = W.sum(dim=-1)
    safe = torch.where(totals[:, None] != 0, W, torch.ones_like(W))
    return safe / safe.sum(dim=-1, keepdim=True), totals


def push_through(source_rows: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """M (N, n_v): each image's weighted vision-rollout row, rescaled to sum to its share ``totals`` (N,).

    ``source_rows`` (N, n_v): (W[i] / t_i) @ R_v[i]; a row that sums to 0 stays 0."""
    if source_rows.ndim != 2 or totals.shape != source_rows.shape[:1]:
        raise ValueError(f"source_rows must be (N, n_v) and totals (N,), got {tuple(source_rows.shape)} and "
                         f"{tuple(totals.shape)}")
    sums = source_rows.sum(dim=-1, keepdim=True)
    scale = torch.where(sums != 0, totals[:, None] / torch.where(sums != 0, sums, torch.ones_like(sums)),
                        torch.zeros_like(sums))
    return source_rows * scale


def item_examples(example: torch.Tensor, item: torch.Tensor, n_items: int) -> list[int | None]:
    """The prompt each image belongs to (None for an image no token of the prompts uses); ValueError when one
    image's tokens lie in several prompts."""
    out: list[int | None] = [None] * n_items
    for e, i in zip(example.tolist(), item.tolist()):
        if out[i] is not None and out[i] != e:
            raise ValueError(f"image {i}'s tokens lie in prompts {out[i]} and {e}; an image belongs to one prompt")
        out[i] = e
    return out


def per_example(M: torch.Tensor, owners: list[int | None], batch: int) -> torch.Tensor:
    """(B, n_v): each prompt's image map (zeros for a prompt without an image). ValueError for a prompt with
    several images: their maps lie on different images and are not summed."""
    out = torch.zeros(batch, M.shape[-1], dtype=M.dtype, device=M.device)
    seen: dict[int, int] = {}
    for i, b in enumerate(owners):
        if b is None:
            continue
        if b in seen:
            raise ValueError(
                f"prompt {b} holds images {seen[b]} and {i}: one image map per prompt is made; explain such prompts "
                "one image at a time"
            )
        seen[b] = i
        out[b] = M[i]
    return out


def unlinked(row: torch.Tensor, example: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The row with the linked positions set to 0: the text positions' shares (B, n_l)."""
    out = row.clone()
    out[example.to(row.device), position.to(row.device)] = 0
    return out
