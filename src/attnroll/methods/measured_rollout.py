"""``measured_rollout``: attention rollout with the residual share measured per token and layer instead of
fixed at ½. Per layer M = diag(r) + diag(1 − r) · mean_h α^h, with r_i = ‖T_res,i‖ / (‖T_res,i‖ + ‖T_mix,i‖)
the norms of what the residual (token i's own input) and the attention (Σ_h Σ_j α^h_ij f^h(x̃_j)) contribute
to the block's output, the MLP and the norms split between the two as DecompX does (biases apart; see
:mod:`attnroll.core.residual_share`); multiplied over the layers with no extra identity (rows sum to 1).

``class_blocks=k`` (default 0: the class-agnostic map above) makes the top k blocks class-specific: their
pattern mean_h α^h becomes gae's mean_h (∂y/∂α^h ⊙ α^h)^+ with the rows normalised (the same residual share
r), ∂y/∂α from one more forward and backward pass through the model's own attention (the target: the
predicted class by default). Chosen on the validation sets of both benchmarks (docs/research/value-aware-shapes.md)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _checks
from ..core.residual_share import class_pattern, measured_matrix
from ..explain import value_aware as va
from ..explain.context import Context
from ..explain.registry import register


def _top_gradients(ctx: Context, k: int) -> list[torch.Tensor]:
    """∂y/∂α (B, H, n, n) of every layer of the self-attention stream, the target's, through the model's own
    attention (gae's gradients); also under torch.no_grad() / inference_mode(), which the map needs none of."""
    with torch.inference_mode(False), torch.enable_grad():
        rec, _, grads = ctx.grad_record()
    g = grads[ctx.stream(rec)]
    if k > len(g):
        raise ValueError(f"class_blocks must be in [0, {len(g)}] (the number of blocks), got {k}")
    return g


def _matrices(grads: list[torch.Tensor] | None, k: int):
    """The per-layer matrices, the top ``k`` with the class-specific pattern from ``grads``."""

    def matrices(layers, states, anat, mask):
        L = len(layers)
        if grads is not None and len(grads) != L:
            raise _checks.CaptureError(f"measured_rollout: {len(grads)} attention gradients for {L} blocks")
        return [measured_matrix(lay.x, lay.attn, lay.alpha, lay.block,
                                class_pattern(lay.alpha, grads[i]) if i >= L - k else None)
                for i, lay in enumerate(layers)]

    return matrices


@register(
    "measured_rollout",
    description="rollout with the residual share measured per token: diag(r) + diag(1−r)·mean_h α, r from the norms of "
        "the residual and attention parts of the block output (MLP split as DecompX); class_blocks=k: the top k "
        "blocks' pattern gae's (class-specific)",
    options={**va.ROLLOUT, **va.COMMON, "class_blocks": 0},
    cost="1 forward (eager attention) + O(L·n·d·d_ff); class_blocks > 0: + 1 forward and backward",
    reference="Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020 (rollout), with the residual "
              "share measured as in Kobayashi et al., EMNLP 2021 and the MLP split as in Modarressi et al. "
              "(DecompX), ACL 2023; class_blocks: Chefer, Gur & Wolf's gradient-weighted attention, ICCV 2021",
    refuse=va.REFUSE,
)
def measured_rollout(ctx: Context, *, start_layer: Any, end_layer: Any, return_layers: bool, dtype: Any,
                     class_blocks: Any):
    """full_row[b] = row position_b of M_end ⋯ M_start; the top ``class_blocks`` M with gae's pattern."""
    k = _checks.check_int("class_blocks", class_blocks, low=0)
    grads = _top_gradients(ctx, k) if k else None
    return va.explain_matrices(ctx, _matrices(grads, k), start_layer=start_layer, end_layer=end_layer,
                               return_layers=return_layers, dtype=dtype)
