"""``grad_rollout``: gradient-weighted rollout. Per layer the heads are fused as mean_h((dy/dA ⊙ A)^+) (the
positive part taken per head, before the mean, as Chefer et al.), then rolled out with the residual and
row renormalisation. ``clamp="after_mean"`` gives vit-explain's order, (mean_h(dy/dA ⊙ A))^+.

Gradients are paired with attention by layer index (both come from the record's layer-ordered lists and one
``torch.autograd.grad`` call), never by hook firing order (vit-explain#6)."""

from __future__ import annotations

from .. import _checks
from ..core.gradients import gradient_weighted
from ..core.operators import weighted_probs
from ..core.rollout import rollout as core_rollout
from ..explain import matrix_free
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import prefix_default, rollout_rows, source_rows

_OPTIONS = {
    "clamp": "per_head", "alpha": 0.5, "residual_mode": "renorm", "discard_ratio": 0.0, "discard_scope": "layer",
    "top_k": None, "threshold": None, "protect_prefix": None, "start_layer": 0, "end_layer": None,
    "return_layers": False, "stream": None, "attention": None,
}


@register(
    "grad_rollout",
    description="gradient-weighted rollout: mean_h((dy/dA ⊙ A)^+) per layer, rolled out with residual + row renorm "
                "(class-specific)",
    options=_OPTIONS,
    needs_grad=True,
    class_specific=True,
    cost="1 forward + 1 backward (its own attention kernel); dy/dA = dO·Vᵀ recomputed blockwise",
    reference="Gildenblat, vit-explain (2020); clamp-before-mean as Chefer, Gur & Wolf, CVPR 2021",
    refuse={"head_fusion": "the heads are fused by the gradient weighting (mean of (dy/dA ⊙ A)^+); use "
            "clamp='after_mean' for vit-explain's order, or method='rollout' for other fusions"},
)
def grad_rollout(ctx: Context, *, clamp, stream, return_layers, protect_prefix, attention, **opts):
    """full_row[b] = row position_b of rollout(W), W_l = mean_h((dy/dA_l ⊙ A_l)^+), residual_mode "renorm"
    by default ((W + I) / row sums at alpha = 0.5)."""
    _checks.check_choice("clamp", clamp, ("per_head", "after_mean"))
    if matrix_free.choose(ctx, attention, matrix_free.sparsity_refusal(opts)):
        out = matrix_free.explain_rows(
            ctx, attention, lambda rec: weighted_probs(clamp), grad=True, stream_opt=stream,
            protect_prefix=protect_prefix, alpha=opts["alpha"], residual_mode=opts["residual_mode"],
            start_layer=opts["start_layer"], end_layer=opts["end_layer"], return_layers=return_layers,
        )
        if out is not None:
            return out
    s0 = ctx.options.get("stream")
    rec, atts, grads = ctx.grad_record([s0] if s0 else None, clamp=clamp)
    s = ctx.stream(rec)
    W = gradient_weighted(atts[s], grads[s], clamp)
    pos = ctx.readout(rec, s)
    pp = prefix_default(protect_prefix, ctx.info(rec, s))
    row, layers = rollout_rows(
        core_rollout, W, pos, ctx.mask(rec, s), return_layers=return_layers, head_fusion=None,
        check_stochastic=False, protect_prefix=pp, info=ctx.info(rec, s), **opts,
    )
    src = source_rows(ctx, rec, core_rollout, lambda v: gradient_weighted(atts[v], grads[v], clamp),  # VLMs: vision
                      protect_prefix=protect_prefix, head_fusion=None, check_stochastic=False, **opts)
    return ctx.build(
        rec, row, pos, s, layers=layers, options={**ctx.options, "protect_prefix": pp, "attention": "dense"}, source=src
    )
