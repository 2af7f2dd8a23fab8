"""Swin / SwinV2 adapter (transformers ``swin``, ``swinv2``, ``donut-swin``, ``maskformer-swin``; timm
``swin_*`` / ``swinv2_*``): window attention scattered into each stage's token-to-token matrix.

Each Swin block attends inside windows of w×w tokens of its stage (every other block after a cyclic shift
of ⌊w/2⌋, with a mask that keeps wrapped-around regions apart), and 2×2 patch merging shrinks the grid
between stages. Per block the adapter records what the model computed, the window probabilities
(B·nW, H, w², w²), and scatters them into the stage matrix (B, H, n_s, n_s), rows and columns in the stage's
raster token order: the token of each window position is found by running the block's own geometry (its
padding, shift and window partition) on a grid of token indices, so the shift is undone exactly as the
model undoes it. Tokens in different windows get 0. Zero padding the partition adds (a stage size that is
no multiple of w) carries no token: its columns are dropped and the rows renormalised over real tokens.

The stream is a stage chain (``StreamInfo.merges``): between stages the merge map of ``core.stages.
merge_2x2`` — each merged token takes equal shares of its 2×2 sources, a convention like rollout's α = ½
(the model's merge is a learned linear map of the concatenated channels). The units and ``grid`` are the
input patch grid (the first stage's tokens, as the patch embedding produced them); the default readout is
the mean of the last stage's tokens, which both libraries' classifiers average.

Gradients: the scattered matrix is not in the model's graph, so the record keeps the window tensor as the
layer's ``extra["native"]`` source; d y / d A is scattered the same way (the model's output depends on the
stage matrix only through its window entries).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import Any, Callable

import torch
from torch import nn

from .. import _checks
from ..core.stages import merge_2x2
from .hf import SWIN_TYPES, hf_facts
from .hooks import Adapter, Recorder, Site, make_sites, set_attr_temporarily
from .record import AttentionRecord, ModelFacts, StreamInfo, resolve_readout
from .transformers_private import all_configs, check_transformers_version, force_eager

#: transformers model types whose blocks are Swin window-attention layers this adapter reads.
HF_TYPES = SWIN_TYPES


#: timm model classes made of Swin window blocks this adapter reads.
TIMM_CLASSES = ("SwinTransformer", "SwinTransformerV2")


def is_swin(model: nn.Module) -> bool:
    """Whether ``model`` is a Swin model this adapter reads: a transformers model of ``HF_TYPES`` or a
    timm model of ``TIMM_CLASSES``."""
    if type(model).__module__.startswith("timm."):
        return type(model).__name__ in TIMM_CLASSES and bool(_timm_blocks(model))
    return getattr(getattr(model, "config", None), "model_type", None) in HF_TYPES and bool(_hf_layers(model))


def _hf_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers Swin layers: a window size, a shift, the partition padding and an attention child."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Layer") and hasattr(m, "maybe_pad") and hasattr(m, "shift_size")
            and hasattr(m, "window_size") and isinstance(getattr(m, "attention", None), nn.Module)]


def _timm_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """timm Swin blocks: ``_attn`` over windows and a window attention with an ``attn_drop`` module."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__module__.startswith("timm.") and hasattr(m, "_attn") and hasattr(m, "shift_size")
            and isinstance(getattr(getattr(m, "attn", None), "attn_drop", None), nn.Module)]


# ------------------------------------------------------------------------------------------- geometry
def _index_grid(H: int, W: int) -> torch.Tensor:
    """(1, H, W, 1) float grid holding token index + 1 (0 is left for the zero padding)."""
    return (torch.arange(H * W, dtype=torch.float64) + 1).reshape(1, H, W, 1)


def hf_window_ids(layer: nn.Module, H: int, W: int) -> torch.Tensor:
    """(nW, w²) stage token index of every window position of a transformers Swin layer (−1 = padding):
    its own ``maybe_pad``, then the cyclic shift by −shift, then its module's ``window_partition``."""
    ws, shift = int(layer.window_size), int(layer.shift_size)
    x, _ = layer.maybe_pad(_index_grid(H, W), H, W)
    if shift > 0:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    partition = sys.modules[type(layer).__module__].window_partition
    return (partition(x, ws).reshape(-1, ws * ws) - 1).round().long()


def timm_window_ids(block: nn.Module, H: int, W: int) -> torch.Tensor:
    """(nW, w²) stage token index of every window position of a timm Swin block (−1 = padding): the cyclic
    shift by −shift first, then the padding, then its module's ``window_partition`` (as ``_attn`` does)."""
    wh, ww = (int(v) for v in block.window_size)
    x = _index_grid(H, W)
    if any(block.shift_size):
        x = torch.roll(x, shifts=(-int(block.shift_size[0]), -int(block.shift_size[1])), dims=(1, 2))
    x = nn.functional.pad(x, (0, 0, 0, (ww - W % ww) % ww, 0, (wh - H % wh) % wh))
    partition = sys.modules[type(block).__module__].window_partition
    return (partition(x, (wh, ww)).reshape(-1, wh * ww) - 1).round().long()


def scatter_windows(P: torch.Tensor, ids: torch.Tensor, n: int, *, renorm: bool = True) -> torch.Tensor:
    """Window probabilities P (B·nW, H, w², w²) -> the stage matrix (B, H, n, n) (differentiable).

    ``ids`` (nW, w²): the stage token of each window position, −1 for padding. Entry [b, h, ids[k, i],
    ids[k, j]] = P[b·nW + k, h, i, j]; pairs in different windows are 0. With padding, the padded columns
    are dropped and (``renorm``) each real row divided by what is left of its sum."""
    nW, a = ids.shape
    B, Hh = P.shape[0] // nW, P.shape[1]
    pad = ids < 0
    idx = torch.where(pad, torch.full_like(ids, n), ids).to(P.device)  # padding -> a dummy token n
    b = torch.arange(B, device=P.device)[:, None, None, None, None]
    h = torch.arange(Hh, device=P.device)[None, :, None, None, None]
    rows, cols = idx[None, None, :, :, None], idx[None, None, :, None, :]
    vals = P.reshape(B, nW, Hh, a, a).permute(0, 2, 1, 3, 4)  # (B, H, nW, a, a)
    out = P.new_zeros(B, Hh, n + 1, n + 1).index_put((b, h, rows, cols), vals)[:, :, :n, :n]
    if renorm and bool(pad.any()):
        s = out.sum(dim=-1, keepdim=True)
        out = out / torch.where(s > 0, s, torch.ones_like(s))
    return out


def stage_merges(grids: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
    """Merge maps between consecutive layers whose (rows, cols) grids differ: 2×2 merging only."""
    merges = {}
    for k in range(1, len(grids)):
        (h, w), nxt = grids[k - 1], grids[k]
        if nxt == (h, w):
            continue
        if nxt != ((h + 1) // 2, (w + 1) // 2):
            raise _checks.UnsupportedModelError(
                f"Swin layer {k} works on a {nxt[0]}x{nxt[1]} grid after a {h}x{w} one: not a 2x2 patch merging, "
                "so attnroll has no merge map for it"
            )
        merges[k] = merge_2x2(h, w)
    return merges


# ------------------------------------------------------------------------------------------- adapters
class _SwinAdapter(Adapter):
    """What transformers and timm Swin share: sites are the blocks; each block's window probabilities are
    scattered into its stage matrix when the block returns; the stage chain and readout in metadata."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]]):
        super().__init__(model)
        self.blocks = blocks
        self._pending: dict[int, torch.Tensor] = {}
        self._grids: dict[int, tuple[int, int]] = {}
        self._native: dict[int, tuple[torch.Tensor, Callable]] = {}

    # the library side ---------------------------------------------------------------------------------
    def probs_module(self, block: nn.Module) -> nn.Module | None:
        """The module whose output is the block's window probabilities (None: the block returns them)."""
        raise NotImplementedError

    def block_grid(self, block: nn.Module, args: tuple) -> tuple[int, int]:
        raise NotImplementedError

    def window_ids(self, block: nn.Module, H: int, W: int) -> torch.Tensor:
        raise NotImplementedError

    def window_probs(self, block: nn.Module, output: Any) -> Any:
        return self._pending.pop(id(block), None)

    # the shared side ----------------------------------------------------------------------------------
    def sites(self) -> list[Site]:
        return make_sites([(n, m, "self") for n, m in self.blocks])

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        for site in sites:
            src = self.probs_module(site.module)
            if src is not None:
                handle = src.register_forward_hook(self._keep(id(site.module)))
                stack.callback(handle.remove)
        stack.callback(self._pending.clear)
        super().install(stack, recorder, sites)

    def _keep(self, key: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._pending[key] = output

        return hook

    def extract(self, site: Site, args: tuple, output: Any) -> Any:
        P = self.window_probs(site.module, output)
        if not isinstance(P, torch.Tensor):
            return None
        H, W = self.block_grid(site.module, args)
        ids = self.window_ids(site.module, H, W)
        if P.ndim != 4 or P.shape[0] % ids.shape[0] or tuple(P.shape[-2:]) != (ids.shape[1], ids.shape[1]):
            raise _checks.CaptureError(
                f"Swin block {site.name!r}: window attention of shape {tuple(P.shape)} does not match its "
                f"{ids.shape[0]} windows of {ids.shape[1]} tokens on a {H}x{W} grid"
            )
        self._grids[site.layer] = (H, W)
        if P.requires_grad:
            P.retain_grad()  # record.gradients() reads it
            self._native[site.layer] = (P, lambda g, ids=ids, n=H * W: scatter_windows(g, ids, n, renorm=False))
        return scatter_windows(P, ids, H * W)

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        L = len(record.streams["self"])
        grids = [self._grids[i] for i in range(L)]
        record.prefix, record.grid = 0, grids[0]
        record.extra["self_merges"] = stage_merges(grids)
        record.extra["stage_grids"] = grids
        if self._native:
            record.extra["native"] = {("self", i): v for i, v in self._native.items()}
        self._native = {}

    def stream_kind(self, stream: str, record: AttentionRecord, inputs: dict[str, Any]) -> str:
        return "image"

    def stream_infos(self, record: AttentionRecord, inputs: dict[str, Any]) -> dict[str, StreamInfo]:
        infos = super().stream_infos(record, inputs)
        info = infos["self"]
        info.merges = record.extra["self_merges"]
        info.causal = False
        last = record.streams["self"][-1]
        spec, source = self.readout_spec("self", record, info, inputs)
        info.readout, info.readout_reason = None, ""
        if spec is None:
            info.readout_reason = source
        else:
            info.readout = resolve_readout(spec, batch=last.shape[0], n=last.shape[-1], mask=None, source=source)
        return infos


class SwinHFAdapter(_SwinAdapter):
    """transformers Swin, SwinV2, Donut-Swin and MaskFormer-Swin (see the module docstring)."""

    main_inputs = ("pixel_values",)
    inputs_example = (
        "For example inputs = processor(images, return_tensors='pt') or {'pixel_values': (B, 3, H, W) tensor}."
    )

    def __init__(self, model: nn.Module):
        import transformers

        check_transformers_version(transformers.__version__)
        blocks = _hf_layers(model)
        if not blocks:
            raise _checks.UnsupportedModelError(f"{type(model).__name__}: found no Swin window-attention layer")
        super().__init__(model, blocks)
        self.model_type = getattr(model.config, "model_type", "")
        self.family = f"hf:{self.model_type}"

    def probs_module(self, block: nn.Module) -> nn.Module | None:
        # SwinV2 / Donut / MaskFormer: attention.self.dropout(probs) is what multiplies the values; Swin (v1)
        # returns its eager kernel's probabilities as the layer's second output.
        drop = getattr(getattr(block.attention, "self", None), "dropout", None)
        return drop if isinstance(drop, nn.Dropout) else None

    def window_probs(self, block: nn.Module, output: Any) -> Any:
        if self.probs_module(block) is not None:
            return super().window_probs(block, output)
        return output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None

    def block_grid(self, block: nn.Module, args: tuple) -> tuple[int, int]:
        return int(args[1][0]), int(args[1][1])

    def window_ids(self, block: nn.Module, H: int, W: int) -> torch.Tensor:
        return hf_window_ids(block, H, W)

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        for config in all_configs(self.model):
            force_eager(stack, config)
        super().install(stack, recorder, sites)

    def readout_spec(self, stream: str, record: AttentionRecord, info: Any, inputs: dict[str, Any]) -> tuple[Any, str]:
        return "mean", f"{self.model_type}: the pooler averages the last stage's tokens (AdaptiveAvgPool1d)"

    def facts(self) -> ModelFacts:
        return hf_facts(self.model, self.family)


class SwinTimmAdapter(_SwinAdapter):
    """timm SwinTransformer and SwinTransformerV2 (see the module docstring)."""

    inputs_example = "For example inputs = a (B, 3, H, W) float tensor of preprocessed images."

    def __init__(self, model: nn.Module):
        blocks = _timm_blocks(model)
        if not blocks:
            raise _checks.UnsupportedModelError(f"timm model {type(model).__name__}: found no Swin window block")
        super().__init__(model, blocks)
        self.family = f"timm:{type(model).__name__}"

    def probs_module(self, block: nn.Module) -> nn.Module | None:
        return block.attn.attn_drop  # its output is the softmax as multiplied with the values

    def block_grid(self, block: nn.Module, args: tuple) -> tuple[int, int]:
        return int(args[0].shape[1]), int(args[0].shape[2])  # blocks take (B, H, W, C)

    def window_ids(self, block: nn.Module, H: int, W: int) -> torch.Tensor:
        return timm_window_ids(block, H, W)

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        for _, block in self.blocks:
            if hasattr(block.attn, "fused_attn"):
                set_attr_temporarily(stack, block.attn, "fused_attn", False)
        super().install(stack, recorder, sites)

    def readout_spec(self, stream: str, record: AttentionRecord, info: Any, inputs: dict[str, Any]) -> tuple[Any, str]:
        pool = getattr(self.model, "global_pool", "avg")
        if pool in ("avg", ""):
            return "mean", f"timm global_pool={pool!r}: the mean of the last stage's tokens"
        return None, (f"timm global_pool={pool!r} takes a maximum over tokens, which is no weighted set of rows: "
                      "pass readout= ('mean', a position or a weight vector over the last stage's tokens)")

    def facts(self) -> ModelFacts:
        return ModelFacts(family=self.family, input_key="x", keyword_call=False)


def make_adapter(model: nn.Module) -> Adapter:
    """The Swin adapter of a transformers or timm Swin model."""
    return SwinTimmAdapter(model) if type(model).__module__.startswith("timm.") else SwinHFAdapter(model)
