"""``rollout``: attention rollout (Abnar & Zuidema 2020) of the captured attention, every core option passed
through (see ``attnroll.rollout``)."""

from __future__ import annotations

from .. import _checks
from ..core.operators import fused_probs
from ..core.rollout import rollout as core_rollout
from ..explain import matrix_free
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import ROLLOUT_OPTIONS, ROLLOUT_REFUSE, prefix_default, rollout_rows, source_rows


@register(
    "rollout",
    description="attention rollout: product of residual-augmented, head-fused attention over the layers "
                "(class-agnostic)",
    options={**ROLLOUT_OPTIONS, "stream": None, "attention": None},
    cost="1 forward (its own attention kernel) + O(L·n²) recomputed blockwise, O(n·d) memory",
    reference="Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020",
    refuse=ROLLOUT_REFUSE,
)
def rollout(ctx: Context, *, stream, return_layers, protect_prefix, attention, **opts):
    """full_row[b] = row position_b of R = Ã(end−1)···Ã(start) (``attnroll.rollout``).

    ``attention``: None picks the matrix-free route when it can, "recompute" insists, "dense" captures
    the n×n matrices (eager)."""
    opts["head_fusion"] = _checks.check_head_fusion("head_fusion", opts["head_fusion"], allow_none=False)
    if matrix_free.choose(ctx, attention, matrix_free.sparsity_refusal(opts)):
        how = opts["head_fusion"]
        out = matrix_free.explain_rows(
            ctx, attention, lambda rec: fused_probs(how), grad=False, stream_opt=stream, protect_prefix=protect_prefix,
            alpha=opts["alpha"], residual_mode=opts["residual_mode"], start_layer=opts["start_layer"],
            end_layer=opts["end_layer"], return_layers=return_layers, head_fusion=how, dtype=opts["dtype"],
            fuse_mean=isinstance(how, str) and how == "mean",
        )
        if out is not None:
            return out
    # Fusing the mean inside the capture hook keeps (B, n, n) per layer instead of (B, H, n, n); its rows
    # still sum to 1, so core rollout validates them as usual (max/min fusion would not: fused in core).
    fuse = "mean" if isinstance(opts["head_fusion"], str) and opts["head_fusion"] == "mean" else None
    rec = ctx.record(fuse_heads=fuse)
    s = ctx.stream(rec)
    ro = ctx.readout(rec, s)
    pp = prefix_default(protect_prefix, ctx.info(rec, s))
    if fuse is not None:
        opts = {**opts, "head_fusion": None}
    row, layers = rollout_rows(
        core_rollout, rec.streams[s], ro, ctx.mask(rec, s), return_layers=return_layers, protect_prefix=pp,
        info=ctx.info(rec, s), **opts,
    )
    # VLMs: the vision stream's own rows
    src = source_rows(ctx, rec, core_rollout, rec.stream, protect_prefix=protect_prefix, **opts)
    return ctx.build(
        rec, row, ro, s, layers=layers, options={**ctx.options, "protect_prefix": pp, "attention": "dense"}, source=src
    )
