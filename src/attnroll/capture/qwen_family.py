"""Which models are Qwen2-VL / Qwen2.5-VL / Qwen3-VL, their facts and why ``capture`` has no dense record of
them: what the family registry needs (the capture itself is :mod:`attnroll.capture.qwen_vl`)."""

from __future__ import annotations

from torch import nn

from .. import _checks
from .hf import hf_facts, is_hf_model
from .hooks import Adapter
from .record import ModelFacts

__all__ = ["TYPES", "REFUSAL", "is_qwen_vl", "towers", "qwen_facts", "refuse_dense"]

#: The transformers model types composed by :mod:`attnroll.capture.qwen_vl`.
TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

#: What ``attnroll.capture`` says: there is no dense record of these models.
REFUSAL = (
    "its vision attention returns no probabilities (one kernel call per image chunk of cu_seqlens, per window in "
    "Qwen2.5-VL), so there is no dense record to capture. attnroll.explain composes it on the matrix-free route "
    "(methods rollout, raw, grad_rollout, gae): the probabilities are recomputed per chunk from the queries and keys "
    "its kernels saw (attnroll.capture.qwen_vl.capture_qwen_vl records them)"
)


def towers(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(vision tower, language model) of a Qwen VL model (conditional generation or the bare model)."""
    base = model.model if hasattr(getattr(model, "model", None), "visual") else model
    return base.visual, base.language_model


def is_qwen_vl(model: nn.Module) -> bool:
    """A transformers Qwen2-VL / Qwen2.5-VL / Qwen3-VL model with its vision tower and language model."""
    if not is_hf_model(model) or getattr(getattr(model, "config", None), "model_type", None) not in TYPES:
        return False
    try:
        towers(model)
    except AttributeError:
        return False
    return True


def qwen_facts(model: nn.Module) -> ModelFacts:
    """The transformers facts, with both streams' inputs."""
    facts = hf_facts(model)
    facts.stream_inputs = {"vision": "pixel_values", "language": "input_ids"}
    return facts


def refuse_dense(model: nn.Module) -> Adapter:
    """``capture``'s adapter: none; UnsupportedModelError saying why and what explains the model."""
    raise _checks.UnsupportedModelError(f"{type(model).__name__} ({model.config.model_type}) {REFUSAL}")
