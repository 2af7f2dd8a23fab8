"""``flow``: attention flow (Abnar & Zuidema 2020), the max-flow value from the output token to each input
token through the layered attention graph (``attnroll.attention_flow``)."""

from __future__ import annotations

from .._system import attention_flow
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import combine_rows, prefix_default

#: Above this many tokens flow costs minutes per example; explain refuses unless max_tokens is raised.
MAX_TOKENS = 1024


@register(
    "flow",
    description="attention flow: max flow from the output token to each input through the attention graph",
    options={
        "head_fusion": "mean", "alpha": 0.5, "residual_mode": "blend", "discard_ratio": 0.0,
        "discard_scope": "layer", "top_k": None, "threshold": None, "protect_prefix": None, "start_layer": 0,
        "end_layer": None, "normalize": True, "n_jobs": 1, "dtype": None, "stream": None,
        "max_tokens": MAX_TOKENS,
    },
    cost="1 forward + one max-flow problem per input token (seconds to minutes per example)",
    reference="Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020",
    refuse={
        "return_layers": "flow has no per-layer partial products; use method='rollout' with return_layers=True",
        "rows": "explain picks the output row itself; pass position=k (an int or one per example)",
    },
)
def flow(ctx: Context, *, stream, protect_prefix, max_tokens, **opts):
    """full_row[b] = flow values from (top layer, position_b) to every input token (row-normalised by
    default); for a weighted readout the weighted mean of those rows."""
    rec = ctx.record()
    s = ctx.stream(rec)
    info = ctx.info(rec, s)
    if info.merges:
        raise ValueError(
            f"flow: {type(ctx.model).__name__}'s tokens merge between stages (a stage chain), and a max flow "
            "through fixed merge maps is not attention flow's layered graph of one token set; use "
            "method='rollout', which composes the chain"
        )
    if info.nonstochastic:
        raise ValueError(f"flow needs attention probabilities as capacities, but layers {list(info.nonstochastic)[:4]} "
                         f"hold none: {info.stochastic_reason}; use 'grad_rollout' or 'gae'")
    n = rec.streams[s][0].shape[-1]
    if n > max_tokens:
        raise ValueError(
            f"flow on {n} tokens would solve {n} max-flow problems on a graph of {len(rec.streams[s]) * n} nodes "
            f"per example (minutes or more); refused above max_tokens={max_tokens}. Use method='rollout' (same "
            "graph, path products instead of max flows, milliseconds), pass fewer layers (start_layer=), or "
            "raise max_tokens= if you mean it."
        )
    ro = ctx.readout(rec, s)
    pp = prefix_default(protect_prefix, ctx.info(rec, s))
    rows = ro.rows()
    F = attention_flow(rec.streams[s], rows=rows, attention_mask=ctx.mask(rec, s), protect_prefix=pp, **opts)
    # A weighted readout (mean pooling) takes the weighted mean of the per-row flows.
    row, _ = combine_rows(F, ro, rows)
    pos = ro
    return ctx.build(rec, row, pos, s, options={**ctx.options, "protect_prefix": pp})
