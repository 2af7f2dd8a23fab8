"""``raw``: the head-fused attention row of one layer (the last by default): who the output token attends to."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.fusion import fuse_tensor, head_weights
from .base import Context, combine_rows, register


@register(
    "raw",
    description="raw attention: the head-fused attention row of one layer (default the last)",
    options={"layer": -1, "head_fusion": "mean", "stream": None, "return_layers": False},
    cost="1 forward",
    reference="Abnar & Zuidema 2020 (the 'raw attention' baseline)",
    refuse={"alpha": "raw attention has no residual; use method='rollout'",
            "start_layer": "raw reads one layer; pass layer=k (or use method='rollout' for a range)"},
)
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

    layers = torch.stack([row(a) for a in atts]) if return_layers else None
    opts = {**ctx.options, "layer": k}
    return ctx.build(rec, row(atts[k]), pos, s, layers=layers, options=opts)
