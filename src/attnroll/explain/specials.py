"""Special tokens in a text encoder's map: left out of ``scores`` by default, their share recorded.

An encoder's map over a text holds the tokens the tokenizer adds around it ([CLS] / [SEP] of BERT, <s> /
</s> of RoBERTa, ...). They carry no word of the input, a perturbation metric never removes them
(:mod:`attnroll.evaluate.text`) and the token views leave them uncoloured; yet rollout-like maps put much of
their mass there, which then ranks them first. ``specials="drop"`` (the default, an option of every method):
on a non-causal text stream, ``Explanation.scores`` is 0 at the special tokens (the other tokens' values
unchanged, not rescaled); ``full_row`` keeps the whole row, special tokens included. ``extra["specials"]``
(their positions per example) and ``extra["special_share"]`` ((B,) the share of the real tokens' absolute
relevance on them, in ``full_row``) record what was left out. ``specials="keep"``: ``scores`` as the method
gave it, the same record kept.

Which tokens are special: the ids of the tokenizer's CLS / SEP / BOS / EOS tokens when ``explain`` is given
a ``tokenizer``, else those the model config records (``cls_token_id``, ``sep_token_id``, ``bos_token_id``,
``eos_token_id``); padding is left to the attention mask (it is 0 either way); [UNK] and [MASK] stand for
words and stay. Decoders (causal streams) are left as they are: their first tokens are handled by
``sinks=`` (:mod:`attnroll.explain.sinks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SPECIAL_CHOICES", "special_ids", "special_mask", "apply"]

SPECIAL_CHOICES = ("drop", "keep")
_ID_NAMES = ("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id")


def special_ids(tokenizer: Any, model: Any) -> list[int]:
    """The ids of the special tokens (see the module docstring): the tokenizer's, else the model config's."""
    found: set[int] = set()
    sources = [tokenizer] if tokenizer is not None else []
    cfg = getattr(model, "config", None)
    sources += [getattr(cfg, "text_config", None) or cfg] if cfg is not None else []
    for source in sources[:1]:
        for name in _ID_NAMES:
            v = getattr(source, name, None)
            if isinstance(v, int) and not isinstance(v, bool):
                found.add(v)
            elif isinstance(v, (list, tuple)):
                found |= {i for i in v if isinstance(i, int) and not isinstance(i, bool)}
    return sorted(found)


def special_mask(ids: Any, tokenizer: Any, model: Any, n: int) -> torch.Tensor | None:
    """(B, n) bool: where ``ids`` (B, n) token ids hold a special token, or None when ``ids`` is not (B, n)
    integer ids or no special id is known."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[-1] != n or ids.is_floating_point():
        return None
    known = special_ids(tokenizer, model)
    if not known:
        return None
    return torch.isin(ids.cpu(), torch.tensor(known, dtype=ids.dtype))


def apply(ctx: Any, info: Any, full_row: torch.Tensor, scores: torch.Tensor, start: int,
          extra: dict) -> tuple[torch.Tensor, dict]:
    """``Context.build``'s step for ``scores`` = ``full_row[:, start:start + units]``: the special tokens
    of a non-causal text stream recorded and (``specials="drop"``) set to 0 in ``scores``; returns
    (scores, extra). Other streams come back unchanged."""
    if info.kind != "text" or info.causal or "sinks" in extra or info.link is not None:
        return scores, extra
    ids = ctx.inputs.get(info.input_key or "input_ids") if isinstance(ctx.inputs, Mapping) else None
    special = special_mask(ids, ctx.tokenizer, ctx.model, full_row.shape[-1])
    if special is None:
        return scores, extra
    if info.mask is not None:
        special = special & info.mask.cpu().to(torch.bool)
    mass = full_row.abs()
    total = mass.sum(dim=-1)
    share = torch.where(total > 0, (mass * special).sum(dim=-1) / total.clamp_min(1e-30), torch.zeros_like(total))
    extra = {**extra, "specials": [torch.nonzero(special[b]).reshape(-1).tolist() for b in range(special.shape[0])],
             "special_share": share}
    if (ctx.options.get("specials") or "drop") == "drop":
        inside = special[:, start:start + scores.shape[-1]]
        scores = torch.where(inside, torch.zeros((), dtype=scores.dtype), scores)
    return scores, extra
