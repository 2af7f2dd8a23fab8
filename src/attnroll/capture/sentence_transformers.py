"""sentence-transformers: the pooling a sentence-embedding model reads, and ``SentenceTransformer`` objects.

A sentence-transformers model folder holds ``modules.json`` naming its modules; the Pooling module's
``config.json`` says which token rows the sentence embedding is made of (``pooling_mode_mean_tokens``: the
mean of the real tokens' rows; ``pooling_mode_cls_token``: the first row; ``pooling_mode_lasttoken``: the
last real token). A transformers model loaded from such a folder (``AutoModel.from_pretrained(folder)``)
reads the same config, so its default readout is the one the sentence embedding uses.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from torch import nn

#: Pooling config flag -> readout kind. ``mean_sqrt_len`` scales the mean by a constant per example, so its
#: rows have the same relative weights as the mean.
_MODES = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean"),
    ("pooling_mode_lasttoken", "last"),
)


def pooling_from_config(cfg: dict[str, Any], where: str) -> tuple[str, str] | None:
    """(readout kind, source) from a Pooling config dict; None when it uses none of the linear modes.

    Pooling that is not one weighted sum of rows (max pooling, several modes concatenated) gives
    (None, reason): no default readout would be honest."""
    kinds = [kind for flag, kind in _MODES if cfg.get(flag)]
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        kinds += [{"cls": "cls", "mean": "mean", "mean_sqrt_len_tokens": "mean", "lasttoken": "last"}.get(mode, "")]
    kinds = [k for k in kinds if k]
    if len(set(kinds)) == 1:
        return kinds[0], f"sentence-transformers pooling ({where})"
    if cfg.get("pooling_mode_max_tokens") or cfg.get("pooling_mode_weightedmean_tokens") or len(set(kinds)) > 1:
        return None, (
            f"the sentence-transformers pooling in {where} ({', '.join(k for k, v in cfg.items() if v is True)}) is "
            "not one weighted set of token rows: pass readout= ('cls', 'mean', 'last', a position or a weight vector)"
        )
    return None


def pooling_of_folder(folder: Any) -> tuple[str, str] | None:
    """The Pooling module's readout of a sentence-transformers model folder, or None when ``folder`` is not
    one (no ``modules.json`` naming a Pooling module)."""
    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        return None
    modules = os.path.join(folder, "modules.json")
    try:
        with open(modules, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith("Pooling"):
            path = os.path.join(folder, str(entry.get("path", "")), "config.json")
            try:
                with open(path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError):
                return None
            return pooling_from_config(cfg, os.path.relpath(path, folder))
    return None


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
