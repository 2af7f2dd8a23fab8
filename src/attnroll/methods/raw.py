"""``raw``: the head-fused attention row of one layer (the last by default): who the output token attends to.

On a stage chain (Swin) the readout is carried down to the layer's stage through the merge maps above it
and the layer's row down to the input patches through the merge maps below it (``core.stages.stage_row``)."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.fusion import fuse_tensor, head_weights
from ..core.operators import attention_rows
from ..core.stages import stage_row
from ..explain import matrix_free
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import combine_rows


@register(
    "raw",
    description="raw attention: the head-fused attention row of one layer (default the last)",
    options={"layer": -1, "head_fusion": "mean", "stream": None, "return_layers": False, "attention": None},
    cost="1 forward",
    reference="Abnar & Zuidema 2020 (the 'raw attention' baseline)",
    refuse={"alpha": "raw attention has no residual; use method='rollout'",
            "start_layer": "raw reads one layer; pass layer=k (or use method='rollout' for a range)"},
)
def raw(ctx: Context, *, layer: int, head_fusion, stream, return_layers: bool, attention):
    """full_row[b] = Σ_i w_bi · fuse_h(A_layer)[b, i, :] over the readout's rows (one row for CLS / last
    token); ``return_layers`` gives that row for every layer (L, B, n). ``attention``: None / "recompute"
    recompute those rows from the kernel's queries and keys; "dense" captures the matrices."""
    _checks.check_bool("return_layers", return_layers)
    if matrix_free.choose(ctx, attention, None):
        rec = matrix_free.record(ctx, attention)
        if rec is not None:
            s = ctx.stream(rec)
            return _raw_rows(ctx, rec, s, matrix_free.layers_of(rec, s), attention_rows, layer, head_fusion,
                             return_layers, "recompute")
    rec = ctx.record()
    s = ctx.stream(rec)
    return _raw_rows(ctx, rec, s, rec.streams[s], lambda a, rows: a[:, :, rows], layer, head_fusion, return_layers,
                     "dense")


def _raw_rows(ctx, rec, s, layers, rows_of, layer, head_fusion, return_layers, route):
    """The raw Explanation from per-layer ``layers`` and ``rows_of(layer, rows)`` -> (B, H, r, n)."""
    k = _checks.check_index("layer", layer, len(layers), "layers")
    first = layers[0]
    head_weights(head_fusion, first.shape[1], like=first.q if hasattr(first, "q") else first)  # validates
    pos = ctx.readout(rec, s)
    rows = pos.rows()
    merges = ctx.info(rec, s).merges

    def row(i: int) -> torch.Tensor:
        a = layers[i]
        if merges:  # a stage chain: the layer's row between the merges above and below it (core.stages)
            return stage_row(pos.weights, fuse_tensor(a.to(torch.float32), head_fusion), merges, i, len(layers))
        # Fuse the heads on the readout's rows, then weight the rows: (B, n).
        return combine_rows(fuse_tensor(rows_of(a, rows).to(torch.float32), head_fusion), pos, rows)[0]

    stacked = torch.stack([row(i) for i in range(len(layers))]) if return_layers else None
    opts = {**ctx.options, "layer": k, "attention": route}
    return ctx.build(rec, row(k), pos, s, layers=stacked, options=opts)
