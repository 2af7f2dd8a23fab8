"""``per_head_rollout``: rollout taken separately for each head (head h chained with head h), then averaged
over heads for ``scores``; each head's row is kept in ``extra["heads"]`` (B, H, n)."""

from __future__ import annotations

from ..core.rollout import per_head_rollout as core_per_head
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import ROLLOUT_OPTIONS, ROLLOUT_REFUSE, prefix_default, rollout_rows


@register(
    "per_head_rollout",
    description="per-head rollout: one rollout chain per head, averaged over heads (heads kept in extra['heads'])",
    options={**{k: v for k, v in ROLLOUT_OPTIONS.items() if k != "head_fusion"}, "stream": None},
    cost="1 forward (eager attention) + O(H·L·n²)",
    reference="Abnar & Zuidema 2020, appendix A.1; head-mean at the end as in TAM (Yuan et al. 2021)",
    refuse={**ROLLOUT_REFUSE, "head_fusion": "per-head rollout fuses nothing until the end (mean over heads); "
            "use method='rollout' to fuse heads per layer"},
)
def per_head_rollout(ctx: Context, *, stream, return_layers, protect_prefix, **opts):
    """full_row[b] = mean_h of row position_b of R_h = Ã_h(end−1)···Ã_h(start)."""
    rec = ctx.record()
    s = ctx.stream(rec)
    pos = ctx.readout(rec, s)
    pp = prefix_default(protect_prefix, ctx.info(rec, s))
    heads, layers = rollout_rows(
        core_per_head, rec.streams[s], pos, ctx.mask(rec, s), return_layers=return_layers, protect_prefix=pp,
        info=ctx.info(rec, s), **opts,
    )
    extra = {"heads": heads.detach().float().cpu()}
    return ctx.build(
        rec, heads.mean(dim=-2), pos, s, layers=None if layers is None else layers.mean(dim=-2), extra=extra,
        options={**ctx.options, "protect_prefix": pp},
    )
