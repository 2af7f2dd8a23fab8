"""``norm_rollout``: rollout of Kobayashi et al. 2021's AttnRes-N: per layer the norms ‖z_{i←j}‖ of
z_{i←j} = Σ_h α^h_ij f^h(x_j) + δ_ij x_j (the residual's own vector on the diagonal), rows normalised, so the
residual share is measured instead of fixed at ½; multiplied over the layers with no extra identity."""

from __future__ import annotations

from ..core.value_aware import norm_matrix
from ..explain import value_aware as va


def _matrices(layers, states, anat, mask):
    return [norm_matrix(lay.alpha, lay.F, lay.x) for lay in layers]


va.register_rolled(
    "norm_rollout",
    _matrices,
    description="norm-based rollout: ‖Σ_h α f^h(x_j) + δ_ij x_j‖ per layer (measured residual share), rows normalised, "
                "multiplied",
    cost="1 forward (eager attention) + O(L·n²·H²)",
    reference="Kobayashi, Kuribayashi, Yokoi & Inui, Incorporating Residual and Normalization Layers into "
              "Analysis of Masked Language Models, EMNLP 2021 (AttnRes-N); rolled out as Abnar & Zuidema 2020",
)
