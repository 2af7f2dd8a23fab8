"""``attn_gradcam``: the attention Grad-CAM baseline of Chefer, Gur & Wolf (CVPR 2021).

For one layer (the last by default): each head's weight is its gradient dy/dA averaged over the key positions
of the explained row (prefix tokens excluded, padding excluded); the map is (mean_h(w_h · A_h[row]))^+."""

from __future__ import annotations

import torch

from .. import _checks
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import combine_rows


@register(
    "attn_gradcam",
    description="attention Grad-CAM (Chefer CVPR'21 baseline): last-layer attention row weighted per head by its mean "
                "gradient, clamped (class-specific)",
    options={"layer": -1, "stream": None},
    needs_grad=True,
    class_specific=True,
    cost="1 forward + 1 backward (eager attention)",
    reference="Chefer, Gur & Wolf, Transformer Interpretability Beyond Attention Visualization, CVPR 2021 (baseline; "
              "after Selvaraju et al. 2017)",
    refuse={"start_layer": "attention Grad-CAM reads one layer; pass layer=k",
            "head_fusion": "the heads are weighted by their mean gradient by definition"},
)
def attn_gradcam(ctx: Context, *, layer, stream):
    """full_row[b] = (mean_h(w_bh · A_layer[b, h, p_b, :]))^+ with w_bh = mean over real non-prefix keys j of
    dy/dA_layer[b, h, p_b, j], p_b the readout row (a weighted readout combines the rows' maps)."""
    s0 = ctx.options.get("stream")
    rec, atts, grads = ctx.grad_record([s0] if s0 else None)
    s = ctx.stream(rec)
    k = _checks.check_index("layer", layer, len(atts[s]), "layers")
    A, G = atts[s][k].to(torch.float32), grads[s][k].to(torch.float32)
    pos = ctx.readout(rec, s)
    rows = pos.rows()
    B, H, n, _ = A.shape
    a_rows, g_rows = A[:, :, rows], G[:, :, rows]  # (B, H, r, n)
    info = ctx.info(rec, s)
    keys = torch.ones(B, n, dtype=torch.float32)
    keys[:, : info.prefix] = 0
    m = info.mask
    if m is not None:
        keys = keys * m.cpu().to(torch.float32)
    keys = keys.to(A.device)
    w = (g_rows * keys[:, None, None]).sum(-1, keepdim=True) / keys.sum(-1).clamp(min=1)[:, None, None, None]
    per_row = (w * a_rows).mean(dim=1).clamp(min=0)  # (B, r, n): one map per readout row
    row, _ = combine_rows(per_row, pos, rows)
    return ctx.build(rec, row, pos, s, options={**ctx.options, "layer": k})
