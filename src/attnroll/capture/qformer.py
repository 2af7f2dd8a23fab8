"""BLIP-2 and InstructBLIP: the Q-Former stage between the vision tower and the language model.

The language model's image tokens (found where ``input_ids`` holds ``config.image_token_id``; Q per image, in the
order the model scatters them) are the Q-Former's Q learned queries after its layers, projected. Each Q-Former
layer runs self-attention over the queries (InstructBLIP: the queries and the instruction's tokens,
``qformer_input_ids``), then, in every ``cross_attention_frequency``-th layer, the queries' cross-attention to the
vision tower's last hidden state (every vision token, CLS included), each with a residual connection.

Streams: "vision" (the tower), "qformer" (its self-attention, batch = the images, Q (+ L instruction) tokens),
"language"; the cross-attention layers' probabilities (images, heads, Q, vision tokens) are kept beside them in
``record.extra["qformer_cross"]`` (a stream is one square token-to-token matrix per layer).

The stage, composed at capture from the captured attention with rollout's rule (mean over heads, the residual
as half of each step), over the sources [Q learned queries | vision tokens | L instruction tokens]:

    R  = [I_Q | 0 | 0] for the queries, [0 | 0 | I_L] for the instruction tokens
    self-attention:   R ← (½ Ā + ½ I) R                         (all Q + L rows)
    cross-attention:  R_q ← ½ R_q + ½ [0 | C̄ | 0]                (the query rows only)

Each query row sums to 1. Its vision part is the image token's link weights (pushed through the vision stream's
relevance by ``explain.linked``); its learned-query and instruction parts are kept as their own shares
(``StreamLink.kept``: the Explanation's ``extra["queries_share"]`` / ``["instruction_share"]`` and their
``_scores``), so image + prompt text + queries (+ instruction) add up to the language row's total. The stage
is the same for every method (the language row and the vision tower's relevance follow the method).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .. import _checks
from .hf import HFAdapter
from .hooks import Recorder, Site, make_sites
from .record import AttentionRecord, KeptShare, ModelFacts, StreamLink
from .vlm import VLMAdapter, composed_facts, image_token_id, is_vlm

__all__ = ["QFORMER_TYPES", "qformer_adapter", "qformer_facts", "QFormerAdapter", "qformer_rows"]

#: The families composed here.
QFORMER_TYPES = ("blip-2", "instructblip")


def is_qformer_vlm(model: nn.Module) -> bool:
    return (is_vlm(model) and getattr(model.config, "model_type", "") in QFORMER_TYPES
            and isinstance(getattr(model, "qformer", None), nn.Module))


def qformer_adapter(model: nn.Module) -> "QFormerAdapter | None":
    """The adapter of BLIP-2 / InstructBLIP (None for any other model); UnsupportedModelError when the config has
    no image token id (the image tokens could not be found)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", "") in QFORMER_TYPES and hasattr(model, "qformer") and image_token_id(cfg) is None:
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} ({cfg.model_type}) reads the image through a Q-Former whose query outputs replace "
            "the image tokens of input_ids, but config.image_token_index is None: the image tokens cannot be found. "
            "Load a checkpoint whose processor inserts image tokens (config.image_token_index set)")
    return QFormerAdapter(model) if is_qformer_vlm(model) else None


def qformer_facts(model: nn.Module) -> ModelFacts | None:
    return composed_facts(model) if is_qformer_vlm(model) else None


def qformer_rows(selfs: list[torch.Tensor], crosses: list[torch.Tensor], has_cross: list[bool],
                 Q: int) -> torch.Tensor:
    """(N, Q, Q + n_v + L): each query's shares over [learned queries | vision tokens | instruction tokens] after
    the Q-Former (the module docstring's rule). ``selfs``: per layer (N, H, Q + L, Q + L); ``crosses``: per
    cross-attention layer (N, H, Q, n_v); ``has_cross``: per layer, whether it has cross-attention."""
    if len(selfs) != len(has_cross) or sum(has_cross) != len(crosses):
        raise ValueError(f"{len(selfs)} self-attention layers, {len(crosses)} cross-attention layers, but the "
                         f"Q-Former's layers say {sum(has_cross)} of {len(has_cross)} have cross-attention")
    N, n = selfs[0].shape[0], selfs[0].shape[-1]
    L = n - Q
    n_v = crosses[0].shape[-1] if crosses else 0
    R = torch.zeros(N, n, Q + n_v + L, dtype=torch.float64)
    R[:, :Q, :Q] = torch.eye(Q, dtype=torch.float64)
    R[:, Q:, Q + n_v:] = torch.eye(L, dtype=torch.float64)
    crossing = iter(crosses)
    eye = torch.eye(n, dtype=torch.float64)
    for a, cross in zip(selfs, has_cross):
        R = (0.5 * _heads(a) + 0.5 * eye) @ R
        if cross:
            c = _heads(next(crossing))
            R[:, :Q] = 0.5 * R[:, :Q]
            R[:, :Q, Q:Q + n_v] += 0.5 * c
    return R[:, :Q].to(torch.float32)


def _heads(a: torch.Tensor) -> torch.Tensor:
    """(N, n_q, n_k) float64: the mean over heads (a 3-D tensor was fused at capture time)."""
    a = a.detach().double()
    return a.mean(dim=1) if a.ndim == 4 else a


class QFormerAdapter(VLMAdapter):
    """BLIP-2 / InstructBLIP: the streams "vision", "qformer", "language" (+ the cross-attention in extra); the
    language stream's image tokens linked to the vision tokens through the Q-Former stage (the module docstring)."""

    def __init__(self, model: nn.Module):
        HFAdapter.__init__(self, model)
        names = {id(m): n for n, m in model.named_modules()}
        parts = {"vision": names[id(model.vision_model)], "qformer": names[id(model.qformer)],
                 "language": names[id(model.language_model)]}

        def stream(name: str) -> str:
            for s, prefix in parts.items():
                if name.startswith(prefix + "."):
                    return s
            raise _checks.UnsupportedModelError(
                f"{type(model).__name__}: attention module {name!r} is in neither the vision tower, the Q-Former nor "
                "the language model; attnroll does not know how it joins the streams")

        crossing = [s for s in self._sites if ".crossattention." in s.name + "."]
        self.cross_modules = [s.module for s in crossing]
        self._sites = make_sites([(s.name, s.module, stream(s.name)) for s in self._sites if s not in crossing])
        self.family = f"hf:{self.model_type} (vlm, Q-Former)"

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        """The sites' hooks, and the cross-attention layers' probabilities (non-square: queries × vision tokens,
        kept beside the streams in ``record.extra["qformer_cross"]``)."""
        super().install(stack, recorder, sites)
        self.crossed: list[torch.Tensor] = []
        for module in self.cross_modules:
            handle = module.register_forward_hook(lambda m, a, out: self.crossed.append(out[1].detach()))
            stack.callback(handle.remove)

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        record.extra["qformer_cross"] = list(getattr(self, "crossed", []))
        super().metadata(record, inputs)

    def facts(self) -> ModelFacts:
        return qformer_facts(self.model) or super().facts()

    def feature_read(self, inputs: dict[str, Any], vision_layers: int) -> tuple[int, int]:
        return vision_layers, 0  # the Q-Former cross-attends to the last hidden state, CLS included

    def readout_spec(self, stream: str, record: AttentionRecord, info: Any, inputs: dict[str, Any]) -> tuple[Any, str]:
        if stream.startswith("qformer"):
            return "mean", "the Q-Former's query outputs (the language model reads every query)"
        return super().readout_spec(stream, record, info, inputs)

    def link(self, record: AttentionRecord, inputs: dict[str, Any]) -> StreamLink | str | None:
        """The image tokens' link weights over the vision tokens and their kept shares (learned queries,
        instruction), from the captured Q-Former attention."""
        if "vision" not in record.streams:
            return None
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return "the prompt was given as inputs_embeds: the image tokens are found from input_ids"
        Q = int(self.model.config.num_query_tokens)
        layers = list(self.model.qformer.encoder.layer)
        R = qformer_rows(record.streams["qformer"], record.extra.get("qformer_cross", []),
                         [bool(getattr(lay, "has_cross_attention", False)) for lay in layers], Q)
        N, n_v = R.shape[0], record.streams["vision"][0].shape[-1]
        where = (ids == image_token_id(self.model.config)).nonzero().cpu()  # row-major (prompt, position) order
        if where.shape[0] != N * Q:
            return (f"{where.shape[0]} image tokens in input_ids for {N} image(s) of {Q} query tokens each: the image "
                    "tokens do not match the Q-Former's queries")
        k = torch.arange(N * Q)
        rows = R.reshape(N * Q, -1)
        vision = rows[:, Q:Q + n_v]
        kk, v = torch.nonzero(vision, as_tuple=True)
        link = StreamLink(source="vision", example=where[kk, 0], position=where[kk, 1], item=kk // Q, token=v,
                          source_layers=len(record.streams["vision"]), weight=vision[kk, v])
        kept = [KeptShare("queries", where[k, 0], where[k, 1], rows[:, :Q])]
        if rows.shape[-1] > Q + n_v:
            kept.append(KeptShare("instruction", where[k, 0], where[k, 1], rows[:, Q + n_v:]))
        link.kept = tuple(kept)
        return link
