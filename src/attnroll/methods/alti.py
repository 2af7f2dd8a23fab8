"""``alti``: ALTI (Ferrando, Gállego & Costa-jussà, EMNLP 2022). Per layer T_i(x_j) = the share of
z_{i←j} = Σ_h α^h_ij f^h(x_j) + δ_ij x_j in the block's attention output y_i, and
c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised, R = C_L ⋯ C_1 (the residual is inside C).

Post-LN blocks: T_i(x_j) = g(z_{i←j}) through the first norm with its actual statistics and y_i the actual
norm output (β and the b_O share included). Pre-LN blocks: on the residual stream, T_i(x_j) = z_{i←j} and
y_i = x_i + attention_i, the actual stream after the attention sub-block."""

from __future__ import annotations

from ..explain import value_aware as va


def _matrices(layers, states, anat, mask):
    return [va.alti_layer_matrix(lay) for lay in layers]


va.register_rolled(
    "alti",
    _matrices,
    description="ALTI: L1-distance contributions of attention+residual (+norm) shares per layer, rows normalised, "
                "multiplied",
    cost="1 forward (eager attention) + O(L·n²·d)",
    reference="Ferrando, Gállego & Costa-jussà, Measuring the Mixing of Contextual Information in the "
              "Transformer, EMNLP 2022",
)
