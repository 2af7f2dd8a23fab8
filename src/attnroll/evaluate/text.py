"""Faithfulness of token saliency: ERASER's comprehensiveness and sufficiency, as AOPC over bins
(DeYoung et al. 2020).

For each bin fraction q the top k = max(1, round(q · removable tokens)) tokens of the scores' relevance order
form the rationale (Python's round, half to even; ties by position). Comprehensiveness_q = p(y|x) −
p(y|x without the rationale); sufficiency_q = p(y|x) − p(y|the rationale alone, plus the kept special
tokens). Each AOPC is the mean over bins.

Removal DELETES tokens, as ERASER does: the remaining tokens of each sequence are re-packed left-justified
(original order), followed by padding (``pad_token_id`` of the model config, default 0) with attention mask
0; ``token_type_ids`` move with their tokens. The unperturbed reference p(y|x) goes through the same packing
with nothing removed, so for right-padded inputs (the usual) it is the model's output on the inputs as given.

Which tokens are never removed (and never count as units): ``keep``, default the tokens whose id is one of
the model config's ``cls_token_id``, ``sep_token_id``, ``bos_token_id``, ``eos_token_id``, ``pad_token_id``,
plus those flagged by ``inputs["special_tokens_mask"]`` when the tokenizer was called with
``return_special_tokens_mask=True``. Some configs (BERT's, in transformers 5) record no [CLS] / [SEP] id: pass
``special_tokens_mask`` or ``keep`` for them. Padding (attention mask 0) is never a unit either way.

The model is a transformers sequence classifier (or any module) called as ``model(input_ids=...,
attention_mask=..., token_type_ids=...)`` (token_type_ids only when the inputs hold them) returning logits
(B, C) or an object with ``.logits``. It runs under ``torch.no_grad()`` in eval mode (dropout off); the
model's own train/eval flags are restored afterwards.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .. import _checks
from .._modes import in_eval_mode
from ._common import chunks, logits_of, relevance_order, tick
from .perturbation import PerturbationResult, _result
from .registry import MetricInputs, MetricValues, register_metric

__all__ = ["comprehensiveness", "sufficiency", "repack", "special_token_mask", "text_units", "ERASER_BINS"]

#: ERASER's bins: the top 1%, 5%, 10%, 20% and 50% of tokens.
ERASER_BINS = (0.01, 0.05, 0.1, 0.2, 0.5)


def repack(
    input_ids: torch.Tensor,
    retain: torch.Tensor,
    token_type_ids: torch.Tensor | None = None,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Delete tokens: keep the positions where ``retain`` (B, n) is True, in their order, moved to the front
    of each row; fill the rest with ``pad_token_id`` (token type 0) and attention mask 0.

    Returns a dict with ``input_ids``, ``attention_mask`` and (when given) ``token_type_ids``, each (B, n).
    """
    n = input_ids.shape[1]
    retain = retain.to(torch.bool)
    # Stable sort on "dropped" puts the retained positions first, in their original order.
    perm = torch.sort((~retain).to(torch.int8), dim=1, stable=True).indices
    count = retain.sum(dim=1, keepdim=True)
    live = torch.arange(n, device=input_ids.device)[None, :] < count
    out = {
        "input_ids": torch.where(live, input_ids.gather(1, perm), torch.full_like(input_ids, int(pad_token_id))),
        "attention_mask": live.to(torch.long),
    }
    if token_type_ids is not None:
        out["token_type_ids"] = torch.where(live, token_type_ids.gather(1, perm), torch.zeros_like(token_type_ids))
    return out


def special_token_mask(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, n) bool: tokens that are special by the model config's ids (cls / sep / bos / eos / pad), or by
    the tokenizer's ``special_tokens_mask`` when the inputs carry one."""
    ids = inputs["input_ids"]
    special = torch.zeros_like(ids, dtype=torch.bool)
    for i in _facts(model).special_token_ids:
        special |= ids == i
    if "special_tokens_mask" in inputs:
        special |= inputs["special_tokens_mask"].to(torch.bool)
    return special


def text_units(model: Any, inputs: dict[str, torch.Tensor], keep: Any = None) -> torch.Tensor:
    """(B, n) bool on the CPU: the *units* of tokenised text, the tokens a text metric counts -- real tokens
    (attention mask 1) that are not kept (``keep``, a (B, n) mask; default :func:`special_token_mask`)."""
    ids = inputs["input_ids"]
    kept = special_token_mask(model, inputs) if keep is None else _checks.check_keep(keep, *ids.shape)
    return (inputs["attention_mask"].to(torch.bool) & ~kept.to(device=ids.device, dtype=torch.bool)).cpu()


def _facts(model: Any) -> Any:
    from ..capture import ModelFacts, model_facts

    return model_facts(model) if isinstance(model, torch.nn.Module) else ModelFacts()


def _pad_id(model: Any) -> int:
    pad = _facts(model).pad_token_id
    return 0 if pad is None else pad


def _forward(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return logits_of(model(**batch)).detach().to("cpu", torch.float64)


def _aopc(
    kind: str,
    model: Any,
    inputs: Any,
    scores: Any,
    target: Any,
    bins: Any,
    keep: Any,
    batch_size: Any,
) -> PerturbationResult:
    enc = _checks.check_text_inputs(inputs)
    ids, am = enc["input_ids"], enc["attention_mask"].to(torch.bool)
    tt = enc.get("token_type_ids")
    B, n = ids.shape
    s = _checks.check_scores("scores", scores, batch=B, units=n)
    q = _checks.check_fractions("bins", bins)
    batch_size = _checks.check_int("batch_size", batch_size, low=1)
    kept = special_token_mask(model, enc) if keep is None else _checks.check_keep(keep, B, n).to(ids.device)
    kept = kept & am
    removable = am & ~kept
    n_units = removable.sum(dim=1).cpu()
    empty = (n_units == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"examples {empty[:10]} have no removable token (every real token is special or in keep); "
            "comprehensiveness and sufficiency need at least one"
        )
    pad = _pad_id(model)

    # Relevance order among removable tokens only: the others sort last (their rank is never < k).
    key = torch.where(removable.cpu(), s, torch.full_like(s, -torch.inf))
    order = relevance_order(key, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n).expand(B, n).contiguous())
    k = torch.tensor([[max(1, round(float(f) * int(u))) for f in q] for u in n_units], dtype=torch.long)  # (B, S)
    S = len(q)

    def rows(ex: torch.Tensor, step: torch.Tensor) -> dict[str, torch.Tensor]:
        """Packed inputs for (example, bin) pairs; bin -1 = the unperturbed reference."""
        ex_c = ex.cpu()
        real = am[ex]
        if (step < 0).all():
            retain = real
        else:
            top = (rank[ex_c] < k[ex_c, step.clamp(min=0).cpu()][:, None]).to(ids.device) & removable[ex]
            retain = (real & ~top) if kind == "comprehensiveness" else ((kept[ex] | top) & real)
            retain = torch.where((step < 0)[:, None], real, retain)
        return repack(ids[ex], retain, None if tt is None else tt[ex], pad)

    def probs(ex_all: torch.Tensor, step_all: torch.Tensor, tgt: torch.Tensor | None) -> torch.Tensor:
        out = []
        for sl in chunks(ex_all.numel(), batch_size):
            logits = _forward(model, rows(ex_all[sl], step_all[sl]))
            if tgt is not None:  # keep only the target's probability
                logits = torch.softmax(logits, 1).gather(1, tgt[ex_all[sl].cpu()][:, None])[:, 0]
                tick(sl.stop - sl.start, ex_all.numel())
            out.append(logits)
        return torch.cat(out)

    dev = ids.device
    with torch.no_grad():
        ref_logits = probs(torch.arange(B, device=dev), torch.full((B,), -1, device=dev), None)
        if isinstance(target, np.ndarray):
            target = target.tolist()
        tgt = torch.as_tensor(
            _checks.check_target(target, B, ref_logits.shape[1], default=ref_logits.argmax(1).tolist()),
            dtype=torch.long,
        )
        p_ref = torch.softmax(ref_logits, 1).gather(1, tgt[:, None])[:, 0]
        p_pert = probs(torch.arange(B, device=dev).repeat_interleave(S), torch.arange(S, device=dev).repeat(B), tgt)
    curves = (p_ref[:, None] - p_pert.view(B, S)).numpy()
    return _result(kind, q, curves, curves.mean(axis=1), kind == "comprehensiveness", tgt.numpy())


@in_eval_mode
def comprehensiveness(
    model: Any,
    inputs: Any,
    scores: Any,
    *,
    target: Any = None,
    bins: Sequence[float] = ERASER_BINS,
    keep: Any = None,
    batch_size: int = 64,
) -> PerturbationResult:
    """ERASER comprehensiveness (AOPC): how much the target probability drops when the top-k tokens are
    deleted, averaged over ``bins``. Higher is better.

    Args:
        model: sequence classifier called as model(input_ids=, attention_mask=[, token_type_ids=]), in eval
            mode.
        inputs: dict / BatchEncoding with input_ids (B, n), attention_mask (B, n) (default all ones),
            optionally token_type_ids and special_tokens_mask (B, n). Other keys are not passed on.
        scores: an ``Explanation`` or (B, n) saliency over tokens (special tokens included, padding 0).
        target: None (the class predicted on the unperturbed input), an int, or B ints.
        bins: increasing fractions in [0, 1] of the removable tokens; k = max(1, round(q · removable)).
        keep: (B, n) bool mask of tokens never removed (default: special tokens, see the module docs).
        batch_size: sequences per forward pass.

    Returns:
        :class:`~attnroll.evaluate.perturbation.PerturbationResult` with ``fractions`` = bins, ``curves``
        (B, S) = p(y|x) − p(y|x without the top k), ``per_example`` their mean over bins.
    """
    return _aopc("comprehensiveness", model, inputs, scores, target, bins, keep, batch_size)


@in_eval_mode
def sufficiency(
    model: Any,
    inputs: Any,
    scores: Any,
    *,
    target: Any = None,
    bins: Sequence[float] = ERASER_BINS,
    keep: Any = None,
    batch_size: int = 64,
) -> PerturbationResult:
    """ERASER sufficiency (AOPC): how much the target probability drops when only the top-k tokens (and the
    kept special tokens) remain, averaged over ``bins``. Lower is better. Arguments as
    :func:`comprehensiveness`; ``curves`` = p(y|x) − p(y|top k only)."""
    return _aopc("sufficiency", model, inputs, scores, target, bins, keep, batch_size)


# ------------------------------------------------------------------------------------------- registration
def _aopc_options(inp: MetricInputs) -> dict[str, Any]:
    bins = inp.option("bins")
    return {"target": inp.target, "keep": inp.option("keep"), "batch_size": inp.batch_size,
            **({"bins": bins} if bins is not None else {})}


@register_metric("comprehensiveness", kind="text", higher_is_better=True,
                 curve=("share of tokens deleted (top first)", "probability drop"),
                 description="AOPC comprehensiveness (DeYoung et al. 2020): probability drop without the top tokens")
def _comprehensiveness_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return MetricValues.of_curves(comprehensiveness(inp.model, inp.inputs, scores, **_aopc_options(inp)))


@register_metric("sufficiency", kind="text", higher_is_better=False,
                 curve=("share of tokens kept (top first)", "probability drop"),
                 description="AOPC sufficiency (DeYoung et al. 2020): probability drop with only the top tokens")
def _sufficiency_metric(inp: MetricInputs, scores: Any, grid: Any) -> MetricValues:
    return MetricValues.of_curves(sufficiency(inp.model, inp.inputs, scores, **_aopc_options(inp)))
