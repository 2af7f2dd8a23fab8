"""``globenc``: GlobEnc (Modarressi et al., NAACL 2022). The attention + residual vectors z_{i←j} are pushed
through the block's norms as those act on the actual vectors, g(z) = (z − mean z) / σ(actual) ⊙ γ (β
apart; the FFN bypassed); N_ij = ‖·‖, rows normalised, multiplied over the layers (no extra identity).

Post-LN blocks (BERT): both norms of the block (after the attention residual and after the FFN residual).
Pre-LN blocks have no norm on the residual stream: N_ij = ‖z_{i←j}‖, and the model's final norm is applied
at the last layer (with the statistics of the final stream)."""

from __future__ import annotations

from ..core.value_aware import norm_matrix
from ..explain import value_aware as va


def _matrices(layers, states, anat, mask):
    out = []
    for i, lay in enumerate(layers):
        blk = lay.block
        if not blk.pre_norm:
            norms = [(blk.norm1, lay.n1), (blk.norm2, lay.n2)]
        elif i == len(layers) - 1 and anat.stream_norm is not None and states.final_in is not None:
            norms = [(anat.stream_norm_params(lay.x.dtype), states.final_in.to(lay.x.dtype))]
        else:
            norms = []
        out.append(norm_matrix(lay.alpha, lay.F, lay.x, norms))
    return out


va.register_rolled(
    "globenc",
    _matrices,
    description="GlobEnc: norms of attention+residual vectors through the layer norms (FFN bypassed), rows normalised, "
                "multiplied",
    cost="1 forward (eager attention) + O(L·n²·H²)",
    reference="Modarressi, Fayyaz, Yaghoobzadeh & Pilehvar, GlobEnc: Quantifying Global Token Attribution by "
              "Incorporating the Whole Encoder Layer in Transformers, NAACL 2022",
)
