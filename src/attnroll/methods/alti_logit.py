"""``alti_logit``: ALTI-Logit (Ferrando, Gállego, Tsiamas & Costa-jussà, ACL 2023) for pre-norm transformers.
Each layer's attention update of the readout row is split over the tokens it reads and projected on the
target logit (the final norm's divisor frozen at its actual value): Δ^l_j = ω · Σ_h α^h_rj f^h(x̃^l_j); each
layer-l token is then carried to the input tokens by ALTI's rolled-out mixing of the layers below,
score_k = Σ_l Σ_j Δ^l_j (C_{l−1} ⋯ C_0)_jk (see :mod:`attnroll.core.logit_rollout`). Signed and
class-specific; the scores add up to the attention updates' direct share of the logit (the embeddings, the
MLPs and every bias are not attributed). Post-LN blocks (BERT) have no residual stream that reaches the head,
and pooling heads no single readout row; both are refused with the reason."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.logit_rollout import direct_logit, head_direction, logit_rollout
from ..core.value_aware import alti_matrix, normalize_rows
from . import _value_aware as va
from .base import Context, register


def _check_layout(ctx: Context, anat, head: dict) -> None:
    """Refuse what the decomposition does not model: post-LN blocks, pooling heads, a pooler."""
    name = type(ctx.model).__name__
    if not all(layer.block(torch.float32).pre_norm for layer in anat.layers):
        raise _checks.UnsupportedModelError(
            f"method 'alti_logit': {name} has post-LN blocks (the norm sits on the residual stream), so the "
            "attention updates do not add up to the vector the head reads; use 'alti' or 'decompx'")
    if anat.pooled or head["pooler"] is not None:
        raise _checks.UnsupportedModelError(
            f"method 'alti_logit': {name}'s head pools rows or has a pooler, not one readout row read through "
            "the final norm; use 'decompx'")


@register(
    "alti_logit",
    description="ALTI-Logit: each layer's attention update projected on the target logit, per token, carried to the inputs by ALTI's rollout of the layers below (class-specific, pre-norm models)",
    options={**va.COMMON},
    class_specific=True,
    cost="1 forward (eager attention) + O(L·n²·d)",
    reference="Ferrando, Gállego, Tsiamas & Costa-jussà, Explaining How Transformers Use Context to Build "
              "Predictions, ACL 2023 (ALTI-Logit); ALTI as Ferrando, Gállego & Costa-jussà, EMNLP 2022",
    refuse={**va.REFUSE, "start_layer": "alti_logit sums every layer's logit update; there is no layer range"},
)
def alti_logit(ctx: Context, *, dtype):
    """full_row[b, k] = Σ_l Σ_j Δ^l_j (C_{l−1} ⋯ C_0)_jk for the target logit; ``extra["direct_logit"]``
    (B,) = Σ_l Σ_j Δ^l_j, the attention updates' share of that logit."""
    rec, states, anat = va.record(ctx)
    dt = va.working_dtype(dtype, states.inputs[0])
    head = anat.head(dt)
    _check_layout(ctx, anat, head)
    pos = torch.tensor(ctx.positions(rec, "self"), device=states.inputs[0].device)
    reads = "projects on one logit of the model's head (a classifier row)"
    classes = va.logit_classes(ctx, rec, "alti_logit", reads).to(pos.device)
    mask = ctx.mask(rec, "self")
    ar = torch.arange(pos.shape[0], device=pos.device)
    with torch.no_grad():
        omega = head_direction(head["classifier"][0][classes], head["final_norm"], states.outputs[-1].to(dt)[ar, pos])
        deltas, mixing = [], []
        layers = va.layers(rec, states, anat, dt)
        for i, lay in enumerate(layers):
            B, n, d = lay.x.shape
            deltas.append(direct_logit(lay.alpha[ar, :, pos], lay.F, omega))
            if i < len(layers) - 1:  # the top layer's mixing is never read (its updates reach the head directly)
                C = alti_matrix(lay.alpha, lay.F, lay.x, lay.n2, chunk=va.chunk_rows(B, n, d))
                mixing.append(normalize_rows(C, mask))
        mixing.append(None)
        if mask is not None:
            deltas = [dl * mask.to(dt) for dl in deltas]
        row = logit_rollout(deltas, mixing)
    total = torch.stack(deltas).sum((0, 2)).detach().float().cpu()
    return ctx.build(rec, row, pos.tolist(), "self", extra={"direct_logit": total})
