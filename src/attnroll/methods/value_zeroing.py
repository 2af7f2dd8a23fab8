"""``value_zeroing``: Value Zeroing (Mohebbi, Zuidema, Chrupała & Alishahi, EACL 2023). Per layer and token
j, the block is re-run on its actual input with v_j = 0 (after its bias) in every head; C_ij = the cosine
distance between the new and the actual block output at i; rows normalised; R = C_L ⋯ C_1 (no identity).

Zeroing v_j does not change the attention probabilities, so the attention output loses exactly
Σ_h α^h_ij f^h(x_j); the rest of the block (residual, norms, MLP) runs through the model's own modules, all
zeroed tokens of a chunk in one batch."""

from __future__ import annotations

from ..core.value_aware import mlp_width, value_zeroing_matrix
from ..explain import value_aware as va


def _matrices(layers, states, anat, mask):
    out = []
    for lay, part in zip(layers, anat.layers):
        B, n, d = lay.x.shape
        mdt = states.inputs[part.index].dtype

        def finish(x, attn, part=part, dt=lay.x.dtype, mdt=mdt):
            return part.finish(x.to(mdt), attn.to(mdt)).to(dt)

        width = max(d, mlp_width(lay.block.mlp))
        chunk = va.chunk_rows(B, n, width)
        out.append(value_zeroing_matrix(lay.alpha, lay.F, lay.x, lay.attn, lay.out, finish, chunk=chunk))
    return out


va.register_rolled(
    "value_zeroing",
    _matrices,
    description="value zeroing: cosine distance of each block output when a token's values are zeroed, rows "
                "normalised, multiplied",
    cost="1 forward + n re-runs of every block's residual/norm/MLP (batched)",
    reference="Mohebbi, Zuidema, Chrupała & Alishahi, Quantifying Context Mixing in Transformers, EACL 2023",
)
