"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (transformers ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``): what their
attention kernels saw, for the matrix-free composition of the language model with the vision tower.

The vision tower packs every image of a call into one sequence and runs its attention kernel once per chunk
of ``cu_seqlens`` (per image; Qwen2.5-VL: per window in the layers outside ``fullatt_block_indexes``; a
varlen flash kernel gets all chunks in one call with ``cu_seq_lens_q``). No kernel returns probabilities, so
nothing dense is recorded: the capture wraps transformers' attention interface (as
:mod:`attnroll.capture.recompute` does) and keeps each call's queries and keys after the rotary embedding
(values and the output for gradient rules), per layer as a :class:`~attnroll.core.chunked.ChunkedLayer`.
The language model's kernels are kept one per layer (M-RoPE acts on q and k only, which are kept as
rotated).

Geometry, read by the model's own functions on the ``grid_thw`` its vision tower was called with:

- the tower's sequence order: the processor lays each image's patches out block-major over the
  ``spatial_merge_size``² merge blocks; Qwen2.5-VL then reorders merge blocks window by window
  (``get_vision_window_index``) before the first block and undoes it after the merger. ``tower_of`` maps
  each token of the original order to its place in the tower's sequence;
- each token's (row, column) on its image's patch grid: the rotary position ids (``get_vision_position_ids``);
- the merger: language image token k (row-major over ``input_ids == image_token_id``, the order
  ``masked_scatter`` fills) is merge block k of the original order, made of its m² tokens (``units``).

Qwen3-VL's deepstack mergers read the tower after the blocks ``deepstack_visual_indexes`` and add to the image
tokens' hidden states in the first language layers (``deepstack``).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _checks
from .._modes import eval_mode, params_require_grad
from ..core.chunked import ChunkedLayer, split_call
from ..core.operators import KernelInputs, whole_size
from .qwen_family import REFUSAL, TYPES, is_qwen_vl, qwen_facts, towers
from .recompute import LseWatch, _arguments, _signature, kernel_inputs
from .transformers_private import wrap_attention_interface

__all__ = ["TYPES", "is_qwen_vl", "towers", "QwenRecord", "Geometry", "capture_qwen_vl", "attach_gradients",
           "vision_layers", "qwen_facts", "REFUSAL"]

@dataclass
class Geometry:
    """Where the vision tower's tokens sit. N tokens, K = N / m merged tokens (m = spatial_merge_size²).

    ``grids`` (t, h, w) per image (patches); ``tower_of`` (N,) tower position of each token of the original
    (processor) order; ``hw`` (N, 2) its (row, column) on its image's grid; ``item`` (N,) its image;
    ``units`` (K, m) tower positions of each merged token's sources (merged tokens in language order)."""

    grids: list[tuple[int, int, int]]
    tower_of: torch.Tensor
    hw: torch.Tensor
    item: torch.Tensor
    units: torch.Tensor
    windowed: bool = False


@dataclass
class QwenRecord:
    """One forward pass: the model's outputs, the language layers (B, H, n, d) per layer, the vision layers
    as chunks of the packed sequence, the link of the language image tokens ((example, position) per merged
    token, language order), the padding mask and the geometry."""

    outputs: Any
    language: list[KernelInputs]
    vision: list[ChunkedLayer]
    mask: torch.Tensor | None
    input_ids: torch.Tensor
    geometry: Geometry | None
    example: torch.Tensor
    position: torch.Tensor
    deepstack: tuple[int, ...] = ()
    model_type: str = ""
    pending: dict[str, list] = field(default_factory=dict)  # kernel outputs + vision calls, until finished


def _check_inputs(model: nn.Module, inputs: Any) -> None:
    if not isinstance(inputs, dict) or not isinstance(inputs.get("input_ids"), torch.Tensor):
        raise ValueError(f"{type(model).__name__}: inputs must be the processor's dict with input_ids (the image "
                         f"tokens are found there), got {type(inputs).__name__} without input_ids")
    if inputs.get("pixel_values_videos") is not None:
        raise ValueError(f"{type(model).__name__}: video inputs (pixel_values_videos) are not composed: attnroll maps "
                         "images (one temporal patch per image); pass images")
    if inputs.get("pixel_values") is not None and inputs.get("image_grid_thw") is None:
        raise ValueError(f"{type(model).__name__}: pixel_values without image_grid_thw; pass the processor's output")


class _Recorder:
    """The kernel wrapper's side: per attention module its stream and layer; the calls of one pass."""

    def __init__(self, model: nn.Module, keep_grad: bool):
        visual, language = towers(model)
        self.keep_grad = keep_grad
        self.site: dict[int, tuple[str, int]] = {}
        for i, blk in enumerate(visual.blocks):
            self.site.update({id(m): ("vision", i) for m in blk.attn.modules()})
        for i, lay in enumerate(language.layers):
            self.site.update({id(m): ("language", i) for m in lay.self_attn.modules()})
        self.vision_layers, self.language_layers = len(visual.blocks), len(language.layers)
        self.calls: dict[str, list[list]] = {"vision": [[] for _ in visual.blocks],
                                             "language": [[] for _ in language.layers]}
        self.grid_thw: torch.Tensor | None = None

    def wrap(self, kernel: Any, impl: str) -> Any:
        if self in getattr(kernel, "_attnroll_wrappers", ()):
            return kernel
        base = getattr(kernel, "_attnroll_kernel", kernel)
        sig = _signature(base)

        def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            where = self.site.get(id(module))
            if where is None:
                return kernel(module, *args, **kwargs)
            bound = sig.bind(module, *args, **kwargs) if sig is not None else None
            arguments = _arguments(bound, args, kwargs)
            layer = kernel_inputs(module, impl, arguments, self.keep_grad)
            if whole_size(layer) or arguments.get("cu_seq_lens_q") is not None:
                out = kernel(module, *args, **kwargs)
            else:  # the fused kernel's own row log-sum-exp, which SDPA drops (see recompute.LseWatch)
                with LseWatch() as watch:
                    out = kernel(module, *args, **kwargs)
                layer.lse = watch.lse(layer.shape)
            o = out[0] if isinstance(out, (tuple, list)) else out
            cu = arguments.get("cu_seq_lens_q")
            self.calls[where[0]][where[1]].append((layer, o, None if cu is None else [int(x) for x in cu.tolist()]))
            return out

        call._attnroll_kernel = base  # type: ignore[attr-defined]
        call._attnroll_wrappers = (*getattr(kernel, "_attnroll_wrappers", ()), self)  # type: ignore[attr-defined]
        return call

    def grid_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self.grid_thw = grid.detach().cpu() if isinstance(grid, torch.Tensor) else None


def capture_qwen_vl(model: nn.Module, inputs: dict[str, Any], *, keep_grad: bool = False) -> QwenRecord:
    """One forward pass of a Qwen VL ``model`` under its own attention kernels; the :class:`QwenRecord`. With
    ``keep_grad`` the pass runs with autograd (the kernels' outputs stay in the graph for
    :func:`attach_gradients`; call it before reading the vision layers)."""
    if not is_qwen_vl(model):
        raise _checks.UnsupportedModelError(f"{type(model).__name__} is not a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model")
    _check_inputs(model, inputs)
    rec = _Recorder(model, keep_grad)
    visual, _ = towers(model)
    with ExitStack() as stack:
        stack.enter_context(eval_mode(model))
        if keep_grad:
            stack.enter_context(params_require_grad(model, partly=True))
        wrap_attention_interface(stack, rec.wrap)
        handle = visual.register_forward_pre_hook(rec.grid_hook, with_kwargs=True)
        stack.callback(handle.remove)
        with torch.enable_grad() if keep_grad else torch.no_grad():
            outputs = model(**inputs)
    return _record(model, inputs, rec, outputs)


def _record(model: nn.Module, inputs: dict[str, Any], rec: _Recorder, outputs: Any) -> QwenRecord:
    """The record of the pass: every layer called once (the vision tower's per chunk), the link, the geometry."""
    lang = rec.calls["language"]
    if any(len(c) != 1 for c in lang):
        raise _checks.CaptureError(
            f"{type(model).__name__}: each language layer's attention kernel must run once per pass through "
            f"transformers' attention interface; calls per layer: {[len(c) for c in lang]}")
    vision_ran = any(rec.calls["vision"])
    if vision_ran and not all(rec.calls["vision"]):
        raise _checks.CaptureError(f"{type(model).__name__}: some vision layers' kernels did not go through "
                                   "transformers' attention interface")
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    cfg = model.config
    where = (ids == cfg.image_token_id).nonzero().cpu()
    geometry = _geometry(model, rec.grid_thw) if vision_ran and rec.grid_thw is not None else None
    if geometry is not None and where.shape[0] != geometry.units.shape[0]:
        raise _checks.CaptureError(
            f"{type(model).__name__}: {where.shape[0]} image tokens in input_ids for {geometry.units.shape[0]} merged "
            "vision tokens: the image tokens do not match the merger's output one to one")
    deep = tuple(getattr(towers(model)[0], "deepstack_visual_indexes", None) or ())
    return QwenRecord(
        outputs=outputs, language=[c[0][0] for c in lang], vision=[], input_ids=ids.detach().cpu(),
        mask=None if not isinstance(mask, torch.Tensor) else mask.detach().cpu().long(), geometry=geometry,
        example=where[:, 0], position=where[:, 1], deepstack=deep, model_type=cfg.model_type,
        pending={"language_out": [c[0][1] for c in lang], "vision_calls": rec.calls["vision"] if vision_ran else []},
    )


def _geometry(model: nn.Module, grid_thw: torch.Tensor) -> Geometry:
    """The vision tower's token geometry from the model's own position and window functions."""
    from transformers import vision_utils

    visual, _ = towers(model)
    merge = int(visual.spatial_merge_size)
    m = merge * merge
    grids = [tuple(int(x) for x in g) for g in grid_thw.tolist()]
    video = [g for g in grids if g[0] != 1]
    if video:
        raise ValueError(f"{type(model).__name__}: grids {video} have several temporal patches (video frames); "
                         "attnroll maps images (t = 1)")
    hw = vision_utils.get_vision_position_ids(grid_thw, merge).long()
    N = hw.shape[0]
    windowed = getattr(model.config, "model_type", "") == "qwen2_5_vl"
    if windowed:
        index, _ = vision_utils.get_vision_window_index(grid_thw, spatial_merge_size=merge,
                                                        window_size=visual.window_size, patch_size=visual.patch_size)
        order = (index.long()[:, None] * m + torch.arange(m)).reshape(-1)  # tower position -> original token
        tower_of = torch.argsort(order)
    else:
        tower_of = torch.arange(N)
    item = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor([t * h * w for t, h, w in grids]))
    units = tower_of[torch.arange(N).reshape(-1, m)]
    return Geometry(grids=grids, tower_of=tower_of, hw=hw, item=item, units=units, windowed=windowed)


def attach_gradients(record: QwenRecord, y: torch.Tensor) -> None:
    """dy/dO of every kernel output of the pass, stored on its layer as ``grad_out`` (B, H, n, d_v)."""
    calls = [c for layer in record.pending.get("vision_calls", []) for c in layer]
    outs = list(record.pending["language_out"]) + [o for _, o, _ in calls]
    layers = list(record.language) + [lay for lay, _, _ in calls]
    grads = torch.autograd.grad(y.sum(), outs, allow_unused=True)
    for lay, o, g in zip(layers, outs, grads):
        B, H, nq, _ = lay.shape
        g = torch.zeros_like(o) if g is None else g.detach()
        lay.grad_out = g.reshape(B, nq, H, -1).transpose(1, 2)  # kernels return (B, n, H, d_v)


def vision_layers(record: QwenRecord) -> list[ChunkedLayer]:
    """The vision layers as chunks of the packed sequence (built once, after any gradients were attached)."""
    if not record.vision and record.pending.get("vision_calls"):
        N = int(record.geometry.tower_of.shape[0]) if record.geometry is not None else None
        out = []
        for calls in record.pending["vision_calls"]:
            chunks, at = [], 0
            for lay, _, cu in calls:
                n = lay.shape[2]
                chunks += split_call(lay, cu if cu is not None else [0, n], at)
                at += n
            out.append(ChunkedLayer(at if N is None else N, chunks))
        record.vision = out
    return record.vision
