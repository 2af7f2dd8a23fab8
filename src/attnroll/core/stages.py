"""Stage chains: rollout across stages whose token count changes (Swin's patch merging).

A multi-stage stream is a list of L per-layer square matrices Ã_l (B, n_l, n_l) plus fixed *merge maps*
M_k (n_k, n_{k-1}): M_k sits between layer k−1 and layer k and says how each token of the coarser stage is
made of tokens of the finer one (row-stochastic: a merged token takes shares of its sources summing to 1).
The composed relevance is the product, newest layer on the left,

    R = Ã_{L−1} ··· Ã_k · M_k · Ã_{k−1} ··· Ã_0            (n_{L−1} × n_0, rectangular)

which stays row-stochastic when every factor is. Explained rows are carried right to left as vectors,
v ← v·Ã_l and v ← v·M_k, so the cost is O(Σ n_l²) per row.

Merge maps are a convention, like rollout's residual weight α = ½: the patch-merging layer itself is a
learned linear map of the concatenated channels, and "equal shares of the 2×2 sources" is what rollout
assumes about it (see ``merge_2x2``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch


def merge_2x2(rows: int, cols: int) -> torch.Tensor:
    """The merge map of 2×2 patch merging on a (rows, cols) raster grid: (n_out, n_in) float32, n_in =
    rows·cols, n_out = ⌈rows/2⌉·⌈cols/2⌉. Merged token (i, j) (raster order of the coarse grid) takes equal
    shares of its real sources (2i + a, 2j + b), a, b ∈ {0, 1}: ¼ each, or ½ / 1 at an odd border, where
    the merging layer pads with zeros that carry no token."""
    if rows < 1 or cols < 1:
        raise ValueError(f"merge_2x2: the grid must have at least one row and column, got ({rows}, {cols})")
    r2, c2 = (rows + 1) // 2, (cols + 1) // 2
    M = torch.zeros(r2 * c2, rows * cols)
    for i in range(rows):
        for j in range(cols):
            M[(i // 2) * c2 + j // 2, i * cols + j] = 1.0
    return M / M.sum(dim=-1, keepdim=True)


def check_merges(merges: Mapping[int, torch.Tensor], sizes: Sequence[int]) -> dict[int, torch.Tensor]:
    """Validate merge maps against the per-layer token counts ``sizes`` (n_0 … n_{L−1}).

    ``merges[k]`` (1 ≤ k ≤ L) is (n_k, n_{k−1}) (k = L: after the last layer, n_L its output size),
    non-negative with rows summing to 1; consecutive layers without a merge must have the same size."""
    L = len(sizes)
    out = {}
    for k, M in merges.items():
        if not isinstance(k, int) or not 1 <= k <= L:
            raise ValueError(f"merges: key {k!r} must be a layer index in 1..{L} (the merge before layer k)")
        M = torch.as_tensor(M)
        if M.ndim != 2 or M.shape[1] != sizes[k - 1] or (k < L and M.shape[0] != sizes[k]):
            want = f"(n_{k}, {sizes[k - 1]})" if k == L else f"({sizes[k]}, {sizes[k - 1]})"
            raise ValueError(f"merges[{k}] must have shape {want}, got {tuple(M.shape)}")
        if bool((M < 0).any()) or not torch.allclose(M.sum(dim=-1), torch.ones(M.shape[0], dtype=M.dtype), atol=1e-5):
            raise ValueError(f"merges[{k}] must be non-negative with rows summing to 1 (each merged token's shares)")
        out[k] = M
    for k in range(1, L):
        if k not in out and sizes[k] != sizes[k - 1]:
            raise ValueError(f"layers {k - 1} and {k} have {sizes[k - 1]} and {sizes[k]} tokens but no merge map "
                             f"between them")
    return out


def carry_rows(
    v: torch.Tensor,
    merges: Mapping[int, torch.Tensor],
    num_layers: int,
    step: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """Carry rows v (B, r, n_out) down the chain to the first layer's tokens: (B, r, n_0).

    ``step(l, v)`` = v·Ã_l for layers l in [start, end); layers outside the range count as the identity
    (their merges still apply: they are the stream's structure, not a layer's mixing). n_out is the size
    after the last merge key ≤ L."""
    end = num_layers if end is None else end
    for k in range(num_layers, -1, -1):
        if k < num_layers and start <= k < end:
            v = step(k, v)
        M = merges.get(k)
        if M is not None:
            v = v @ M.to(device=v.device, dtype=v.dtype)
    return v


def pull_back(v: torch.Tensor, merges: Mapping[int, torch.Tensor], upto: int, down_to: int = 0) -> torch.Tensor:
    """Structure only: carry rows v (…, n) from the tokens after merge ``upto`` down to layer ``down_to``'s
    tokens through the merge maps with keys in (down_to, upto]."""
    for k in range(upto, down_to, -1):
        M = merges.get(k)
        if M is not None:
            v = v @ M.to(device=v.device, dtype=v.dtype)
    return v


def compose_chain(layers: Sequence[torch.Tensor], merges: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The full product R = Ã_{L−1}···M_k···Ã_0 of already augmented layers (…, n_l, n_l): (…, n_out, n_0).

    For small chains and checks; explanations carry rows with :func:`carry_rows`."""
    L = len(layers)
    check_merges(merges, [t.shape[-1] for t in layers])
    eye = torch.eye(layers[-1].shape[-1] if L not in merges else merges[L].shape[0], dtype=layers[0].dtype)
    return carry_rows(eye.expand(*layers[0].shape[:-2], -1, -1), merges, L, lambda i, v: v @ layers[i])


def chain_rollout(
    attentions: Sequence[torch.Tensor],
    merges: Mapping[int, torch.Tensor],
    weights: torch.Tensor,
    *,
    head_fusion="mean",
    start_layer: int = 0,
    end_layer: int | None = None,
    check_stochastic: bool = True,
    dtype=None,
    **pipeline_options,
) -> torch.Tensor:
    """Rollout along a stage chain for the weighted rows ``weights`` (B, n_out): (B, n_0).

    ``attentions``: L per-layer tensors (B, H_l, n_l, n_l) (or (B, n_l, n_l) with ``head_fusion=None``),
    ``merges`` as in :func:`check_merges`. Each layer goes through rollout's own pipeline (fusion,
    sparsification, residual; ``pipeline_options`` are ``LayerPipeline``'s: alpha, residual_mode,
    discard_ratio, discard_scope, top_k, threshold, protect_prefix) and is validated as rollout validates
    it; the merge maps are applied between them. No padding mask: stage chains are image streams."""
    from .rollout import LayerPipeline, layer_range, parse_attentions

    L = len(attentions)
    sizes = [int(t.shape[-1]) for t in attentions]
    merges = check_merges(merges, sizes)
    start, end = layer_range(L, start_layer, end_layer)
    n_out = merges[L].shape[0] if L in merges else sizes[-1]
    B = attentions[0].shape[0]
    if weights.ndim != 2 or tuple(weights.shape) != (B, n_out):
        raise ValueError(f"weights must have shape ({B}, {n_out}) (per example, one weight per final token), got "
                         f"{tuple(weights.shape)}")
    parsed = [parse_attentions([t], fused=head_fusion is None, dtype=dtype, check_stochastic=check_stochastic,
                               name=f"attentions[{i}]") for i, t in enumerate(attentions)]
    pipes = {n: LayerPipeline(n, head_fusion=head_fusion, **pipeline_options) for n in set(sizes)}
    v = weights.to(device=attentions[0].device, dtype=parsed[0].dtype).unsqueeze(1)

    def step(i: int, rows: torch.Tensor) -> torch.Tensor:
        out = pipes[sizes[i]].right(rows, parsed[i], 0)
        parsed[i].flush()
        return out

    return carry_rows(v, merges, L, step, start=start, end=end)[:, 0]


def stage_row(weights: torch.Tensor, layer: torch.Tensor, merges: Mapping[int, torch.Tensor], k: int,
              num_layers: int) -> torch.Tensor:
    """One layer's row in a stage chain, on the first layer's tokens: (B, n_0).

    The readout ``weights`` (B, n_out) are carried down to layer k's tokens through the merges above it
    (structure only), multiplied with that layer's head-fused matrix ``layer`` (B, n_k, n_k), and the
    result carried down to the first layer's tokens through the merges below (``raw`` on a chain)."""
    w = pull_back(weights.to(device=layer.device, dtype=layer.dtype), merges, num_layers, k)
    return pull_back((w.unsqueeze(1) @ layer)[:, 0], merges, k, 0)
