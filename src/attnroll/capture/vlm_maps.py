"""Vision-language models whose image tokens are fixed linear mixtures of vision tokens: the vision-to-language
map of each family read off the model's own code, so the composition (``explain.linked``) is exact.

Each image token of the language sequence (found where ``input_ids`` holds ``config.image_token_id``, in the
order the model scatters its features) is a row of a map F over (vision item, vision token). F is obtained by
running the family's own rearrangement on tagged inputs instead of features (one pass, no weights involved):

- token indices through a shuffle or merge (SmolVLM / Idefics3 and Aya Vision ``pixel_shuffle``, InternVL's
  ``pixel_shuffle``, Mistral 3's ``patch_merger`` unfold): each language token is the concatenation of s×s
  vision tokens' features, which its projector mixes with learned weights; the convention (as for Swin's
  patch merging, and rollout's α = ½) gives each source an equal share 1/s²;
- the identity through a pooling (Gemma 3's ``avg_pool``): the exact averaging matrix;
- VipLLaVA: every image token is one vision token read after several vision layers (``vision_feature_layer``
  a list) and concatenated; the rule: each read layer gets an equal share 1/J of the token, composed through
  the vision rollout up to that layer (``StreamLink.layers``);
- LLaVA-NeXT / LLaVA-OneVision: the tiles' features as one-hot tags through the model's own
  ``pack_image_features`` (tile rearrangement, unpadding, OneVision's bilinear down-sampling): the rows tell
  which tile token each image token is; the rows that come out 0 are the learned newline token.

Where the vision items are not the user's images (LLaVA-NeXT's base image + tiles), a ``Placement`` puts the
tiles back on the original image (see :mod:`capture.vlm_tiles`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .. import _checks
from .record import AttentionRecord, ModelFacts, Placement, StreamLink
from .vlm import VLMAdapter, composed_facts, image_token_id, is_vlm
from .vlm_split import flat_ints, layout_given, split_placement
from .vlm_tiles import anyres_map

__all__ = ["COMPOSED", "REFUSED", "ONE_VISION_SEQUENCE", "pixtral_views", "mapped_adapter", "mapped_facts",
           "MappedVLMAdapter", "tagged_groups", "read_input"]


class _Stop(Exception):
    """Raised by a pre-hook to stop a probe run once the tensor it wanted is seen."""


def read_input(module: nn.Module, run: Callable[[], Any]) -> torch.Tensor:
    """The first input ``module`` receives while ``run()`` runs (the run is stopped there)."""
    seen: list[torch.Tensor] = []

    def hook(_m, args):
        seen.append(args[0].detach())
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        run()
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise _checks.UnsupportedModelError(f"{type(module).__name__} was never called by the probe of the "
                                            "vision-to-language map")
    return seen[0]


def tagged_groups(tags: torch.Tensor, n: int) -> torch.Tensor:
    """A (T, n): rows of token tags (T, C) holding vision token index + 1 (the output of a shuffle or merge on
    a one-channel input of indices) as equal shares of their C sources."""
    tags = tags.reshape(tags.shape[0], -1).round().long() - 1
    if bool((tags < 0).any()) or bool((tags >= n).any()):
        raise _checks.UnsupportedModelError("the shuffle of the vision tokens produced tags that are not token "
                                            "indices; the vision-to-language map cannot be read")
    A = torch.zeros(tags.shape[0], n)
    A.scatter_add_(1, tags, torch.full(tags.shape, 1.0 / tags.shape[1]))
    return A


def _index_tags(n: int, side: bool = False) -> torch.Tensor:
    t = torch.arange(1, n + 1, dtype=torch.float32)
    if side:
        s = int(round(n ** 0.5))
        return t.reshape(1, s, s, 1)
    return t.reshape(1, n, 1)


# ------------------------------------------------------------------------------- per-family maps (T, n)
def _smolvlm_map(model: nn.Module, n: int, inputs: dict) -> torch.Tensor:
    connector = model.model.connector
    return tagged_groups(connector.pixel_shuffle(_index_tags(n), connector.scale_factor)[0], n)


def _aya_map(model: nn.Module, n: int, inputs: dict) -> torch.Tensor:
    out = model.model.multi_modal_projector.pixel_shuffle(_index_tags(n))
    return tagged_groups(out.reshape(-1, out.shape[-1]), n)


def _internvl_map(model: nn.Module, n: int, inputs: dict) -> torch.Tensor:
    out = model.model.pixel_shuffle(_index_tags(n, side=True), scale_factor=model.config.downsample_ratio)
    return tagged_groups(out.reshape(-1, out.shape[-1]), n)


def _gemma3_map(model: nn.Module, n: int, inputs: dict) -> torch.Tensor:
    proj = model.model.multi_modal_projector
    pooled = read_input(proj.mm_soft_emb_norm, lambda: proj(torch.eye(n)[None]))
    return pooled[0].to(torch.float32)


def _mistral3_map(model: nn.Module, n: int, inputs: dict) -> torch.Tensor:
    merger = model.model.multi_modal_projector.patch_merger
    tags = read_input(merger.merging_layer, lambda: merger(_index_tags(n)[0], inputs["image_sizes"]))
    return tagged_groups(tags, n)


def _identity_map(model: nn.Module, n: int, inputs: dict) -> torch.Tensor:
    return torch.eye(n)


#: model_type -> (T, n) map of one image's language tokens over its n read vision tokens.
TOKEN_MAPS: dict[str, Callable[[nn.Module, int, dict], torch.Tensor]] = {
    "vipllava": _identity_map,
    "gemma3": _gemma3_map,
    "idefics3": _smolvlm_map,
    "smolvlm": _smolvlm_map,
    "internvl": _internvl_map,
    "aya_vision": _aya_map,
    "mistral3": _mistral3_map,
}

#: How each family's projector input is read: the fixed stem of every image's features.
READ_RULES = {
    "vipllava": "each image token is one vision token (CLS dropped) read after every layer of "
                "vision_feature_layer, concatenated: equal shares 1/J per read layer",
    "gemma3": "the last hidden state, average-pooled (kernel patches_per_image / tokens_per_side): the exact "
              "averaging matrix",
    "idefics3": "the last hidden state, pixel-shuffled (scale_factor): s×s vision tokens per image token, 1/s² each",
    "smolvlm": "the last hidden state, pixel-shuffled (scale_factor): s×s vision tokens per image token, 1/s² each",
    "internvl": "hidden_states[vision_feature_layer] (CLS dropped by the 'default' strategy), pixel-shuffled "
                "(downsample_ratio): 1/s² each",
    "aya_vision": "hidden_states[vision_feature_layer], pixel-shuffled (downsample_factor): 1/s² each",
    "mistral3": "hidden_states[vision_feature_layer], patch-merged (spatial_merge_size unfold): 1/s² each; all "
                "images in one vision sequence",
}

#: Families that run every image of a call (of all its prompts) as one vision sequence: one prompt per call.
ONE_VISION_SEQUENCE = ("mistral3",)

#: Families whose vision items are a base view and tiles of each image (capture/vlm_tiles.py).
ANYRES = ("llava_next", "llava_onevision")
READ_RULES.update({
    t: "hidden_states[vision_feature_layer] ('default' strategy drops the CLS) of the base view and the tiles, "
       "packed by the model's own pack_image_features (unpadded, OneVision shrinks large grids); newline tokens "
       "spread over the row they close" for t in ANYRES})

COMPOSED = tuple(READ_RULES)

_QFORMER_VIDEO = (
    "reads every video frame through a Q-Former and concatenates the frames' query outputs: attnroll composes the "
    "Q-Former stage of one image per prompt (BLIP-2, InstructBLIP: capture/qformer.py), not the frames of a video "
    "(they would need one map per frame); explain the vision tower (model.vision_model) or the language model on "
    "its own"
)
#: VLM families refused, with the obstacle each meets (model_type -> the sentence after the model's name).
REFUSED: dict[str, str] = {
    "instructblipvideo": _QFORMER_VIDEO,
    "mllama": (
        "feeds the image to the language model through gated cross-attention layers "
        "(text_config.cross_attention_layers) that read every tile's vision tokens from every text position: the "
        "language sequence holds one <|image|> token, not the image's tokens, so there are no image-token shares to "
        "compose, and what the gated cross-attention adds is outside the self-attention rollout; explain the "
        "vision model or the language model on its own"
    ),
    "llama4": (
        "is not composed: its vision encoder appends the class token after the patches and pixel-shuffles them into "
        "its image tokens, a map attnroll has not yet checked against the model (transformers 5.24's own "
        "Llama4ForConditionalGeneration forward does not run on a small config: 'MoeCausalLMOutputWithPast' has no "
        "attribute 'image_outputs'; 5.25's does); explain the language model on its own"
    ),
}

#: README's items for the refusals above.
REFUSED_README = (
    "InstructBLIP-Video (a Q-Former per video frame, frames concatenated)",
    "Mllama (the image enters through gated cross-attention layers, not tokens)",
    "Llama 4 (its pixel-shuffled image tokens not yet checked against the model; transformers 5.24's own forward "
    "fails on it)",
)


def mapped_adapter(model: nn.Module) -> "MappedVLMAdapter | None":
    """The adapter of a VLM composed here (None for any other model); UnsupportedModelError naming the
    obstacle for the families of :data:`REFUSED`."""
    kind = getattr(getattr(model, "config", None), "model_type", "")
    if kind in REFUSED and hasattr(model.config, "vision_config"):
        raise _checks.UnsupportedModelError(f"{type(model).__name__} ({kind}) {REFUSED[kind]}")
    if is_vlm(model) and kind in COMPOSED:
        return MappedVLMAdapter(model)
    return None


def mapped_facts(model: nn.Module) -> ModelFacts | None:
    if is_vlm(model) and getattr(model.config, "model_type", "") in COMPOSED:
        return composed_facts(model)
    return None


class MappedVLMAdapter(VLMAdapter):
    """A VLM whose image tokens are linear maps of its vision tokens (see the module docstring)."""

    def facts(self) -> ModelFacts:
        return mapped_facts(self.model) or super().facts()

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        px = inputs.get("pixel_values")
        if isinstance(px, torch.Tensor) and px.ndim == 5:  # Idefics3 / SmolVLM: (prompts, images, C, H, W)
            inputs = {**inputs, "pixel_values": px.flatten(0, 1)}
        super().metadata(record, inputs)

    def feature_parts(self, inputs: dict[str, Any], vision_layers: int) -> list[tuple[int, int]] | str:
        """[(vision layers passed, first vision token read)] per read layer, or the reason there is no map."""
        cfg = self.model.config
        if self.model_type in ("gemma3", "idefics3", "smolvlm"):
            return [(vision_layers, 0)]
        layer = inputs.get("vision_feature_layer")
        layer = getattr(cfg, "vision_feature_layer", -1) if layer is None else layer
        strategy = inputs.get("vision_feature_select_strategy") or getattr(cfg, "vision_feature_select_strategy",
                                                                           "full")
        if self.model_type == "vipllava":
            strategy = "default"
        elif self.model_type == "mistral3":
            strategy = "full"
        if strategy not in ("default", "full"):
            return f"vision_feature_select_strategy={strategy!r} is neither 'default' nor 'full'"
        layers = [layer] if isinstance(layer, int) and not isinstance(layer, bool) else list(layer)
        out = []
        for lay in layers:
            if not isinstance(lay, int) or not -(vision_layers + 1) <= lay <= vision_layers:
                return f"vision_feature_layer={layer!r} is not a layer of the {vision_layers}-layer vision tower"
            out.append((lay % (vision_layers + 1), 1 if strategy == "default" else 0))
        return out

    def feature_read(self, inputs: dict[str, Any], vision_layers: int) -> tuple[int, int] | str:
        parts = self.feature_parts(inputs, vision_layers)
        return parts if isinstance(parts, str) else (max(p[0] for p in parts), parts[0][1])

    def feature_map(self, record: AttentionRecord, inputs: dict[str, Any], first: int) -> tuple | str:
        """(F (T_total, N, n_read), placement or None, newlines): every image token of the prompts (in order)
        over (item, read vision token); where the items lie on the user's images; the image tokens that come
        from no vision token [(image, row of F, canvas cells)] (or the reason there is no map)."""
        N, n_v = record.streams["vision"][0].shape[0], record.streams["vision"][0].shape[-1]
        if self.model_type in ANYRES:
            strategy = inputs.get("vision_feature_select_strategy") or self.model.config.vision_feature_select_strategy
            return anyres_map(self.model, inputs, n_v, first, strategy)
        A = TOKEN_MAPS[self.model_type](self.model, n_v - first, inputs)
        F = torch.zeros(N, A.shape[0], N, n_v - first)
        for i in range(N):
            F[i, :, i] = A
        placed = self.split(inputs, N, n_v, first, A.shape[0]) if layout_given(inputs, self.model_type) else (
            self.placement(record, inputs))
        if isinstance(placed, str):
            return placed
        return F.reshape(N * A.shape[0], N, n_v - first), placed, []

    def split(self, inputs: dict[str, Any], N: int, n_v: int, first: int, per_view: int) -> Placement | str:
        """The placement of split images' tiles and global views (``capture.vlm_split``): the views of each image
        from rows= / cols= (rows × cols + 1, or 1), else one image per prompt (its image tokens / ``per_view``)."""
        if inputs.get("rows") is not None and inputs.get("cols") is not None:
            views = [r * c + 1 if r * c > 1 else 1 for r, c in zip(flat_ints(inputs["rows"], "rows"),
                                                                  flat_ints(inputs["cols"], "cols"))]
        else:
            counts = (inputs["input_ids"] == image_token_id(self.model.config)).sum(dim=1).tolist()
            views = [int(c) // per_view for c in counts if c]
        if sum(views) != N:
            return (f"the tile layout means {sum(views)} view(s) ({views} per image), but the vision tower ran on {N}: "
                    "rows= / cols= (or image_sizes=) must describe the images of this call")
        return split_placement(self.model_type, inputs, views, n_v, first)

    def placement(self, record: AttentionRecord, inputs: dict[str, Any]) -> Placement | str | None:
        """Where the vision items lie on the user's images; None when each item is one image on its own grid."""
        if self.model_type in ("idefics3", "smolvlm"):
            return padded_views(inputs, self.model.config.vision_config.patch_size)
        if self.model_type != "mistral3":
            return None
        return pixtral_views(inputs.get("image_sizes"), self.model.config.vision_config.patch_size)

    def link(self, record: AttentionRecord, inputs: dict[str, Any]) -> StreamLink | str | None:
        if "vision" not in record.streams:
            return None
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return "the prompt was given as inputs_embeds: the image tokens are found from input_ids"
        parts = self.feature_parts(inputs, len(record.streams["vision"]))
        if isinstance(parts, str):
            return parts
        mapped = self.feature_map(record, inputs, parts[0][1])
        if isinstance(mapped, str):
            return mapped
        F, placed, newlines = mapped
        where = (ids == image_token_id(self.model.config)).nonzero()  # row-major (prompt, position) order
        if where.shape[0] != F.shape[0]:
            return (f"{where.shape[0]} image tokens in input_ids, but the model's projector makes {F.shape[0]} "
                    f"image features from the {F.shape[1]} vision item(s): the tokens do not match the features")
        link = link_entries(where, F, parts)
        several = "" if layout_given(inputs, self.model_type) else self.several_items(link)
        if several:
            return several
        if placed is not None and newlines:
            placed.direct = direct_entries(where.cpu(), newlines, placed.prefix)
        link.placement = placed
        return link


    def several_items(self, link: StreamLink) -> str:
        """The reason a prompt's image tokens come from several vision items of a family that maps one item per
        image ("" when none does): tiles of one image, whose layout the inputs do not give, or several images."""
        if self.model_type in ONE_VISION_SEQUENCE and link.example.unique().numel() > 1:
            return (f"{type(self.model).__name__} runs the images of all prompts of a call as one vision sequence, so "
                    "they cannot be told apart per prompt: explain one prompt at a time (its images each get a map)")
        if self.model_type in ANYRES or self.model_type == "mistral3":
            return ""
        for b in link.example.unique().tolist():
            items = link.item[link.example == b].unique()
            if items.numel() > 1:
                return (f"prompt {b}'s image tokens come from {items.numel()} vision items: tiles of one image (image "
                        f"splitting) or several images. {TILING.get(self.model_type, '')}The inputs do not say how "
                        f"tiles lie on the image: pass {LAYOUT_KEYS.get(self.model_type, 'one image at a time')} "
                        "with the inputs to put the tiles back on the image, or explain one image at a time, "
                        "without tiles")
        return ""


#: How to ask each family's processor for a single view of the image.
TILING = {
    "idefics3": "Idefics3 splits large images into tiles plus a global view (processor do_image_splitting=False "
                "gives one view). ",
    "smolvlm": "SmolVLM splits large images into tiles plus a global view (processor do_image_splitting=False gives "
               "one view). ",
    "internvl": "InternVL crops images into tiles plus a thumbnail (processor crop_to_patches=False gives one "
                "view). ",
    "aya_vision": "Aya Vision crops images into tiles plus a thumbnail (processor crop_to_patches=False gives one "
                  "view). ",
}


#: What the caller passes to say how each image's tiles lie (``capture.vlm_split``).
LAYOUT_KEYS = {
    "idefics3": "rows= and cols= (the image processor's own, return_row_col_info=True)",
    "smolvlm": "rows= and cols= (the image processor's own, return_row_col_info=True)",
    "internvl": "image_sizes= (each image's (height, width)) or rows= and cols=",
    "aya_vision": "image_sizes= (each image's (height, width)) or rows= and cols=",
}


def padded_views(inputs: dict[str, Any], patch: int) -> Placement | str | None:
    """Idefics3 / SmolVLM: an image smaller than the tower's input is padded at the bottom and right
    (``pixel_attention_mask`` 0 there); the map is put on the image's own patches (a patch is real when any of its
    pixels is, as the model's ``patch_attention_mask``), the padding patches on slot 0. None without padding."""
    mask = inputs.get("pixel_attention_mask")
    px = inputs.get("pixel_values")
    if not isinstance(mask, torch.Tensor) or not isinstance(px, torch.Tensor) or bool(mask.all()):
        return None
    flat = px.flatten(0, 1) if px.ndim == 5 else px
    real = (flat == 0).sum(dim=(-1, -2, -3)) != flat.shape[1:].numel()  # the model drops all-zero images
    m = mask.reshape(-1, *mask.shape[-2:])[real].to(torch.bool)
    H, W = m.shape[-2] // patch, m.shape[-1] // patch
    patches = m[:, :H * patch, :W * patch].reshape(-1, H, patch, W, patch).any(dim=4).any(dim=2)
    rows, cols = patches.any(dim=2).sum(dim=1), patches.any(dim=1).sum(dim=1)
    if rows.unique().numel() != 1 or cols.unique().numel() != 1:
        return "the images of this call have different sizes inside their padding: explain one image at a time"
    h, w = int(rows[0]), int(cols[0])
    if not bool(patches[:, :h, :w].all()) or int(patches.sum()) != patches.shape[0] * h * w:
        return "pixel_attention_mask is not one top-left rectangle per image: the padding cannot be undone"
    N = patches.shape[0]
    r, c = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    inside = (r < h) & (c < w)
    cell = torch.where(inside, 1 + r * w + c, torch.zeros_like(r)).reshape(-1)
    return Placement(image=torch.arange(N), item=torch.arange(N).repeat_interleave(H * W),
                     token=torch.arange(H * W).repeat(N), cell=cell.repeat(N), weight=torch.ones(N * H * W),
                     grid=(h, w), prefix=1, n_images=N,
                     note="the image's own patches (pixel_attention_mask); slot 0: the padding patches")


def pixtral_views(sizes: Any, patch: int) -> Placement | str:
    """Mistral 3 / Pixtral: the images of a call are one vision sequence, each image's patches in raster order
    on its own (height, width) // patch grid (``image_sizes``), one image after another; one image is mapped
    on its grid, several as ``Placement.views`` (one map per image)."""
    if not isinstance(sizes, torch.Tensor) or sizes.ndim != 2 or sizes.shape[-1] != 2 or sizes.shape[0] < 1:
        return "Mistral 3 needs image_sizes (one (height, width) per image) to place its patches on the images"
    grids = [(int(h) // patch, int(w) // patch) for h, w in sizes.tolist()]
    n = sum(h * w for h, w in grids)
    one = len(grids) == 1
    return Placement(image=torch.zeros(1, dtype=torch.long), item=torch.zeros(n, dtype=torch.long),
                     token=torch.arange(n), cell=torch.arange(n), weight=torch.ones(n),
                     grid=grids[0] if one else (1, n), prefix=0, views=None if one else grids,
                     note="the image's patch grid (image_sizes / patch_size)" if one else
                     "each image's patch grid (image_sizes / patch_size), the images one vision sequence")


def direct_entries(where: torch.Tensor, newlines: list, prefix: int) -> tuple[torch.Tensor, ...]:
    """Placement.direct of the newline tokens: each one's share evenly over its canvas cells."""
    ex, pos, img, cell, w = [], [], [], [], []
    for g, q, cells in newlines:
        m = cells.numel()
        ex.append(torch.full((m,), int(where[q, 0])))
        pos.append(torch.full((m,), int(where[q, 1])))
        img.append(torch.full((m,), g))
        cell.append(cells + prefix)
        w.append(torch.full((m,), 1.0 / m))
    return tuple(torch.cat(t) for t in (ex, pos, img, cell, w))


def link_entries(where: torch.Tensor, F: torch.Tensor, parts: list[tuple[int, int]]) -> StreamLink:
    """The StreamLink of image tokens at ``where`` (K, 2) whose rows of F (K, N, n) are split over the read
    layers ``parts`` [(layers, first)] at equal shares."""
    q, item, v = torch.nonzero(F, as_tuple=True)
    w = F[q, item, v]
    J = len(parts)
    cat = lambda t: torch.cat([t] * J)  # noqa: E731
    layers = torch.cat([torch.full_like(q, k) for k, _ in parts])
    return StreamLink(source="vision", example=cat(where[q, 0].cpu()), position=cat(where[q, 1].cpu()),
                      item=cat(item), token=cat(v) + parts[0][1], source_layers=max(k for k, _ in parts),
                      weight=cat(w) / J, layers=None if J == 1 else layers)
