"""``clip``: image and text maps for image-text pairs of a CLIP model, with the pair's similarity as target.

Pairs: with P images and T texts, P == T pairs image i with text i; P == 1 explains one image against every
text in one call (the image is repeated, one pair per text). Each pair is one batch row, so the gradient of
the sum of the pairs' similarities gives every pair its own gradients. Per tower, Chefer, Gur & Wolf
(ICCV 2021) as in ``gae``: R = I; R += mean_h((dy/dA ⊙ A)^+)·R over layers [start_layer, end); the image map
is the CLS row over patches, the text map the EOT row (the token CLIP pools) over all text tokens.
Their CLIP notebook uses the last layer only: ``start_layer=-1, start_layer_text=-1``.

``scores`` (P', h·w) image map; ``extra["text_scores"]`` (P', n_text); ``tokens`` the text tokens."""

from __future__ import annotations

import torch

from ..capture import model_facts
from ..core.gradients import gradient_weighted
from ..core.rollout import rollout as core_rollout
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import combine_rows
from ..explain.target_scores import require_grad_mode, resolve_target


def _pairs(inputs, facts):
    """One batch row per image-text pair; the towers' input keys come from the adapter (``stream_inputs``)."""
    px_key, ids_key = facts.stream_inputs.get("vision"), facts.stream_inputs.get("text")
    if px_key is None or ids_key is None:
        raise ValueError(f"method 'clip' needs a dual-tower image-text model; this one ({facts.family}) is not one")
    if not (isinstance(inputs, dict) or hasattr(inputs, "keys")) or px_key not in inputs or ids_key not in inputs:
        raise ValueError(f"method 'clip' needs inputs with {px_key} and {ids_key} (what the model's processor returns)")
    px, ids = inputs[px_key], inputs[ids_key]
    P, T = px.shape[0], ids.shape[0]
    if P == T:
        return dict(inputs)
    if P == 1:
        return {**inputs, px_key: px.expand(T, *px.shape[1:])}
    raise ValueError(
        f"method 'clip' pairs image i with text i, or one image with every text: got {P} images and {T} texts"
    )


@register(
    "clip",
    description="CLIP image and text maps for image-text pairs, target = the pair's similarity (Chefer ICCV'21 rule "
                "per tower)",
    options={"start_layer": 0, "start_layer_text": 0},
    needs_grad=True,
    class_specific=True,
    cost="1 forward + 1 backward of both towers (eager attention)",
    reference="Chefer, Gur & Wolf, ICCV 2021 (CLIP notebook); Radford et al., CLIP, 2021",
)
def clip(ctx: Context, *, start_layer, start_layer_text):
    """Image map: CLS row of Π(I + Ā_vision); text map: EOT row of Π(I + Ā_text); Ā = mean_h((dy/dA ⊙ A)^+),
    y = logits_per_image[i, i] of pair i (or ``target(outputs)``)."""
    require_grad_mode("clip")
    if ctx.target is not None and not callable(ctx.target):
        raise ValueError(
            "method 'clip' explains each pair's similarity: target must be None (the similarity "
            "logits_per_image[i, i]) or a callable f(outputs) -> (pairs,); class indices make no sense here"
        )
    facts = model_facts(ctx.model)
    ctx.inputs = _pairs(ctx.inputs, facts)

    def sim(rec):
        if callable(ctx.target):
            y, ctx.target_desc = resolve_target(rec.outputs, ctx.target)
            return y
        similarity = facts.similarity
        if similarity is None:
            raise ValueError(
                f"method 'clip' needs a dual-tower image-text model; {type(ctx.model).__name__} is not one"
            )
        ctx.target_desc = "pair similarity (logits_per_image[i, i])"
        return similarity(rec.outputs).diagonal()

    rec, atts, grads = ctx.grad_record(["vision", "text"], scores=sim)
    B = atts["vision"][0].shape[0]
    Wv = gradient_weighted(atts["vision"], grads["vision"])
    Wt = gradient_weighted(atts["text"], grads["text"])
    common = dict(head_fusion=None, residual_mode="add", alpha=0.5, check_stochastic=False)
    ro_v, ro_t = ctx.readout(rec, "vision"), ctx.info(rec, "text").readout
    img = combine_rows(core_rollout(Wv, rows=ro_v.rows(), start_layer=start_layer, **common), ro_v, ro_v.rows())[0]
    eot = ro_t.positions()  # the end-of-text token the text tower pools (the adapter's readout)
    tmask = ctx.mask(rec, "text")
    R = core_rollout(Wt, start_layer=start_layer_text, attention_mask=tmask, **common)
    txt = R[torch.arange(B), torch.tensor(eot)].detach().float().cpu()
    if tmask is not None:
        txt = txt * tmask.cpu()
    e = ctx.build(rec, img, ro_v, "vision", extra={"text_scores": txt, "text_positions": eot})
    e.tokens = rec.tokens
    return e
