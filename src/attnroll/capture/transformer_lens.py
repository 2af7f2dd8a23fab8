"""TransformerLens adapter: a ``TransformerBridge`` (TransformerLens 4, wrapping a transformers model; 4.0
removed ``HookedTransformer``) is read at its own hook points, ``blocks.{i}.attn.hook_pattern`` (the attention
probabilities (B, H, n, n) every TransformerLens model exposes, the tensor its attention multiplies the values
with, so gradients reach it too).

The capture adds one plain torch forward hook to each ``hook_pattern`` for the duration of the pass and removes
it afterwards; the model's own TransformerLens hooks, its hook registry and its settings are not touched.
The model is called as TransformerLens calls it: ``model(tokens)`` or ``model(**{"input": tokens,
"attention_mask": mask})``; its output is the logits (B, n, vocab), so the default target is the predicted
next token at the last real position.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from .hooks import Adapter, Site, make_sites
from .record import AttentionRecord, ModelFacts

__all__ = ["is_transformer_lens", "TransformerLensAdapter"]

_PATTERN = re.compile(r"^blocks\.(\d+)\.attn\.hook_pattern$")


def is_transformer_lens(model: nn.Module) -> bool:
    """A TransformerLens model (``TransformerBridge``) with attention hook points ``blocks.{i}.attn.hook_pattern``."""
    return type(model).__module__.startswith("transformer_lens.") and bool(_pattern_points(model))


def _pattern_points(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(layer, name, hook point) of every ``blocks.{i}.attn.hook_pattern``, in layer order."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return []
    out = []
    for i, block in enumerate(blocks):
        point = getattr(getattr(block, "attn", None), "hook_pattern", None)
        if isinstance(point, nn.Module):
            out.append((i, f"blocks.{i}.attn.hook_pattern", point))
    return out


class TransformerLensAdapter(Adapter):
    family = "transformer_lens"
    main_inputs = ("input",)
    inputs_example = ("For example inputs = model.to_tokens(texts) (a (B, n) tensor of token ids), or "
                      "{'input': ids, 'attention_mask': mask} for padded batches.")

    def sites(self) -> list[Site]:
        return make_sites([(name, point, "self") for _, name, point in _pattern_points(self.model)])

    def extract(self, site: Site, args: tuple, output: Any) -> Any:
        return output  # the hook point's output is the pattern itself (an identity module)

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        mask = inputs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            record.attention_mask = mask.detach().to(torch.long)

    def stream_kind(self, stream: str, record: AttentionRecord, inputs: dict[str, Any]) -> str:
        return "text"

    def input_key(self, stream: str, inputs: dict[str, Any]) -> str | None:
        return "input" if inputs.get("input") is not None else None

    def facts(self) -> ModelFacts:
        embed = getattr(self.model, "embed", None)
        tok = getattr(self.model, "tokenizer", None)
        pad, eos = getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)
        special = tuple(sorted({int(t) for t in getattr(tok, "all_special_ids", None) or ()}))
        return ModelFacts(family=self.family, input_key="input", keyword_call=False,
                          embedding=embed if isinstance(embed, nn.Module) else None, special_token_ids=special,
                          pad_token_id=pad if isinstance(pad, int) else None,
                          eos_token_id=eos if isinstance(eos, int) else None)
