"""sentence-transformers ``SentenceTransformer`` objects (the way most users hold MiniLM or MPNet).

The transformers model inside (the first module's ``auto_model``) is captured by the transformers adapter;
the object is called the sentence-transformers way (one features dict, positionally); its Pooling module's
mode (see ``st_pooling``) gives the readout.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from .st_pooling import pooling_from_config


def is_sentence_transformer(model: nn.Module) -> bool:
    """True for a ``sentence_transformers.SentenceTransformer`` (checked without importing it)."""
    if "sentence_transformers" not in sys.modules:
        return False
    from sentence_transformers import SentenceTransformer

    return isinstance(model, SentenceTransformer)


def pooling_of_module(st_model: nn.Module) -> tuple[Any, str]:
    """(readout kind or None, source) from the Pooling module of a SentenceTransformer."""
    for i, module in enumerate(st_model):
        if type(module).__name__ == "Pooling" and hasattr(module, "get_config_dict"):
            found = pooling_from_config(module.get_config_dict(), f"module {i} ({type(module).__name__})")
            if found is not None:
                return found
            break
    return "cls", "no Pooling module with a mean / cls / last-token mode: the first token"


def transformer_of(st_model: nn.Module) -> nn.Module:
    """The transformers model inside a SentenceTransformer (its first module's ``auto_model``)."""
    for module in st_model:
        inner = getattr(module, "auto_model", None)
        if isinstance(inner, nn.Module):
            return inner
    from .. import _checks

    raise _checks.UnsupportedModelError(
        f"this SentenceTransformer has no transformers module (modules: {[type(m).__name__ for m in st_model]})"
    )


def make_adapter(st_model: nn.Module):
    """An adapter for a SentenceTransformer: the transformers adapter of its inner model, called the
    sentence-transformers way (one features dict, positionally), reading the Pooling module's readout."""
    from contextlib import ExitStack

    from .hf import HFAdapter
    from .hooks import Recorder, Site
    from .record import AttentionRecord, ModelFacts

    class SentenceTransformerAdapter(HFAdapter):
        def __init__(self) -> None:
            super().__init__(transformer_of(st_model))
            self.family = "sentence-transformers:" + self.family.split(":", 1)[1]
            self.pooling = pooling_of_module(st_model)
            self._inner_out: Any = None

        def call_inputs(self, inputs: Any) -> Any:
            # SentenceTransformer.forward takes the features dict as one positional argument.
            return (inputs,) if hasattr(inputs, "keys") else inputs

        def bound_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
            feats = inputs.get("input")
            return dict(feats) if hasattr(feats, "keys") else inputs

        def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
            super().install(stack, recorder, sites)
            if self.from_outputs:  # the public path reads the inner model's own output
                handle = self.model.register_forward_hook(lambda m, a, out: setattr(self, "_inner_out", out))
                stack.callback(handle.remove)

        def output_streams(self, output: Any) -> dict[str, list[Any]]:
            return super().output_streams(self._inner_out)

        def readout_spec(self, stream: str, record: AttentionRecord, info: Any, inputs: dict[str, Any]):
            return self.pooling

        def facts(self) -> ModelFacts:
            base = super().facts()
            base.family, base.keyword_call = self.family, False
            return base

    return SentenceTransformerAdapter()
