"""``gae``: generic attention explainability (Chefer, Gur & Wolf, ICCV 2021) for self-attention models.

R = I; for each layer R ← R + Ā·R with Ā = mean_h((dy/dA ⊙ A)^+); the output is row ``position`` of R.
No row normalisation: R = (I + Ā_L)···(I + Ā_1), which is rollout with residual_mode="add" at alpha = ½ on
the gradient-weighted matrices, computed here right to left for the one row (O(L·n²))."""

from __future__ import annotations

from ..core.gradients import gradient_weighted
from ..core.operators import weighted_probs
from ..core.rollout import rollout as core_rollout
from ..explain import matrix_free
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import rollout_rows, source_rows


@register(
    "gae",
    description="generic attention explainability (Chefer ICCV'21): R = I; R += mean_h((dy/dA ⊙ A)^+)·R per layer "
    "(class-specific)",
    options={"start_layer": 0, "end_layer": None, "return_layers": False, "stream": None, "attention": None},
    needs_grad=True,
    class_specific=True,
    cost="1 forward + 1 backward (its own attention kernel); dy/dA = dO·Vᵀ recomputed blockwise",
    reference="Chefer, Gur & Wolf, Generic Attention-model Explainability for Interpreting Bi-Modal and "
    "Encoder-Decoder Transformers, ICCV 2021",
    refuse={
        "head_fusion": "gae fuses heads as mean_h((dy/dA ⊙ A)^+) by definition; use method='grad_rollout' for clamp "
        "orders",
        "alpha": "gae's residual is the plain I + Ā of Chefer's rule; use method='grad_rollout' for a weighted "
        "residual",
        "residual_mode": "gae's update is R + Ā·R (no renormalisation); use method='grad_rollout' for 'renorm'/'blend'",
        "discard_ratio": "gae does not sparsify; use method='grad_rollout' or 'rollout'",
    },
)
def gae(ctx: Context, *, start_layer, end_layer, return_layers, stream, attention):
    """full_row[b] = row position_b of (I + Ā_end−1)···(I + Ā_start)."""
    if matrix_free.choose(ctx, attention, None):
        out = matrix_free.explain_rows(
            ctx, attention, lambda rec: weighted_probs("per_head"), grad=True, stream_opt=stream, alpha=0.5,
            residual_mode="add", start_layer=start_layer, end_layer=end_layer, return_layers=return_layers,
        )
        if out is not None:
            return out
    s0 = ctx.options.get("stream")
    rec, atts, grads = ctx.grad_record([s0] if s0 else None)
    s = ctx.stream(rec)
    W = gradient_weighted(atts[s], grads[s], "per_head")
    pos = ctx.readout(rec, s)
    row, layers = rollout_rows(
        core_rollout, W, pos, ctx.mask(rec, s), return_layers=return_layers, head_fusion=None,
        residual_mode="add", alpha=0.5, check_stochastic=False, start_layer=start_layer, end_layer=end_layer,
        info=ctx.info(rec, s),
    )
    src = source_rows(ctx, rec, core_rollout, lambda v: gradient_weighted(atts[v], grads[v], "per_head"),  # VLMs
                      head_fusion=None, residual_mode="add", alpha=0.5, check_stochastic=False)
    return ctx.build(rec, row, pos, s, layers=layers, options={**ctx.options, "attention": "dense"}, source=src)
