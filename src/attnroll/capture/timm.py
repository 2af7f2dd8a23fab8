"""timm VisionTransformer adapter (vit_*, deit_* including distilled, variants with register tokens).

timm's ``Attention`` uses ``F.scaled_dot_product_attention`` when ``fused_attn`` is set (the default on
recent torch), and then never calls ``attn_drop`` — the module every hook-based tool listens to. For the
duration of the capture each attention module's ``fused_attn`` is set to False (restored afterwards), and
the *output* of ``attn_drop`` is recorded: the softmax probabilities exactly as multiplied with the values
(identical to the softmax in eval mode), which is also the tensor gradients flow through.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .. import _checks
from .hooks import SUPPORTED_FAMILIES, Adapter, Recorder, Site, make_sites, set_attr_temporarily
from .record import AttentionRecord, ModelFacts


def is_timm_model(model: nn.Module) -> bool:
    return "timm" in sys.modules and type(model).__module__.startswith("timm.")


class TimmAdapter(Adapter):
    family = "timm:vit"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        from timm.models.vision_transformer import VisionTransformer

        if not isinstance(model, VisionTransformer):
            windowed = "swin" in type(model).__name__.lower()
            why = (
                " Swin computes attention inside shifted local windows, so there is no global token-to-token "
                "matrix to roll out." if windowed else ""
            )
            raise _checks.UnsupportedModelError(
                f"timm model {type(model).__name__} is not a timm VisionTransformer.{why} Supported: "
                f"{SUPPORTED_FAMILIES}"
            )
        self.attn_modules = [
            (n, m)
            for n, m in model.named_modules()
            if hasattr(m, "fused_attn") and isinstance(getattr(m, "attn_drop", None), nn.Module)
        ]

    def sites(self) -> list[Site]:
        return make_sites([(f"{n}.attn_drop", m.attn_drop, "self") for n, m in self.attn_modules])

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        for _, m in self.attn_modules:
            set_attr_temporarily(stack, m, "fused_attn", False)
        super().install(stack, recorder, sites)

    def facts(self) -> ModelFacts:
        return ModelFacts(family=self.family, input_key="x", keyword_call=False)

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        record.prefix = int(getattr(self.model, "num_prefix_tokens", 0))
        x = inputs.get("x")
        pe = getattr(self.model, "patch_embed", None)
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or pe is None:
            return
        size = (int(x.shape[-2]), int(x.shape[-1]))
        if hasattr(pe, "dynamic_feat_size"):
            grid = tuple(int(g) for g in pe.dynamic_feat_size(size))
        else:
            ph, pw = pe.patch_size
            grid = (size[0] // ph, size[1] // pw)
        n = record.streams["self"][0].shape[-1]
        if record.prefix + grid[0] * grid[1] == n:
            record.grid = grid  # type: ignore[assignment]
