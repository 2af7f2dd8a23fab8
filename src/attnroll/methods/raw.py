"""``raw``: the head-fused attention row of one layer (the last by default): who the output token attends to."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.fusion import fuse_tensor, head_weights
<<<<<<< HEAD
from ..core.operators import attention_rows
from . import _recompute
from .base import Context, register
=======
from .base import Context, combine_rows, register
>>>>>>> main


@register(
    "raw",
    description="raw attention: the head-fused attention row of one layer (default the last)",
    options={"layer": -1, "head_fusion": "mean", "stream": None, "return_layers": False, "attention": None},
    cost="1 forward",
    reference="Abnar & Zuidema 2020 (the 'raw attention' baseline)",
    refuse={"alpha": "raw attention has no residual; use method='rollout'",
            "start_layer": "raw reads one layer; pass layer=k (or use method='rollout' for a range)"},
)
<<<<<<< HEAD
def raw(ctx: Context, *, layer: int, head_fusion, stream, return_layers: bool, attention):
    """full_row[b] = fuse_h(A_layer)[b, position_b, :]; ``return_layers`` gives that row for every layer
    (L, B, n). ``attention``: None / "recompute" recompute the one row per layer from the kernel's queries
    and keys; "dense" captures the matrices."""
    _checks.check_bool("return_layers", return_layers)
    if _recompute.choose(ctx, attention, None):
        rec = _recompute.record(ctx, attention)
        if rec is not None:
            s = ctx.stream(rec)
            ops = _recompute.layers_of(rec, s)
            rows = lambda lay, pos: attention_rows(lay, pos)  # noqa: E731  (B, H, n)
            return _raw_rows(ctx, rec, s, ops, rows, layer, head_fusion, return_layers, "recompute")
    rec = ctx.record()
    s = ctx.stream(rec)
    atts = rec.streams[s]
    B = atts[0].shape[0]
    ar = torch.arange(B)
    rows = lambda a, pos: a[ar, :, torch.tensor(pos)]  # noqa: E731  (B, H, n)
    return _raw_rows(ctx, rec, s, atts, rows, layer, head_fusion, return_layers, "dense")

=======
def raw(ctx: Context, *, layer: int, head_fusion, stream, return_layers: bool):
    """full_row[b] = Σ_i w_bi · fuse_h(A_layer)[b, i, :] over the readout's rows (one row for CLS / last
    token); ``return_layers`` gives that row for every layer (L, B, n)."""
    rec = ctx.record()
    s = ctx.stream(rec)
    atts = rec.streams[s]
    L = len(atts)
    k = _checks.check_index("layer", layer, L, "layers")
    _checks.check_bool("return_layers", return_layers)
    head_weights(head_fusion, atts[0].shape[1], like=atts[0])  # validates
    pos = ctx.readout(rec, s)
    rows = pos.rows()

    def row(a: torch.Tensor) -> torch.Tensor:
        # Fuse the heads on the readout's rows, then weight the rows: (B, n).
        a = a.to(torch.float32)
        return combine_rows(fuse_tensor(a[:, :, rows], head_fusion), pos, rows)[0]
>>>>>>> main

def _raw_rows(ctx, rec, s, layers, rows, layer, head_fusion, return_layers, route):
    """The raw Explanation from per-layer ``layers`` and ``rows(layer, positions)`` -> (B, H, n)."""
    L = len(layers)
    k = _checks.check_index("layer", layer, L, "layers")
    first = layers[0]
    like = first.q if hasattr(first, "q") else first
    head_weights(head_fusion, first.shape[1], like=like)  # validates
    pos = ctx.positions(rec, s)

    def row(a) -> torch.Tensor:
        return fuse_tensor(rows(a, pos).to(torch.float32).unsqueeze(-2), head_fusion).squeeze(-2)  # (B, n)

    stacked = torch.stack([row(a) for a in layers]) if return_layers else None
    opts = {**ctx.options, "layer": k, "attention": route}
    return ctx.build(rec, row(layers[k]), pos, s, layers=stacked, options=opts)
