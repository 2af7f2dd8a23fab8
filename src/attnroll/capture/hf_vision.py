"""Where the patches are in a transformers vision stream: read from the model's embeddings, never guessed
from token counts.

The embeddings module of a vision stream holds the learned extra tokens as parameters — ``cls_token`` /
``class_embedding`` (CLS), ``distillation_token`` (DeiT, AST), ``register_tokens`` (DINOv2 with registers)
before the patches, ``detection_tokens`` after them (YOLOS) — and a ``Conv2d`` patch projection whose output
size on the actual input is the grid. The layout is accepted only when prefix + rows·cols + suffix is the
stream's token count; otherwise no grid, with the reason. ViTMAE's random masking shuffles the patches: with
``mask_ratio`` 0 the record is put back in patch order with the model's own ``ids_restore``; with masking
(a random subset of patches) there is no grid.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Embedding parameters that are tokens: name -> placed before ("prefix") or after ("suffix") the patches.
_TOKEN_PARAMS = (
    ("cls_token", "prefix"),
    ("class_embedding", "prefix"),
    ("distillation_token", "prefix"),
    ("register_tokens", "prefix"),
    ("detection_tokens", "suffix"),
)


def embeddings_of(model: nn.Module, stream: str) -> nn.Module | None:
    """The embeddings module of a vision stream: the first module named ``*embeddings`` that holds a
    Conv2d patch projection (under the vision tower for the "vision" stream, the encoder for "encoder")."""
    found = []
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1].endswith("embeddings") and any(isinstance(c, nn.Conv2d) for c in m.modules()):
            found.append((name, m))
    want = {"vision": "vision", "encoder": "encoder"}.get(stream)
    for name, m in found:
        if want is None or want in name.split(".")[0] or want in name:
            return m
    return None


def _token_count(p: torch.Tensor) -> int:
    return 1 if p.ndim == 1 else int(p.shape[-2])


def token_affixes(emb: nn.Module) -> tuple[int, int]:
    """(prefix, suffix) token counts from the embeddings' own token parameters."""
    counts = {"prefix": 0, "suffix": 0}
    for pname, where in _TOKEN_PARAMS:
        p = getattr(emb, pname, None)
        if isinstance(p, torch.Tensor):
            counts[where] += _token_count(p)
    return counts["prefix"], counts["suffix"]


def conv_grid(emb: nn.Module, size: tuple[int, int]) -> tuple[int, int]:
    """Output rows, cols of the first Conv2d of the embeddings on a (H, W) input."""
    conv = next(c for c in emb.modules() if isinstance(c, nn.Conv2d))
    out = []
    for i, s in enumerate(size):
        k, st, pad, dil = conv.kernel_size[i], conv.stride[i], conv.padding, conv.dilation[i]
        pad_i = pad[i] if isinstance(pad, tuple) else 0
        out.append((s + 2 * pad_i - dil * (k - 1) - 1) // st + 1)
    return out[0], out[1]


def input_size(model_type: str, inputs: dict[str, Any]) -> tuple[int, int] | None:
    """The (H, W) the patch projection sees: pixels (B, C, H, W); AST's spectrogram (B, time, freq) is
    transposed to (freq, time) before its projection."""
    px = inputs.get("pixel_values")
    if isinstance(px, torch.Tensor) and px.ndim == 4:
        return int(px.shape[-2]), int(px.shape[-1])
    iv = inputs.get("input_values")
    if model_type == "audio-spectrogram-transformer" and isinstance(iv, torch.Tensor) and iv.ndim == 3:
        return int(iv.shape[-1]), int(iv.shape[-2])
    return None


#: ``patch_layout``'s default: look the embeddings module up.
_LOOK_UP: Any = object()


def patch_layout(model: nn.Module, stream: str, model_type: str, inputs: dict[str, Any], n: int,
                 emb: Any = _LOOK_UP) -> dict[str, Any]:
    """{"prefix", "suffix", "grid", "reason"} of a vision stream with n tokens ("grid" None with a reason
    when the layout does not account for every token); ``emb``: ``embeddings_of(model, stream)`` when the
    caller has it."""
    if emb is _LOOK_UP:
        emb = embeddings_of(model, stream)
    size = input_size(model_type, inputs)
    if emb is None or size is None:
        return {"prefix": 0, "suffix": 0, "grid": None, "reason": "no patch embedding found for this stream"}
    prefix, suffix = token_affixes(emb)
    grid = conv_grid(emb, size)
    mask_ratio = getattr(getattr(model, "config", None), "mask_ratio", None)
    if model_type == "vit_mae" and mask_ratio:
        why = (f"ViTMAE masks a random {mask_ratio:.0%} of the patches (config.mask_ratio={mask_ratio}): the kept "
               "tokens are a random subset in a random order, so there is no patch grid")
        return {"prefix": prefix, "suffix": 0, "grid": None, "reason": why,
                "units_reason": why + " and no fixed patch behind a token position; set model.config.mask_ratio = "
                                      "0.0 to explain every patch in patch order"}
    if prefix + grid[0] * grid[1] + suffix != n:
        return {"prefix": prefix, "suffix": suffix, "grid": None,
                "reason": f"{n} tokens, but the embeddings give {prefix} prefix + {grid[0]}x{grid[1]} patches + "
                          f"{suffix} suffix tokens"}
    return {"prefix": prefix, "suffix": suffix, "grid": grid, "reason": ""}


def mae_restore(layers: list[torch.Tensor], ids_restore: torch.Tensor, prefix: int) -> list[torch.Tensor]:
    """Put ViTMAE's shuffled patch tokens back in patch order: patch p sits at position prefix +
    ids_restore[b, p]; rows and columns are permuted alike. Layers are (B, H, n, n) or head-fused (B, n, n)."""
    B, N = ids_restore.shape
    perm = torch.cat([torch.arange(prefix).expand(B, prefix), prefix + ids_restore.cpu()], dim=1)  # (B, n)
    out = []
    for t in layers:
        fused = t.ndim == 3
        t = t[:, None] if fused else t
        idx = perm.to(t.device)
        rows = idx[:, None, :, None].expand(B, t.shape[1], -1, t.shape[-1])
        t = t.gather(2, rows)
        cols = idx[:, None, None, :].expand(B, t.shape[1], t.shape[2], -1)
        t = t.gather(3, cols)
        out.append(t[:, 0] if fused else t)
    return out
