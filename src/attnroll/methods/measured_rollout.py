"""``measured_rollout``: attention rollout with the residual share measured per token and layer instead of
fixed at ½. Per layer M = diag(r) + diag(1 − r) · mean_h α^h, with r_i = ‖T_res,i‖ / (‖T_res,i‖ + ‖T_mix,i‖)
the norms of what the residual (token i's own input) and the attention (Σ_h Σ_j α^h_ij f^h(x̃_j)) contribute
to the block's output, the MLP and the norms split between the two as DecompX does (biases apart; see
:mod:`attnroll.core.residual_share`); multiplied over the layers with no extra identity (rows sum to 1)."""

from __future__ import annotations

from ..core.residual_share import measured_matrix
from . import _value_aware as va


def _matrices(layers, states, anat, mask):
    return [measured_matrix(lay.x, lay.attn, lay.alpha, lay.block) for lay in layers]


va.register_rolled(
    "measured_rollout",
    _matrices,
    description="rollout with the residual share measured per token: diag(r) + diag(1−r)·mean_h α, r from the norms of the residual and attention parts of the block output (MLP split as DecompX)",
    cost="1 forward (eager attention) + O(L·n·d·d_ff)",
    reference="Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020 (rollout), with the residual "
              "share measured as in Kobayashi et al., EMNLP 2021 and the MLP split as in Modarressi et al. "
              "(DecompX), ACL 2023",
)
