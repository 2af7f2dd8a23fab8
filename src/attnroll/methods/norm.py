"""``norm``: Kobayashi et al. 2020's norm-based analysis of one layer: N_ij = ‖Σ_h α^h_ij f^h(x_j)‖ with
f^h(x) = (x W_V^h + b_V^h) W_O^h (b_O excluded; for pre-LN blocks x is the normed block input)."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.value_aware import mask_pairs, norm_matrix
from ..explain import value_aware as va
from ..explain.context import Context
from ..explain.registry import register


@register(
    "norm",
    description="norm-based attention (Kobayashi 2020): ‖Σ_h α^h_ij f^h(x_j)‖ of one layer (default the last)",
    options={"layer": -1, "return_layers": False, **va.COMMON},
    cost="1 forward (eager attention) + O(L·n²·H²) Gram products",
    reference="Kobayashi, Kuribayashi, Yokoi & Inui, Attention is Not Only a Weight, EMNLP 2020",
    refuse={**va.REFUSE, "alpha": "norm has no residual; use method='norm_rollout' for the residual-aware rollout"},
)
def norm(ctx: Context, *, layer, return_layers, dtype):
    """full_row[b] = N_layer[b, position_b, :]; ``return_layers``: that row for every layer (L, B, n)."""
    rec, states, anat = va.record(ctx)
    L = len(anat.layers)
    k = _checks.check_index("layer", layer, L, "layers")
    _checks.check_bool("return_layers", return_layers)
    dt = va.working_dtype(dtype, states.inputs[0])
    mask = ctx.mask(rec, "self")
    pos = ctx.positions(rec, "self")
    ar, pidx = torch.arange(len(pos)), torch.tensor(pos)
    with torch.no_grad():
        Ls = va.layers(rec, states, anat, dt)
        rows = [mask_pairs(norm_matrix(lay.alpha, lay.F), mask)[ar, pidx] for lay in Ls]
    stacked = torch.stack(rows) if return_layers else None
    return ctx.build(rec, rows[k], pos, "self", layers=stacked, options={**ctx.options, "layer": k})
