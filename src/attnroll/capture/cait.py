"""timm CaiT adapter (``cait_*``): talking-heads self-attention over the patches, then class-attention
blocks in which only the class token queries [CLS + patches].

One token space for the whole stream: [CLS, patch_1 … patch_N] (prefix 1, the patch grid from the patch
embedding). The class token does not exist in the self-attention blocks (it is a parameter, prepended only
by the class-attention blocks), so there its row is the identity and no patch attends to it; in the
class-attention blocks the patches pass through unchanged (identity rows) and the CLS row is the block's
own attention. Rollout then composes the class-attention blocks as the final layers of the class token's
readout, with the same residual rule as every other layer.

Talking heads (``TalkingHeadAttn``): the softmax maps are mixed across heads *after* the softmax
(``proj_w``, a linear map with bias) and that mixture is what multiplies the values, so it is what the
record holds (the output of ``attn_drop``). Its rows are in general not probabilities (any sum, negative
entries possible): such layers are listed in ``StreamInfo.nonstochastic`` with the measured reason, and
methods that need probabilities refuse them (gradient methods and ``raw`` read them as they are).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .hooks import Adapter, Recorder, Site, make_sites, set_attr_temporarily
from .record import AttentionRecord, StreamInfo
from .timm import TimmAdapter

#: timm attention classes of CaiT: the self-attention blocks' and the class-attention blocks'.
TALKING, CLASS = "TalkingHeadAttn", "ClassAttn"


def is_cait(model: nn.Module) -> bool:
    """A timm model whose attention modules are talking-heads or class attention (CaiT)."""
    return any(type(m).__name__ in (TALKING, CLASS) for m in model.modules())


def embed_self(A: torch.Tensor) -> torch.Tensor:
    """Self-attention over the patches (B, H, N, N) -> (B, H, 1+N, 1+N): the absent class token's row is
    the identity, its column 0 for the patches."""
    out = nn.functional.pad(A, (1, 0, 1, 0))
    e = torch.zeros_like(out)
    e[..., 0, 0] = 1.0
    return out + e


def embed_class(A: torch.Tensor) -> torch.Tensor:
    """Class attention (B, H, 1, 1+N) -> (B, H, 1+N, 1+N): the CLS row as computed, the patches' rows the
    identity (the block leaves them unchanged)."""
    B, H, _, n = A.shape
    eye = torch.eye(n, dtype=A.dtype, device=A.device)[1:].expand(B, H, n - 1, n)
    return torch.cat([A, eye], dim=2)


def _lift_self(g: torch.Tensor) -> torch.Tensor:
    return nn.functional.pad(g, (1, 0, 1, 0))


def _lift_class(g: torch.Tensor) -> torch.Tensor:
    B, H, _, n = g.shape
    return torch.cat([g, g.new_zeros(B, H, n - 1, n)], dim=2)


class CaitAdapter(TimmAdapter):
    """timm ``Cait`` (see the module docstring); readout, grid and facts as for timm ViTs."""

    def __init__(self, model: nn.Module):  # not TimmAdapter's: its checks are for the ViT family
        Adapter.__init__(self, model)
        self.family = f"timm:{type(model).__name__}"
        self.attn_modules = [(n, m) for n, m in model.named_modules() if type(m).__name__ in (TALKING, CLASS)]
        self.pool_attn: dict[str, torch.Tensor] = {}
        self._native: dict[int, tuple[torch.Tensor, Any]] = {}
        self._kinds = [type(m).__name__ for _, m in self.attn_modules]

    def sites(self) -> list[Site]:
        return make_sites([(f"{n}.attn_drop", m.attn_drop, "self") for n, m in self.attn_modules])

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        for _, m in self.attn_modules:
            if hasattr(m, "fused_attn"):  # class attention has a fused path; talking heads has none
                set_attr_temporarily(stack, m, "fused_attn", False)
        Adapter.install(self, stack, recorder, sites)

    def extract(self, site: Site, args: tuple, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            return None
        kind = self._kinds[site.layer]
        if output.requires_grad:
            output.retain_grad()  # record.gradients() reads it
            self._native[site.layer] = (output, _lift_class if kind == CLASS else _lift_self)
        return embed_class(output) if kind == CLASS else embed_self(output)

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        super().metadata(record, inputs)
        if self._native:
            record.extra["native"] = {("self", i): v for i, v in self._native.items()}
        self._native = {}

    def stream_infos(self, record: AttentionRecord, inputs: dict[str, Any]) -> dict[str, StreamInfo]:
        infos = super().stream_infos(record, inputs)
        info = infos["self"]
        bad, ranges = [], []
        for i, (kind, t) in enumerate(zip(self._kinds, record.streams["self"])):
            if kind != TALKING:
                continue
            d = t.detach()[..., 1:, 1:]
            sums = d.sum(dim=-1)
            if float(d.amin()) < 0 or float((sums - 1).abs().amax()) > 1e-3:
                bad.append(i)
                ranges.append((float(sums.amin()), float(sums.amax()), float(d.amin())))
        if bad:
            lo, hi, mn = min(r[0] for r in ranges), max(r[1] for r in ranges), min(r[2] for r in ranges)
            info.nonstochastic = tuple(bad)
            info.stochastic_reason = (
                f"CaiT's talking-heads attention mixes the heads after the softmax (proj_w), and that mixture — "
                f"what multiplies the values — has rows summing to {lo:.3g}..{hi:.3g} and entries down to "
                f"{mn:.3g}; layers {bad[0]}..{bad[-1]}"
            )
        return infos

