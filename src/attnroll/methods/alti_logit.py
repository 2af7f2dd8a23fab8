"""``alti_logit``: ALTI-Logit (Ferrando, Gállego, Tsiamas & Costa-jussà, ACL 2023). Each layer's attention
update of the readout row is split over the tokens it reads and projected on the target logit:
Δ^l_j = ω^l · Σ_h α^h_rj f^h(x̃^l_j); each layer-l token is then carried to the input tokens by ALTI's
rolled-out mixing of the layers below, score_k = Σ_l Σ_j Δ^l_j (C_{l−1} ⋯ C_0)_jk (see
:mod:`attnroll.core.logit_rollout`). Signed and class-specific.

* Pre-norm stacks (ViT, GPT-2, Llama): the updates reach the head on the residual stream, ω^l = ω the
  classifier row through the final norm (divisor frozen). The embeddings, the MLPs and every bias are not
  attributed (the paper's direct logit updates, ``mlp="update"``, the default there); their terms are
  reported in ``extra`` and, with the updates, add up to the target logit. ``mlp="linearised"`` carries each
  update through the MLP branches above it too (our variant, as below).
* Post-LN stacks (BERT family, DistilBERT): every update passes each LN2(h + MLP(h)) above it. With the norms'
  divisors frozen and the MLP linearised per element (``mlp="linearised"``, the default there: θ = act(ζ)/ζ,
  DecompX's rule) or kept as an unattributed update of its own (``mlp="update"``), each block is affine in the
  stream, so every layer has its own direction ω^l, and the pooler (tanh, or DistilBERT's ReLU, linearised the
  same way) and classifier give ω^L. The per-layer updates, the embedding's share ω^0 · x^0_r, the bias terms
  and (``"update"``) the MLP terms add up to the target logit exactly (``extra``).

Heads that pool rows (DINOv2, timm ``avg``) have no single readout row and are refused, as are a pooler on a
pre-norm stack and a stack mixing both layouts."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.logit_rollout import MLP_RULES, direct_logit, head_linear, layer_directions, logit_rollout
from ..core.value_aware import normalize_rows
from . import _value_aware as va
from .base import Context, register


def _rule(ctx: Context, anat, head: dict, mlp) -> str:
    """The MLP rule: ``mlp``, else "update" on pre-norm stacks (the paper's direct updates) and
    "linearised" on post-LN ones, after refusing what the decomposition does not model: a stack mixing pre-
    and post-norm blocks, heads pooling rows, a pooler on a pre-norm stack."""
    name = type(ctx.model).__name__
    rule = None if mlp is None else _checks.check_choice("mlp", mlp, MLP_RULES)
    pre = {layer.pre_norm for layer in anat.layers}
    if len(pre) > 1:
        raise _checks.UnsupportedModelError(
            f"method 'alti_logit': {name} mixes pre-norm and post-LN blocks; the decomposition models one layout "
            "per stack; use 'alti' or 'decompx'")
    if anat.pooled:
        raise _checks.UnsupportedModelError(
            f"method 'alti_logit': {name}'s head pools rows ({anat.pool}), not one readout row; use 'decompx'")
    if pre == {True}:
        if head["pooler"] is not None:
            raise _checks.UnsupportedModelError(
                f"method 'alti_logit': {name} is pre-norm with a pooler between the final norm and the "
                "classifier, which the pre-norm decomposition does not model; use 'decompx'")
        return rule or "update"
    return rule or "linearised"


@register(
    "alti_logit",
    description="ALTI-Logit: each layer's attention update projected on the target logit, per token, carried to the inputs by ALTI's rollout of the layers below (class-specific; pre-norm and post-LN models)",
    options={"mlp": None, **va.COMMON},
    class_specific=True,
    cost="1 forward (eager attention) + O(L·n²·d)",
    reference="Ferrando, Gállego, Tsiamas & Costa-jussà, Explaining How Transformers Use Context to Build "
              "Predictions, ACL 2023 (ALTI-Logit); ALTI as Ferrando, Gállego & Costa-jussà, EMNLP 2022",
    refuse={**va.REFUSE, "start_layer": "alti_logit sums every layer's logit update; there is no layer range"},
)
def alti_logit(ctx: Context, *, mlp, dtype):
    """full_row[b, k] = Σ_l Σ_j Δ^l_j (C_{l−1} ⋯ C_0)_jk for the target logit. ``extra``: ``direct_logit``
    (B,) = Σ_l Σ_j Δ^l_j and ``layer_logit`` (B, L) its per-layer parts, ``embedding_logit`` ω^0 · x^0_r,
    ``bias_logit`` (every bias and β outside the value vectors, and the head's constant) and ``mlp_logit``
    (the MLP updates; 0 with mlp="linearised"): the four add up to the target logit."""
    rec, states, anat = va.record(ctx)
    dt = va.working_dtype(dtype, states.inputs[0])
    head = anat.head(dt)
    rule = _rule(ctx, anat, head, mlp)
    pos = torch.tensor(ctx.positions(rec, "self"), device=states.inputs[0].device)
    va.check_head_readout(ctx, rec, pos.tolist(), "alti_logit")
    reads = "projects on one logit of the model's head (a classifier row)"
    classes = va.logit_classes(ctx, rec, "alti_logit", reads).to(pos.device)
    mask = ctx.mask(rec, "self")
    ar = torch.arange(pos.shape[0], device=pos.device)
    extra = {}
    with torch.no_grad():
        layers = va.layers(rec, states, anat, dt)
        W, b = head["classifier"]
        top = states.outputs[-1].to(dt)[ar, pos]  # the vector the head reads
        omega, const = head_linear(W[classes], None if b is None else b[classes], final_norm=head["final_norm"],
                                   pooler=head["pooler"], actual=top)
        omegas, bias, mlp_terms = layer_directions(
            omega, [lay.block for lay in layers], [lay.n1[ar, pos] for lay in layers],
            [lay.n2[ar, pos] for lay in layers], mlp=rule)
        extra["embedding_logit"] = (omegas[0] * layers[0].x[ar, pos]).sum(-1)
        extra["bias_logit"] = bias.sum(-1) + const
        extra["mlp_logit"] = mlp_terms.sum(-1)
        deltas, mixing = [], []
        for i, lay in enumerate(layers):
            deltas.append(direct_logit(lay.alpha[ar, :, pos], lay.F, omegas[i]))
            if i < len(layers) - 1:  # the top layer's mixing is never read (its updates reach the head directly)
                mixing.append(normalize_rows(va.alti_layer_matrix(lay), mask))
        mixing.append(None)
        if mask is not None:
            deltas = [dl * mask.to(dt) for dl in deltas]
        row = logit_rollout(deltas, mixing)
    per_layer = torch.stack([dl.sum(-1) for dl in deltas], dim=1)
    extra.update(direct_logit=per_layer.sum(-1), layer_logit=per_layer)
    extra = {k: v.detach().cpu() for k, v in extra.items()}
    return ctx.build(rec, row, pos.tolist(), "self", extra=extra, options={**ctx.options, "mlp": rule})
