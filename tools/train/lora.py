"""Low-rank (LoRA) fine-tuning of every encoder layer of a BERT classifier, and its compact delta.

:func:`add_low_rank` wraps every attention and MLP linear of every encoder layer (query, key, value, attention
output, intermediate, output) in :class:`LowRankLinear`: the pretrained weight frozen, plus a trained update
``b @ a`` of rank ``rank`` (``b`` starts at zero, so training starts from the pretrained model). Trained in full
besides: every bias of the encoder, every LayerNorm (embeddings included), the pooler and the classifier.
Frozen: the word, position and type embeddings and the linears' pretrained weights.

:func:`delta_state` is what ships: the factors as ``NAME.weight.lora_a`` (r, in) and ``NAME.weight.lora_b``
(out, r; the scale already applied) and the fully trained tensors, all float32. The forward here and
:func:`attnroll.models.evidence.load_delta_model` merge with the same
:func:`attnroll.models.evidence.merge_low_rank`, so the loaded model holds the trained weights exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnroll.models.evidence import LOW_RANK_A, LOW_RANK_B, merge_low_rank

#: The linears of a BERT encoder layer that get a low-rank update (paths inside ``encoder.layer[i]``).
TARGETS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")
#: Parameters trained in full (name prefixes / parts), besides the low-rank factors.
FULL = ("bert.pooler.", "classifier.")


class LowRankLinear(nn.Module):
    """``linear`` (weight frozen, bias trained) plus a rank-``rank`` update ``(b * scale) @ a``."""

    def __init__(self, linear: nn.Linear, rank: int, scale: float):
        super().__init__()
        self.base = linear
        linear.weight.requires_grad_(False)
        out_f, in_f = linear.weight.shape
        bound = 1 / math.sqrt(in_f)
        self.lora_a = nn.Parameter(torch.empty(rank, in_f).uniform_(-bound, bound))
        self.lora_b = nn.Parameter(torch.zeros(out_f, rank))
        self.scale = scale

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b): the shipped factors, the update is ``b @ a``."""
        return self.lora_a, self.lora_b * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.factors()
        return F.linear(x, merge_low_rank(self.base.weight, a, b), self.base.bias)


def add_low_rank(model: Any, rank: int, alpha: float) -> int:
    """Wrap :data:`TARGETS` of every encoder layer of ``model`` (a ``BertForSequenceClassification``) in
    :class:`LowRankLinear` (scale ``alpha / rank``, ``a`` drawn from torch's current seed) and set which
    parameters train (see the module docstring); returns the number of trained parameters."""
    if rank < 1:
        raise ValueError(f"add_low_rank: rank must be >= 1, got {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.bert.encoder.layer:
        for path in TARGETS:
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            setattr(parent, leaf, LowRankLinear(getattr(parent, leaf), rank, alpha / rank))
    for name, p in model.named_parameters():
        if name.startswith(FULL) or "LayerNorm" in name or name.endswith((".bias", ".lora_a", ".lora_b")):
            p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def delta_state(model: Any) -> dict[str, torch.Tensor]:
    """The shipped tensors (float32, under the plain model's names): each :class:`LowRankLinear`'s factors as
    ``NAME.weight`` + :data:`LOW_RANK_A` / :data:`LOW_RANK_B`, and every other trained parameter."""
    state: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if callable(getattr(mod, "factors", None)):  # a LowRankLinear (also of another import of this file)
            a, b = mod.factors()
            state[f"{name}.weight{LOW_RANK_A}"] = a
            state[f"{name}.weight{LOW_RANK_B}"] = b
    for name, p in model.named_parameters():
        if p.requires_grad and not name.endswith((".lora_a", ".lora_b")):
            state[name.replace(".base.", ".")] = p
    return {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
