"""Reading a model's outputs: where its main scores (logits) are, whatever the family returns."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["main_logits"]


def main_logits(outputs: Any) -> torch.Tensor | None:
    """The model's main output scores: ``.logits`` of a transformers output (or a dict's "logits"), a tensor
    output itself, or the first tensor of a tuple; None when there is none (e.g. a bare encoder's hidden
    states). Shapes as the model gives them: (B, C) for classifiers, (B, n, V) for token-level heads."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, dict):
        logits = outputs.get("logits")
    if logits is None and isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        logits = outputs[0]
    return logits if isinstance(logits, torch.Tensor) else None
