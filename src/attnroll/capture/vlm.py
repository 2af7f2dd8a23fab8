"""Vision-language models whose image tokens are the vision tower's tokens one to one: LLaVA (``llava``) and
PaliGemma (``paligemma``).

Streams: "vision" (the vision tower, batch = the images) and "language" (the language model, batch = the
prompts, its sequence holding image tokens and text tokens). Not "text": that name is a text-only tower's
(CLIP); the language sequence also carries the image.

The link (``StreamInfo.link`` of "language"): the image tokens are found where ``input_ids`` holds the
model's own ``config.image_token_id`` (never by counting), and matched to vision tokens the way the model
scatters its image features (``masked_scatter``: image tokens in row-major (prompt, position) order take the
projected features of image 0, then image 1, ...). Per image the projector reads:

- LLaVA: ``hidden_states[vision_feature_layer]`` of the vision tower (so only that many layers: -2 = all but
  the last), with ``vision_feature_select_strategy`` "default" dropping the first (CLS) token, "full" keeping
  it; the call's own ``vision_feature_layer=`` / ``vision_feature_select_strategy=`` override the config. A
  list of feature layers (features concatenated across layers) has no one-to-one link: refused for the
  composition, with the reason.
- PaliGemma: the last hidden state of its SigLIP tower, every token (SigLIP has no CLS).

Qwen2-VL / Qwen2.5-VL / Qwen3-VL have their own adapter (``capture/qwen_vl.py``). Refused with the reason:
LLaVA-NeXT-Video (its video frames are pooled). The VLMs whose image tokens mix vision tokens (pixel shuffle,
pooling, tiles) are mapped in ``capture/vlm_maps.py`` and ``capture/vlm_tiles.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _checks
from .hf import HFAdapter, first_argument, hf_facts, is_hf_model
from .hooks import make_sites
from .record import AttentionRecord, ModelFacts, StreamInfo, StreamLink, resolve_readout

#: The families composed here.
COMPOSED = ("llava", "paligemma")

_ANYRES = (
    "its any-resolution input splits each image into tiles whose features are unpadded and interleaved with a "
    "learned newline token per row, so the image tokens are not one patch grid of the vision tower"
)
#: VLM families refused, with the reason.
REFUSED = {
    "llava_next_video": _ANYRES + " (and its video frames are pooled)",
}

#: token_type_ids of a generated token where it is not the prompt's last value repeated (transformers'
#: generation): PaliGemma's answer is the causal suffix after its bidirectional prefix, 1.
GENERATED_TOKEN_TYPE = {"paligemma": 1}

#: The refusal of StreamInfo.link_reason when composition is not possible.
_NO_IDS = "the prompt was given as inputs_embeds: the image tokens are found from input_ids (config.image_token_id)"


def is_vlm(model: nn.Module) -> bool:
    """A transformers model whose config has an image token id and both a vision and a text sub-config."""
    cfg = getattr(model, "config", None)
    return is_hf_model(model) and image_token_id(cfg) is not None and (
        getattr(cfg, "vision_config", None) is not None and getattr(cfg, "text_config", None) is not None
    )


def image_token_id(config: Any) -> int | None:
    """The id of the image placeholder token the model replaces with image features (its own config)."""
    for key in ("image_token_id", "image_token_index"):
        v = getattr(config, key, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def vlm_adapter(model: nn.Module) -> "VLMAdapter | None":
    """The adapter of a composed VLM; None for a model that is not a VLM (or a VLM the generic transformers
    adapter refuses); UnsupportedModelError with the reason for the VLM families listed in :data:`REFUSED`."""
    if not is_vlm(model):
        return None
    mt = getattr(model.config, "model_type", "")
    if mt in COMPOSED:
        return VLMAdapter(model)
    if mt in REFUSED:
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} ({mt}) is a vision-language model that attnroll refuses: {REFUSED[mt]}. "
            f"attnroll composes {', '.join(COMPOSED)}; explain the language model alone with modules=/to_probs="
        )
    return None


def vlm_facts(model: nn.Module) -> ModelFacts | None:
    """The transformers facts of a composed VLM, with the reason it needs the dense route; None otherwise."""
    if not is_vlm(model) or getattr(model.config, "model_type", "") not in COMPOSED:
        return None
    return composed_facts(model)


def composed_facts(model: nn.Module) -> ModelFacts:
    """The transformers facts of a VLM whose streams attnroll composes (here or in ``capture.vlm_maps``)."""
    facts = hf_facts(model)
    facts.stream_inputs = {"vision": first_argument(model.get_image_features) or "pixel_values",
                           "language": getattr(model, "main_input_name", "input_ids")}
    facts.dense_only = ("a vision-language model's streams are composed from the dense eager record (the "
                        "recompute route has no vision-to-language link)")
    return facts


def towers(model: nn.Module) -> tuple[str, str]:
    """Qualified module names of the vision tower and the language model."""
    names = {id(m): n for n, m in model.named_modules()}
    for vision, language in (("vision_tower", "language_model"), ("vision_model", "text_model")):  # Idefics3
        base = model.model if hasattr(getattr(model, "model", None), vision) else model
        if hasattr(base, vision) and hasattr(base, language):
            return names[id(getattr(base, vision))], names[id(getattr(base, language))]
    raise _checks.UnsupportedModelError(f"{type(model).__name__}: no vision tower and language model found "
                                        "(vision_tower / language_model or vision_model / text_model)")


class VLMAdapter(HFAdapter):
    """LLaVA / PaliGemma: the transformers adapter with the vision tower and the language model as the
    streams "vision" and "language", and the language stream's link to the vision tokens."""

    composes_vlm = True

    def __init__(self, model: nn.Module):
        super().__init__(model)
        vision, language = towers(model)

        def stream(name: str) -> str:
            if name.startswith(vision + "."):
                return "vision"
            if name.startswith(language + "."):
                return "language"
            raise _checks.UnsupportedModelError(
                f"{type(model).__name__}: attention module {name!r} is in neither the vision tower ({vision}) nor "
                f"the language model ({language}); attnroll does not know how it joins the streams"
            )

        self._sites = make_sites([(s.name, s.module, stream(s.name)) for s in self._sites])
        self.family = f"hf:{self.model_type} (vlm)"

    def facts(self) -> ModelFacts:
        return vlm_facts(self.model) or super().facts()

    # ---------------------------------------------------------------------------------- the link
    def feature_read(self, inputs: dict[str, Any], vision_layers: int) -> tuple[int, int] | str:
        """(vision layers the projector's input has passed through, index of the first vision token it
        reads) or the reason there is no one-to-one link."""
        cfg = self.model.config
        if self.model_type == "paligemma":
            return vision_layers, 0  # last_hidden_state, every token (SigLIP has no CLS)
        layer = inputs.get("vision_feature_layer")
        layer = cfg.vision_feature_layer if layer is None else layer
        strategy = inputs.get("vision_feature_select_strategy") or cfg.vision_feature_select_strategy
        if not isinstance(layer, int) or isinstance(layer, bool):
            return (f"vision_feature_layer={layer!r}: the projector reads features concatenated across several "
                    "vision layers, so an image token is not one token of one vision layer")
        if not -(vision_layers + 1) <= layer <= vision_layers:
            return f"vision_feature_layer={layer} is outside the {vision_layers}-layer vision tower"
        if strategy not in ("default", "full"):
            return f"vision_feature_select_strategy={strategy!r} is neither 'default' nor 'full'"
        return layer % (vision_layers + 1), 1 if strategy == "default" else 0

    def link(self, record: AttentionRecord, inputs: dict[str, Any]) -> StreamLink | str | None:
        """The language stream's image tokens matched to (image, vision token); None without an image."""
        if "vision" not in record.streams:
            return None  # a text-only prompt: the vision tower did not run
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return _NO_IDS
        if inputs.get("image_sizes") is not None:
            return "image_sizes= splits the image features by size; attnroll links one fixed grid per image"
        n_images, n_v = record.streams["vision"][0].shape[0], record.streams["vision"][0].shape[-1]
        read = self.feature_read(inputs, len(record.streams["vision"]))
        if isinstance(read, str):
            return read
        layers, first = read
        where = (ids == image_token_id(self.model.config)).nonzero()  # row-major (prompt, position) order
        per_image = n_v - first
        if where.shape[0] != n_images * per_image:
            return (f"{where.shape[0]} image tokens in input_ids for {n_images} image(s) of {per_image} tokens "
                    "each: the image tokens do not match the vision tokens one to one")
        k = torch.arange(where.shape[0])
        return StreamLink(source="vision", example=where[:, 0].cpu(), position=where[:, 1].cpu(), item=k // per_image,
                          token=first + k % per_image, source_layers=layers)

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        super().metadata(record, inputs)
        record.extra["language_link"] = self.link(record, inputs)

    # ---------------------------------------------------------------------------------- the contract
    def stream_infos(self, record: AttentionRecord, inputs: dict[str, Any]) -> dict[str, StreamInfo]:
        infos = super().stream_infos(record, inputs)
        lang = infos.get("language")
        if lang is not None:
            mask = record.attention_mask
            B, n = record.streams["language"][0].shape[0], record.streams["language"][0].shape[-1]
            if isinstance(mask, torch.Tensor) and tuple(mask.shape) == (B, n):
                lang.mask = mask.detach().to(torch.long)
            link = record.extra.get("language_link")
            lang.link = link if isinstance(link, StreamLink) else None
            lang.link_reason = link if isinstance(link, str) else ""
            lang.kind = "text"
            spec, source = self.readout_spec("language", record, lang, inputs)
            lang.readout = resolve_readout(spec, batch=B, n=n, mask=lang.mask, source=source)
        if "vision" in infos:
            infos["vision"].tokens = None  # the token strings are the prompts'
        return infos

    def readout_spec(self, stream: str, record: AttentionRecord, info: Any, inputs: dict[str, Any]) -> tuple[Any, str]:
        if stream == "language":
            return "last", "the language model's next-token logit at the last real token of the prompt"
        read = self.feature_read(inputs, len(record.streams[stream]))
        first = read[1] if isinstance(read, tuple) else 0
        w = torch.zeros(record.streams[stream][0].shape[-1])
        w[first:] = 1.0
        return w, ("the projector reads these vision tokens (the language model weighs them; rollout, grad_rollout "
                   "and gae compose the two streams)")
