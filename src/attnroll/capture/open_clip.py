"""open_clip adapter: ``open_clip.model.CLIP`` / ``CustomTextCLIP`` (image and text towers) and the towers
alone (``open_clip.transformer.VisionTransformer`` / ``TextTransformer``).

Their attention is ``torch.nn.MultiheadAttention`` (called with ``need_weights=False``), read as the torch
adapter reads it (:class:`~attnroll.capture.torch_mha.MHAAdapter`: fast path off, each module's forward
wrapped for the duration of the capture). What this adapter adds is what the torch adapter cannot know:

- the two towers are two streams, "vision" (``visual.transformer.resblocks.*``) and "text" (the text
  transformer's ``resblocks``), instead of one stack of layers of different sizes;
- the vision stream's class token (prefix 1) and its patch grid, from the pixels and the patch size;
- the rows each tower's output reads (the readout): vision: the class token (``pool_type='tok'``), the mean of
  the patch rows (``'avg'``), or, with an attention pooler, the pooler's own attention over the tokens (its
  first query for ``'tok'``, the mean of the others for ``'avg'``; the contrastive pooler's query for the
  ``'parallel'`` variant, composed with the first pooler's attention for ``'cascade'``); text: the token the
  tower pools (``'argmax'``: the end-of-text token, the largest id; ``'eos'``: the first ``eos_id``;
  ``'first'`` / ``'last'``; the appended class token of a CoCa-style text tower);
- for the pair, the similarity ``logit_scale · image_features @ text_features.T (+ logit_bias)`` that the
  ``clip`` method explains.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .. import _checks
from .hooks import Recorder, Site, make_sites, set_attr_temporarily
from .record import AttentionRecord, ModelFacts
from .torch_mha import MHAAdapter

__all__ = ["is_open_clip", "OpenClipAdapter", "towers", "unsupported_tower"]

#: The open_clip classes the adapter reads: the dual-tower models and the towers alone.
MODELS = ("CLIP", "CustomTextCLIP")
TOWERS = {"VisionTransformer": "vision", "TextTransformer": "text"}


def is_open_clip(model: nn.Module) -> bool:
    """Any model class of the open_clip package (checked without importing it)."""
    return type(model).__module__.startswith("open_clip.")


def towers(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """stream -> (the tower's module path with a trailing dot, or "" for the model itself; the module that
    holds its ``transformer`` and its pooling settings)."""
    name = type(model).__name__
    if name in TOWERS:
        return {TOWERS[name]: ("", model)}
    out: dict[str, tuple[str, nn.Module]] = {}
    if isinstance(getattr(model, "visual", None), nn.Module):
        out["vision"] = ("visual.", model.visual)
    if isinstance(getattr(model, "text", None), nn.Module):
        out["text"] = ("text.", model.text)  # CustomTextCLIP
    elif hasattr(model, "token_embedding") and hasattr(model, "transformer"):
        out["text"] = ("", model)  # CLIP keeps its text tower's parts on itself
    return out


def unsupported_tower(model: nn.Module) -> str:
    """Why an open_clip model cannot be read ("" when it can): which tower is not a transformer of
    nn.MultiheadAttention layers, or which class is not one of the dual-tower models."""
    name = type(model).__name__
    if name not in MODELS and name not in TOWERS:
        return (f"is an open_clip {name}, not one of {', '.join(MODELS + tuple(TOWERS))}: attnroll reads the "
                "contrastive dual-tower models and their towers (CoCa's multimodal decoder is not read)")
    for stream, (path, tower) in towers(model).items():
        if not _resblocks(tower):
            return (f"has a {stream} tower {path.rstrip('.') or name} of type {type(tower).__name__} without "
                    "transformer.resblocks of nn.MultiheadAttention (a ResNet, timm or Hugging Face tower); "
                    "explain that tower's own model instead")
    return ""


def _resblocks(tower: nn.Module) -> list[nn.Module]:
    blocks = getattr(getattr(tower, "transformer", None), "resblocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return []
    return [b for b in blocks if isinstance(getattr(b, "attn", None), nn.MultiheadAttention)]


class OpenClipAdapter(MHAAdapter):
    family = "open_clip"
    main_inputs = ("image", "text", "x")
    inputs_example = ("For example inputs = {'image': preprocess(images) (B, 3, H, W), 'text': tokenizer(texts) "
                      "(B, context_length) ids} for CLIP, or the pixel / id tensor for a tower alone.")

    def __init__(self, model: nn.Module):
        reason = unsupported_tower(model)
        if reason:
            raise _checks.UnsupportedModelError(f"{type(model).__name__} {reason}")
        super().__init__(model)
        self.towers = towers(model)
        self.pool_attn: dict[str, torch.Tensor] = {}

    def sites(self) -> list[Site]:
        entries = []
        for stream, (path, tower) in self.towers.items():
            for i, block in enumerate(tower.transformer.resblocks):
                entries.append((f"{path}transformer.resblocks.{i}.attn", block.attn, stream))
        return make_sites(entries)

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        super().install(stack, recorder, sites)
        self.pool_attn = {}
        vision = self.towers.get("vision", (None, None))[1]
        for name in ("attn_pool", "attn_pool_contrastive"):
            pooler = getattr(vision, name, None)
            if isinstance(pooler, nn.Module) and isinstance(getattr(pooler, "attn", None), nn.MultiheadAttention):
                set_attr_temporarily(stack, pooler.attn, "forward", _pool_forward(pooler.attn, self.pool_attn, name))

    def stream_kind(self, stream: str, record: AttentionRecord, inputs: dict[str, Any]) -> str:
        return "image" if stream == "vision" else "text"

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        super().metadata(record, inputs)
        vision = self.towers.get("vision")
        px = inputs.get("image", inputs.get("x")) if vision is not None else None
        if vision is not None and isinstance(px, torch.Tensor) and "vision" in record.streams:
            ph, pw = _pair(getattr(vision[1], "patch_size", None) or vision[1].conv1.kernel_size)
            record.prefix = 1  # open_clip's VisionTransformer always prepends one class token
            record.grid = (px.shape[-2] // ph, px.shape[-1] // pw)
        ids = inputs.get("text", inputs.get("x")) if "text" in self.towers else None
        if isinstance(ids, torch.Tensor) and "text" in record.streams:
            record.extra["text_eot"] = self._pooled_positions(ids)

    def _pooled_positions(self, ids: torch.Tensor) -> list[int] | None:
        """The token position the text tower pools, per example (None: a fixed position, see readout_spec)."""
        tower = self.towers["text"][1]
        pool = getattr(tower, "text_pool_type", getattr(tower, "pool_type", "argmax"))
        if getattr(tower, "cls_emb", None) is not None or pool in ("first", "last"):
            return None
        if pool == "argmax":
            return ids.argmax(dim=-1).tolist()
        if pool == "eos":
            eos = getattr(tower, "text_eos_id", getattr(tower, "eos_id", None))
            return (ids == eos).int().argmax(dim=-1).tolist()
        return None

    def readout_spec(self, stream: str, record: AttentionRecord, info: Any, inputs: dict[str, Any]) -> tuple[Any, str]:
        n = record.streams[stream][0].shape[-1]
        if stream == "text":
            return self._text_readout(n, record)
        visual = self.towers["vision"][1]
        if getattr(visual, "attn_pool", None) is not None:
            return self._pool_readout(visual)
        pool = getattr(visual, "pool_type", "tok")
        if pool == "tok":
            return "cls", "open_clip VisionTransformer pool_type='tok': the class token"
        if pool == "avg":
            return "mean", "open_clip VisionTransformer pool_type='avg': the mean of the patch tokens"
        return None, "open_clip VisionTransformer pool_type='none' returns every token: pass readout="

    def _text_readout(self, n: int, record: AttentionRecord) -> tuple[Any, str]:
        tower = self.towers["text"][1]
        pool = getattr(tower, "text_pool_type", getattr(tower, "pool_type", "argmax"))
        if getattr(tower, "cls_emb", None) is not None:
            return n - 1, "open_clip text tower with an appended class token: it pools the last position"
        if pool == "first":
            return "cls", "open_clip text tower pool_type='first': the first position"
        if pool == "last":
            return n - 1, "open_clip text tower pool_type='last': the last position"
        if pool in ("argmax", "eos") and record.extra.get("text_eot") is not None:
            what = "the end-of-text token (the largest id)" if pool == "argmax" else "the first eos_id token"
            return "eot", f"open_clip text tower pool_type={pool!r}: {what}"
        return None, f"open_clip text tower pool_type={pool!r} pools no single token: pass readout="

    def _pool_readout(self, visual: nn.Module) -> tuple[Any, str]:
        """The attention pooler's own attention over the tokens, as the pooled vector reads it."""
        first = self.pool_attn.get("attn_pool")
        if first is None:
            return None, "the attention pooler did not run: pass readout="
        second = self.pool_attn.get("attn_pool_contrastive")
        kind = getattr(visual, "attn_pool_type", "")
        if kind == "parallel" and second is not None:
            return ("attention_pool", second[:, 0]), "open_clip 'parallel' pooler: the contrastive query's attention"
        if kind == "cascade" and second is not None:
            w = (second[:, :1] @ first)[:, 0]  # (B, 1, Q) @ (B, Q, n): the contrastive query through the first pooler
            return ("attention_pool", w), "open_clip 'cascade' poolers: the contrastive query's attention composed " \
                                          "with the first pooler's"
        pool = getattr(visual, "pool_type", "tok")
        if pool == "tok":
            return ("attention_pool", first[:, 0]), "open_clip attention pooler, pool_type='tok': its first query"
        if pool == "avg":
            return ("attention_pool", first[:, 1:].mean(dim=1)), ("open_clip attention pooler, pool_type='avg': the "
                                                                  "mean of its other queries")
        return None, "open_clip attention pooler with pool_type='none' returns every query: pass readout="

    def facts(self) -> ModelFacts:
        m = self.model
        dual = type(m).__name__ in MODELS and set(self.towers) == {"vision", "text"}
        text = self.towers.get("text", (None, None))[1]
        embedding = getattr(text, "token_embedding", None)
        if type(m).__name__ in TOWERS:
            return ModelFacts(family=self.family, input_key=None, keyword_call=False,
                              embedding=embedding if isinstance(embedding, nn.Module) else None)
        return ModelFacts(family=self.family, input_key="image" if "vision" in self.towers else "text",
                          keyword_call=True, embedding=embedding if isinstance(embedding, nn.Module) else None,
                          similarity=similarity if dual else None,
                          stream_inputs={"vision": "image", "text": "text"} if dual else {})


def similarity(outputs: Any) -> torch.Tensor:
    """(images, texts) logits of an open_clip forward: ``logit_scale · image_features @ text_features.T``, plus
    ``logit_bias`` when the model has one (SigLIP-style); from its tuple or its dict (``output_dict=True``)."""
    if isinstance(outputs, dict):
        img, txt, scale, bias = (outputs.get(k) for k in ("image_features", "text_features", "logit_scale",
                                                          "logit_bias"))
    else:
        img, txt, scale = outputs[:3]
        bias = outputs[3] if len(outputs) > 3 else None
    if img is None or txt is None:
        raise ValueError("the similarity needs both towers: pass inputs {'image': pixels, 'text': token ids}")
    logits = scale * img @ txt.T
    return logits + bias if bias is not None else logits


def _pair(x: Any) -> tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, (tuple, list)) else (int(x), int(x))


def _pool_forward(module: nn.MultiheadAttention, store: dict[str, torch.Tensor], name: str):
    """The pooler's MultiheadAttention forward, keeping its attention (B, queries, n) averaged over heads."""
    original = module.forward

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        out, w = original(query, key, value, key_padding_mask=key_padding_mask, need_weights=True,
                          attn_mask=attn_mask, average_attn_weights=False, is_causal=is_causal)
        mean = w.mean(dim=-3)  # (B, H, queries, n) -> (B, queries, n); unbatched (H, q, n) -> (q, n)
        store[name] = (mean if mean.ndim == 3 else mean.unsqueeze(0)).detach().float().cpu()
        if not need_weights:
            return out, None
        return out, (mean if average_attn_weights else w)

    return forward
