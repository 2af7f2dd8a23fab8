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

* Heads that pool rows on pre-norm stacks (DINOv2's [CLS ; mean of the patch rows], timm ``global_pool='avg'``
  with or without ``fc_norm``, timm's CLS row through ``fc_norm``; the layer anatomy's ``pool``): with every
  norm's divisor frozen (each row's own, and the pooled vector's) the head is linear in the top stream,
  y = Σ_r ω_r · x^L_r + c, so every read row r has its own direction ω_r (its pooling weight times its part
  of the pooled direction, through its own norm), is carried down as a readout row of its own, and the
  updates add up over the read rows: Δ^l_j = Σ_r ω^l_r · Σ_h α^h_rj f^h(x̃^l_j). The ``extra`` terms sum over
  the read rows the same way and still add up to the target logit.

Refused, with the reason: a pooled head on a post-LN stack (no such model is described by the anatomy) or
on padded inputs (the pool weights are fixed), a pooler on a pre-norm stack, a stack mixing both layouts."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.logit_rollout import direct_logit, head_linear, layer_directions, logit_rollout, pooled_head_linear
from ..core.value_aware import normalize_rows, with_rows
from ..explain import value_aware as va
from ..explain.context import Context
from ..explain.registry import register


def _rule(ctx: Context, anat, head: dict, mlp) -> str:
    """The MLP rule: ``mlp``, else "update" on pre-norm stacks (the paper's direct updates) and
    "linearised" on post-LN ones, after refusing what the decomposition does not model: a stack mixing pre-
    and post-norm blocks, a pooler on a pre-norm stack, a head pooling rows on a post-LN stack."""
    name = type(ctx.model).__name__
    rule = mlp  # checked with the options (explain/options)
    pre = {layer.pre_norm for layer in anat.layers}
    if len(pre) > 1:
        raise _checks.UnsupportedModelError(
            f"method 'alti_logit': {name} mixes pre-norm and post-LN blocks; the decomposition models one layout "
            "per stack; use 'alti' or 'decompx'")
    if pre == {True}:
        if head["pooler"] is not None:
            raise _checks.UnsupportedModelError(
                f"method 'alti_logit': {name} is pre-norm with a pooler between the final norm and the "
                "classifier, which the pre-norm decomposition does not model; use 'decompx'")
        return rule or "update"
    if anat.pooled:  # no post-LN model the anatomy knows pools rows: nothing to test the derivation on
        raise _checks.UnsupportedModelError(
            f"method 'alti_logit': {name} is post-LN and its head pools rows ({anat.pool}); alti_logit reads "
            "pooled heads on pre-norm stacks only (DINOv2, timm global_pool='avg'); use 'decompx'")
    return rule or "linearised"


def _read_rows(ctx: Context, anat, rec, states, pos: torch.Tensor, mask, dt) -> tuple[torch.Tensor, list | None]:
    """(rows (B, R) the head reads per example, the pooling parts' row weights (G × (B, n)) or None): the
    readout row (R = 1), or for a pooled head every row some part weighs (the same for every example)."""
    if not anat.pooled:
        return pos.unsqueeze(1), None
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            f"inputs: {type(ctx.model).__name__}'s head pools rows ({anat.pool}) with fixed row weights, which "
            "would average padded rows; alti_logit explains a pooled head on unpadded inputs only")
    pools = anat.pool_weights(states.inputs[0].shape[1], pos, dt)
    read = torch.stack(pools).ne(0).any(0).any(0).nonzero().flatten()
    return read.expand(pos.shape[0], -1), pools


@register(
    "alti_logit",
    description="ALTI-Logit: each layer's attention update projected on the target logit, per token, carried to the "
        "inputs by ALTI's rollout of the layers below (class-specific; pre-norm and post-LN models, heads that pool "
        "rows)",
    options={"mlp": None, **va.COMMON},
    class_specific=True,
    cost="1 forward (eager attention) + O(L·n²·d) (a pooled head: + the MLPs once per read row)",
    reference="Ferrando, Gállego, Tsiamas & Costa-jussà, Explaining How Transformers Use Context to Build "
              "Predictions, ACL 2023 (ALTI-Logit); ALTI as Ferrando, Gállego & Costa-jussà, EMNLP 2022",
    refuse={**va.REFUSE, "start_layer": "alti_logit sums every layer's logit update; there is no layer range"},
)
def alti_logit(ctx: Context, *, mlp, dtype):
    """full_row[b, k] = Σ_l Σ_j Δ^l_j (C_{l−1} ⋯ C_0)_jk for the target logit, Δ^l_j summed over the rows the
    head reads. ``extra``: ``direct_logit`` (B,) = Σ_l Σ_j Δ^l_j and ``layer_logit`` (B, L) its per-layer
    parts, ``embedding_logit`` Σ_r ω^0_r · x^0_r, ``bias_logit`` (every bias and β outside the value vectors,
    and the head's constant) and ``mlp_logit`` (the MLP updates; 0 with mlp="linearised"): the four add up to
    the target logit."""
    rec, states, anat = va.record(ctx)
    dt = va.working_dtype(dtype, states.inputs[0])
    head = anat.head(dt)
    rule = _rule(ctx, anat, head, mlp)
    pos = torch.tensor(ctx.positions(rec, "self"), device=states.inputs[0].device)
    va.check_head_readout(ctx, rec, pos.tolist(), "alti_logit")
    reads = "projects on one logit of the model's head (a classifier row)"
    classes = va.logit_classes(ctx, rec, "alti_logit", reads).to(pos.device)
    mask = ctx.mask(rec, "self")
    rows, pools = _read_rows(ctx, anat, rec, states, pos, mask, dt)
    B, R = rows.shape
    ar = torch.arange(B, device=pos.device).unsqueeze(1)
    extra = {}
    with torch.no_grad():
        layers = va.layers(rec, states, anat, dt)
        W, b = head["classifier"]
        top = states.outputs[-1].to(dt)  # the top stream, before any final norm
        args = dict(final_norm=head["final_norm"], pooler=head["pooler"])
        if pools is None:
            omega, const = head_linear(W[classes], None if b is None else b[classes], actual=top[ar[:, 0], pos],
                                       **args)
            omega = omega.unsqueeze(1)
        else:
            omega, const = pooled_head_linear(W[classes], None if b is None else b[classes], pools=pools,
                                              token_norm=anat.token_norm_params(dt), actual=top, **args)
            omega = omega[ar, rows]

        def flat(t):  # (B, n, d) -> the read rows, one per line (B·R, d), for layer_directions
            return t[ar, rows].reshape(B * R, -1)

        omegas, bias, mlp_terms = layer_directions(
            omega.reshape(B * R, -1), [with_rows(lay.block, flat) for lay in layers], [flat(lay.n1) for lay in layers],
            [flat(lay.n2) for lay in layers], mlp=rule)
        omegas = [o.reshape(B, R, -1) for o in omegas]
        extra["embedding_logit"] = (omegas[0] * layers[0].x[ar, rows]).sum((-2, -1))
        extra["bias_logit"] = bias.reshape(B, R, -1).sum((1, 2)) + const
        extra["mlp_logit"] = mlp_terms.reshape(B, R, -1).sum((1, 2))
        deltas, mixing = [], []
        for i, lay in enumerate(layers):
            alpha = lay.alpha[ar, :, rows].permute(0, 2, 1, 3)  # (B, H, R, n): the read rows' attention
            deltas.append(direct_logit(alpha, lay.F, omegas[i]))
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
