"""Encoder-decoder models (T5, BART, Marian): explain one target token over the source tokens and the earlier
target tokens, composing encoder self-attention, decoder self-attention and cross-attention.

Two registered methods:

``encdec_rollout`` (no gradients, class-agnostic): a rollout that conserves mass. With Ā the head-mean
attention and α the residual share (½):
    R_ee = Π_l ((1−α)Ā_e + αI)                       (encoder self-attention, as ``attnroll.rollout``)
    R_dd = I, R_de = 0
    per decoder layer:  [R_dd | R_de] ← ((1−α)Ā_d + αI)·[R_dd | R_de]          (decoder self-attention)
                        [R_dd | R_de] ← α·[R_dd | R_de] + (1−α)·[0 | Ā_c·R_ee]   (cross-attention + residual)
Every real row of [R_dd | R_de] sums to 1: the target token's representation is shared between earlier
target tokens (R_dd) and source tokens (R_de).

``encdec_gae`` (gradients, class-specific): Chefer, Gur & Wolf (ICCV 2021) rules with Ā = mean_h((dy/dA ⊙ A)^+):
    R_ee = I; R_ee += Ā_e·R_ee per encoder layer                              (rule 6)
    R_dd = I, R_de = 0; per decoder layer: R_dd += Ā_d·R_dd, R_de += Ā_d·R_de  (rules 6, 7)
                                            R_de += R̄_ddᵀ·Ā_c·R̄_ee             (rule 10)
with R̄ = (R − I) row-normalised, + I (their ``handle_residual``). Rule 11 (R_dd += Ā_c·R_ed) vanishes:
the encoder never attends to the decoder, so R_ed = 0. ``transpose=False`` uses R̄_dd instead of R̄_ddᵀ
(paths through earlier target tokens, the rollout reading; the transpose is the paper's rule).

The maths is in :mod:`attnroll.core.encdec`; this file wires the record to it.

Output: ``scores`` = R_de[t] over source tokens (B, n_src); ``extra["target_scores"]`` = R_dd[t] over target
tokens (B, n_tgt); t = the explained decoder position (default: the last real one; ``position=``)."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.encdec import encdec_gae_compose, encdec_rollout_compose
from ..core.gradients import gradient_weighted
from ..core.rollout import rollout as core_rollout
from ..explain.context import Context
from ..explain.registry import register
from ..explain.rows import combine_rows


def _streams(ctx: Context, rec) -> None:
    missing = {"encoder", "decoder", "cross"} - set(rec.streams)
    if missing:
        raise ValueError(
            f"method {ctx.method.name!r} needs an encoder-decoder model with encoder, decoder and cross "
            f"attention (T5, BART, Marian); {type(ctx.model).__name__} gave streams {list(rec.streams)}. "
            "For a single-stack model use 'rollout' or 'gae'. (Pass decoder_input_ids so that the decoder runs.)"
        )


def _result(ctx: Context, rec, R_dd: torch.Tensor, R_de: torch.Tensor, extra_opts: dict | None = None):
    ro = ctx.readout(rec, "decoder")  # the decoder rows explained (the last real target token by default)
    rows = ro.rows()
    dmask = ctx.mask(rec, "decoder")
    tgt = combine_rows(R_dd[:, rows], ro, rows)[0].detach().float().cpu()
    if dmask is not None:
        tgt = tgt * dmask.cpu()
    extra = {"target_scores": tgt}
    if rec.extra.get("decoder_tokens") is not None:
        extra["decoder_tokens"] = rec.extra["decoder_tokens"]
    return ctx.build(rec, combine_rows(R_de[:, rows], ro, rows)[0], ro, "encoder", extra=extra,
                     options={**ctx.options, **(extra_opts or {})})


@register(
    "encdec_rollout",
    description="encoder-decoder rollout: encoder, decoder self- and cross-attention composed so that source + target "
                "shares sum to 1 (class-agnostic)",
    options={"alpha": 0.5},
    cost="1 forward (eager attention) + O(L·n³)",
    reference="Abnar & Zuidema 2020 (rollout), composed across cross-attention as in Chefer, Gur & Wolf, ICCV 2021",
)
def encdec_rollout(ctx: Context, *, alpha):
    """Row t of [R_dd | R_de], see the module docstring."""
    a = _checks.check_real("alpha", alpha, low=0.0, high=1.0)
    rec = ctx.record(fuse_heads="mean")
    _streams(ctx, rec)
    f32 = lambda t: t.to(torch.float32)  # noqa: E731
    emask = ctx.mask(rec, "encoder")
    R_ee = core_rollout([f32(t) for t in rec.streams["encoder"]], head_fusion=None, alpha=a, attention_mask=emask)
    dec, cross = [f32(t) for t in rec.streams["decoder"]], [f32(t) for t in rec.streams["cross"]]
    R_dd, R_de = encdec_rollout_compose(R_ee, dec, cross, a)
    return _result(ctx, rec, R_dd, R_de)


@register(
    "encdec_gae",
    description="encoder-decoder generic attention explainability (Chefer ICCV'21 rules 6, 7, 10 with "
                "gradient-weighted attention; class-specific)",
    options={"transpose": True},
    needs_grad=True,
    class_specific=True,
    cost="1 forward + 1 backward (eager attention) + O(L·n³)",
    reference="Chefer, Gur & Wolf, Generic Attention-model Explainability for Interpreting Bi-Modal and "
              "Encoder-Decoder Transformers, ICCV 2021",
)
def encdec_gae(ctx: Context, *, transpose):
    """Row t of R_de (source) and R_dd (target), see the module docstring."""
    transpose = _checks.check_bool("transpose", transpose)
    rec, atts, grads = ctx.grad_record(
        ["encoder", "decoder", "cross"], scores=lambda r: (_streams(ctx, r), ctx.target_scores(r))[1]
    )
    W = {s: gradient_weighted(atts[s], grads[s]) for s in ("encoder", "decoder", "cross")}
    R_dd, R_de = encdec_gae_compose(W["encoder"], W["decoder"], W["cross"], transpose)
    return _result(ctx, rec, R_dd, R_de)
