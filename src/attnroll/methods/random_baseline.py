"""``random``: a control. Uniform random scores in [0, 1) over the real tokens (a sanity baseline for
faithfulness metrics: any method should beat it)."""

from __future__ import annotations

import torch

from .. import _checks
from ..explain.context import Context
from ..explain.registry import register


@register(
    "random",
    description="control: uniform random scores over the input units (seeded)",
    options={"seed": 0, "stream": None},
    cost="1 forward (for the token metadata)",
    reference="control baseline (e.g. Hooker et al., ROAR, 2019)",
    reads_layers=False,
)
def random(ctx: Context, *, seed, stream):
    """full_row[b] ~ U[0, 1) from a generator seeded with seed + b (so example b's map does not depend on
    the batch size, but does depend on its index in the batch)."""
    seed = _checks.check_int("seed", seed)
    rec = ctx.record(fuse_heads="mean")
    s = ctx.stream(rec)
    B, n = rec.streams[s][0].shape[0], rec.streams[s][0].shape[-1]
    rows = [torch.rand(n, generator=torch.Generator().manual_seed(seed + b)) for b in range(B)]
    return ctx.build(rec, torch.stack(rows), None, s)
