"""``rollout``: attention rollout (Abnar & Zuidema 2020) of the captured attention, every core option passed
through (see ``attnroll.rollout``)."""

from __future__ import annotations

from ..core.rollout import rollout as core_rollout
from .base import Context, register, rollout_rows

#: The options of ``attnroll.rollout`` that explain passes through (rows / attention_mask are set by explain).
ROLLOUT_OPTIONS = {
    "head_fusion": "mean",
    "alpha": 0.5,
    "residual_mode": "blend",
    "discard_ratio": 0.0,
    "discard_scope": "layer",
    "top_k": None,
    "threshold": None,
    "protect_prefix": None,
    "start_layer": 0,
    "end_layer": None,
    "return_layers": False,
    "dtype": None,
}
_REFUSE = {
    "rows": "explain picks the output row itself; pass position=k (an int or one per example)",
    "attention_mask": "explain takes the padding mask from the inputs",
    "check_stochastic": "captured attention is always softmax probabilities",
}


def prefix_default(protect_prefix, info) -> int:
    """protect_prefix=None: the stream's prefix tokens (CLS, distillation, registers), at least 1.

    ``info``: the stream's StreamInfo (or, as before, a record: its main-stream prefix)."""
    return max(1, info.prefix or 0) if protect_prefix is None else protect_prefix


@register(
    "rollout",
    description="attention rollout: product of residual-augmented, head-fused attention over the layers (class-agnostic)",
    options={**ROLLOUT_OPTIONS, "stream": None},
    cost="1 forward (eager attention) + O(L·n²)",
    reference="Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020",
    refuse=_REFUSE,
)
def rollout(ctx: Context, *, stream, return_layers, protect_prefix, **opts):
    """full_row[b] = row position_b of R = Ã(end−1)···Ã(start) (``attnroll.rollout``)."""
    # Fusing the mean inside the capture hook keeps (B, n, n) per layer instead of (B, H, n, n); its rows
    # still sum to 1, so core rollout validates them as usual (max/min fusion would not: fused in core).
    fuse = "mean" if opts["head_fusion"] == "mean" else None
    rec = ctx.record(fuse_heads=fuse)
    s = ctx.stream(rec)
    ro = ctx.readout(rec, s)
    pp = prefix_default(protect_prefix, ctx.info(rec, s))
    if fuse is not None:
        opts = {**opts, "head_fusion": None}
    row, layers = rollout_rows(
        core_rollout, rec.streams[s], ro, ctx.mask(rec, s), return_layers=return_layers, protect_prefix=pp, **opts
    )
    return ctx.build(rec, row, ro, s, layers=layers, options={**ctx.options, "protect_prefix": pp})
