"""``alti``: ALTI (Ferrando, Gállego & Costa-jussà, EMNLP 2022). Per layer T_i(x_j) = the share of
z_{i←j} = Σ_h α^h_ij f^h(x_j) + δ_ij x_j in the block's attention output y_i, and
c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised, R = C_L ⋯ C_1 (the residual is inside C).

Post-LN blocks: T_i(x_j) = g(z_{i←j}) through the first norm with its actual statistics and y_i the actual
norm output (β and the b_O share included). Pre-LN blocks: on the residual stream, T_i(x_j) = z_{i←j} and
y_i = x_i + attention_i, the actual stream after the attention sub-block."""

from __future__ import annotations

from ..core.value_aware import alti_matrix, apply_norm
from . import _value_aware as va


def layer_matrix(lay: va.Layer):
    """ALTI's contribution matrix (B, n, n) of one layer, rows not yet normalised (see module)."""
    B, n, d = lay.x.shape
    chunk = va.chunk_rows(B, n, d)
    if lay.block.pre_norm:
        return alti_matrix(lay.alpha, lay.F, lay.x, lay.n2, chunk=chunk)
    y = apply_norm(lay.n1, lay.block.norm1)
    return alti_matrix(lay.alpha, lay.F, lay.x, y, norm=(lay.block.norm1, lay.n1), chunk=chunk)


def _matrices(layers, states, anat, mask):
    return [layer_matrix(lay) for lay in layers]


va.register_rolled(
    "alti",
    _matrices,
    description="ALTI: L1-distance contributions of attention+residual (+norm) shares per layer, rows normalised, multiplied",
    cost="1 forward (eager attention) + O(L·n²·d)",
    reference="Ferrando, Gállego & Costa-jussà, Measuring the Mixing of Contextual Information in the "
              "Transformer, EMNLP 2022",
)
