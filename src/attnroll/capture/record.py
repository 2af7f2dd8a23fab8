"""AttentionRecord: what one forward pass's attention looked like, plus the token metadata methods need.

The contract between adapters and everything downstream (methods, evaluation, the command line) is made of
dataclasses: :class:`StreamInfo` (per stream: mask, prefix, suffix, grid, tokens, causal, readout, input
key), :class:`Readout` (which output rows the prediction reads, with what weights; it and the readout policy
live in :mod:`attnroll.capture.readout`) and :class:`ModelFacts` (per model, without a forward pass: how it
is called, its embedding layer, its special tokens). Only adapters fill them; nothing downstream reads a
config or a parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

# The readout (which rows a prediction reads) is one module; adapters import these from here as before.
from .readout import READOUT_KINDS, Readout, is_causal, last_real, resolve_readout  # noqa: F401

#: Conventional stream names. Single-stream models use "self"; encoder-decoders "encoder", "decoder" and
#: "cross"; dual-tower models (CLIP) "vision" and "text"; vision-language models (LLaVA, PaliGemma) "vision"
#: (the vision tower) and "language" (the language model, whose sequence holds the image tokens as well as
#: the text: not "text", which is a text-only tower).
STREAM_NAMES = ("self", "encoder", "decoder", "cross", "vision", "text", "language")


@dataclass
class StreamLink:
    """Tokens of one stream that are another stream's output tokens (a VLM's image tokens: each is one vision
    token projected into the language model's embedding space, or a fixed linear mixture of several).

    K linked tokens; the k-th sits at (``example[k]``, ``position[k]``) of this stream and is token
    ``token[k]`` of item ``item[k]`` (the batch row of the source stream: an image) of stream ``source``.

    Attributes:
        source: the stream the tokens come from ("vision").
        example, position, item, token: (K,) long tensors (see above).
        source_layers: how many layers of the source stream the linked tokens have passed through when they are
            read (LLaVA's ``vision_feature_layer``): a rollout of the source stream stops after that many.
        weight: (K,) the share of the k-th token's relevance that goes to (item, token), or None (all 1): a
            language token made of several vision tokens (pixel shuffle, patch merging, average pooling) is
            listed once per source with weights summing to 1 (``capture.vlm_maps``).
        layers: (K,) how many source layers the k-th entry has passed through, or None (all
            ``source_layers``, then the largest): features read from several vision layers (VipLLaVA).
        placement: where the source items lie on the user's images (:class:`Placement`), or None (each item is
            one image on the source stream's own grid).
        kept: shares of linked tokens that stay on sources outside both streams (:class:`KeptShare`: a
            Q-Former's learned queries, the instruction it reads); the weights of a token plus its kept shares
            sum to 1.
    """

    source: str
    example: torch.Tensor
    position: torch.Tensor
    item: torch.Tensor
    token: torch.Tensor
    source_layers: int
    weight: torch.Tensor | None = None
    layers: torch.Tensor | None = None
    placement: Placement | None = None
    kept: tuple["KeptShare", ...] = ()


@dataclass
class KeptShare:
    """The part of linked tokens' relevance that stays on ``m`` sources of neither stream: row k of ``share``
    (K, m) is the share of the token at (``example[k]``, ``position[k]``) on each source. ``name`` keys the
    Explanation's ``extra[name + "_share"]`` (B,) and ``extra[name + "_scores"]`` (B, m)."""

    name: str
    example: torch.Tensor
    position: torch.Tensor
    share: torch.Tensor


@dataclass
class Placement:
    """Where the source stream's tokens lie on the images the user gave, when its items are not those images
    (tiles of one image, a resized copy of it): the k-th entry says that token ``token[k]`` of item ``item[k]``
    covers a share ``weight[k]`` of cell ``cell[k]`` of image ``image[item[k]]``'s canvas (each placed token's
    weights sum to 1). A canvas is ``prefix`` slots (tokens with no place on the image: CLS, tile padding)
    followed by the ``grid`` (rows, cols) cells in raster order.

    ``direct``: linked tokens of the explained stream that come from no source token but belong to a place on
    the image (LLaVA-NeXT's learned newline token closing a row of tiles): (example, position, image, cell,
    weight) tensors of one length; the token's share goes to those cells with those weights.

    ``views``: several images laid one after another on one canvas (Mistral 3 runs all images of a call as one
    vision sequence): their (rows, cols) grids in order, the cells after the prefix being image 0's in raster
    order, then image 1's, ...; the composed map is split into one map per image (``extra["image_maps"]``)."""

    image: torch.Tensor
    item: torch.Tensor
    token: torch.Tensor
    cell: torch.Tensor
    weight: torch.Tensor
    grid: tuple[int, int]
    prefix: int = 1
    n_images: int = 1
    direct: tuple[torch.Tensor, ...] | None = None
    note: str = ""
    views: list[tuple[int, int]] | None = None


@dataclass
class StreamInfo:
    """What the tokens of one stream are, as the adapter knows them.

    Attributes:
        kind: "image" | "text" | "audio" | "tokens" (anything else).
        mask: (B, n) 0/1 long (1 = real token) or None when every token is real.
        prefix: tokens before the units (CLS, distillation, registers); ``scores`` drop them.
        suffix: tokens after the units (YOLOS detection tokens); ``scores`` drop them too.
        grid: (rows, cols) of the patch units for image streams, else None; ``grid_reason`` says why not
            when an image stream has none.
        tokens: token strings per example (with a tokenizer), else None.
        causal: queries never attend ahead (decoders).
        readout: the rows the model's prediction reads (:class:`Readout`), or None when no weighted set of
            rows describes it (max pooling; ``readout_reason`` says why): methods then need ``readout=``.
        readout_reason: why ``readout`` is None ("" otherwise).
        input_key: the forward argument carrying this stream's input ("pixel_values", "input_ids", "x", ...),
            or None.
        merges: a stage chain (Swin): layer index k -> merge map (n_k, n_{k-1}), row-stochastic, between
            layers k-1 and k, whose token counts differ; the layers are then square per stage, the units and
            ``grid`` are the first layer's tokens and the readout weights the last layer's
            (``attnroll.core.stages``). Empty for single-stage streams.
        stochastic_reason: why some layers' rows are not probabilities (talking-heads attention mixes heads
            after the softmax), "" when every layer holds softmax probabilities; ``nonstochastic`` lists them.
        link: the tokens of this stream that are another stream's tokens (:class:`StreamLink`: a VLM's image
            tokens), or None; ``link_reason`` says why a stream that holds such tokens has no link.
        units_reason: why the stream's token positions cannot label a map ("" when they can): the model
            reorders or drops its units at random (ViTMAE's masking), so the record holds the model's own
            attention but methods refuse to explain the stream.
    """

    kind: str = "tokens"
    mask: torch.Tensor | None = None
    prefix: int = 0
    suffix: int = 0
    grid: tuple[int, int] | None = None
    grid_reason: str = ""
    tokens: list[list[str]] | None = None
    causal: bool = False
    readout: Readout | None = None
    readout_reason: str = ""
    input_key: str | None = None
    merges: dict[int, torch.Tensor] = field(default_factory=dict)
    stochastic_reason: str = ""
    nonstochastic: tuple[int, ...] = ()
    link: StreamLink | None = None
    link_reason: str = ""
    units_reason: str = ""

    @property
    def units(self) -> slice:
        """The slice of token positions that are units (patches / tokens) of ``scores``."""
        return slice(self.prefix, None if not self.suffix else -self.suffix)


@dataclass
class ModelFacts:
    """Facts about a model that need no forward pass (what evaluation and gradient baselines ask).

    Attributes:
        family: adapter family ("hf:bert", "timm:vit", "torch:mha", "sentence-transformers", ...).
        input_key: the name of the main input ("pixel_values", "input_ids", "x") or None.
        keyword_call: the model takes its main input as a keyword (transformers) rather than positionally.
        embedding: the input embedding layer of a text model (whose output gradient baselines attribute to),
            else None.
        special_token_ids: ids of CLS / SEP / BOS / EOS / PAD tokens the config records.
        pad_token_id: the padding id (None when the config has none).
        eos_token_id: the (first) end-of-sequence id (None when the config has none).
        similarity: for dual towers, ``f(outputs) -> (B_images, B_texts)`` similarity logits, else None.
        dense_only: why this model's methods need the dense (eager) attention route ("" = any route; a VLM's
            streams are composed from the dense record).
        stream_inputs: for models with several input streams, stream name -> the forward argument carrying its
            input ({"vision": "pixel_values", "text": "input_ids"} for CLIP), else empty.
        anatomy: the layer anatomy (:class:`attnroll.capture.layers.ModelAnatomy`: per layer the attention
            module, q/k/v/o projections, heads and KV grouping, norms and their position, MLP, residual
            layout; the head), or None when no family builder knows the model (``anatomy_reason`` says why).
        anatomy_reason: why ``anatomy`` is None ("" otherwise).
        encoder_decoder: the model has an encoder stack and a decoder stack (T5, BART, Marian, ...).
    """

    family: str = ""
    input_key: str | None = None
    keyword_call: bool = False
    embedding: nn.Module | None = None
    special_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    eos_token_id: int | None = None
    similarity: Callable[[Any], torch.Tensor] | None = None
    dense_only: str = ""
    stream_inputs: dict[str, str] = field(default_factory=dict)
    anatomy: Any = None
    anatomy_reason: str = ""
    encoder_decoder: bool = False


#: Config fields holding special-token ids.
SPECIAL_ID_FIELDS = ("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id", "pad_token_id")


def config_token_id(config: Any, name: str) -> int | None:
    """The (first) id a config records in its ``name`` field (``eos_token_id`` may be a list), or None."""
    v = getattr(config, name, None)
    found = [i for i in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(i, int) and not isinstance(i, bool)]
    return int(found[0]) if found else None


def config_token_ids(config: Any) -> tuple[tuple[int, ...], int | None]:
    """(special-token ids, padding id) a config object records (any object with ``*_token_id`` fields)."""
    ids: list[int] = []
    pad = None
    for name in SPECIAL_ID_FIELDS:
        v = getattr(config, name, None)
        vals = v if isinstance(v, (list, tuple)) else [v]
        found = [int(i) for i in vals if isinstance(i, int) and not isinstance(i, bool)]
        ids += [i for i in found if i not in ids]
        if name == "pad_token_id" and found:
            pad = found[0]
    return tuple(ids), pad


@dataclass
class AttentionRecord:
    """Per-layer attention probabilities captured from one forward pass, and metadata about the tokens.

    Attributes:
        streams: stream name -> list of per-layer tensors, index i = layer i of that stream (the order of the
            attention modules in the model, never the order in which hooks fired). Each tensor is
            (B, H, n_q, n_k) softmax probabilities (rows = queries, summing to 1), or (B, n_q, n_k) when the
            heads were fused at capture time (``fused`` says how). n_q = n_k for self-attention; cross
            attention is (decoder tokens) x (encoder tokens).
        prefix: number of prefix tokens (CLS, distillation, registers) at the start of the image stream:
            1 for ViT, 2 for distilled DeiT, 1 + R for DINOv2 with R registers. 0 for text-only models,
            None when unknown.
        grid: patch grid (rows, cols) of the image stream for the input actually used (non-square and
            resized inputs included), None for text.
        tokens: token strings, one list per example, when a tokenizer was given and the model took
            ``input_ids``; else None.
        attention_mask: the (B, n) 0/1 padding mask given to the model (1 = real token), else None. For
            encoder-decoders it is the encoder's; ``extra["decoder_attention_mask"]`` holds the decoder's.
        outputs: the model's own return value for the recorded pass.
        fused: None for per-head tensors, else the head fusion applied inside the hook ("mean", "max",
            "min" or "weights").
        keep_grad: True when the per-head tensors are still part of the autograd graph; after a backward
            pass their gradients are in ``tensor.grad`` (see :meth:`gradients`).
        family: which adapter captured this ("hf:vit", "timm:vit", "torch:mha", "modules", ...).
        layer_names: stream name -> qualified module names, aligned with ``streams``.
        extra: adapter-specific metadata (e.g. ``decoder_tokens``, ``decoder_attention_mask``).
            ``extra["native"]``: (stream, layer) -> (the model's own tensor, lift) for layers the adapter
            rebuilt from what the model computed (Swin's windows scattered into the stage matrix, CaiT's
            class-attention rows embedded): gradients are taken with respect to the model's tensor and
            ``lift(grad)`` puts them in the layer's layout.
        info: stream name -> :class:`StreamInfo` (the contract methods read; the flat ``prefix`` / ``grid``
            / ``tokens`` / ``attention_mask`` fields above are kept for the main stream).
        operators: the matrix-free form (``attention="recompute"``): stream name -> per-layer
            ``KernelInputs`` (queries, keys, mask... as the model's own kernel saw them); ``streams`` is then
            empty, since no n×n tensor exists.
    """

    streams: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    prefix: int | None = None
    grid: tuple[int, int] | None = None
    tokens: list[list[str]] | None = None
    attention_mask: torch.Tensor | None = None
    outputs: Any = None
    fused: str | None = None
    keep_grad: bool = False
    family: str = ""
    layer_names: dict[str, list[str]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    info: dict[str, StreamInfo] = field(default_factory=dict)
    operators: dict[str, list[Any]] = field(default_factory=dict)

    def stream_info(self, name: str) -> StreamInfo:
        """The :class:`StreamInfo` of stream ``name`` (validated)."""
        if name not in self.operators:
            self.stream(name)
        return self.info.get(name) or StreamInfo()

    # ------------------------------------------------------------------------------------------- access
    def stream_names(self) -> list[str]:
        """Names of the recorded streams, dense or matrix-free."""
        return list(self.streams or self.operators)

    def stream_shape(self, name: str) -> tuple[int, ...]:
        """(B, H, n_q, n_k) of stream ``name``'s layers ((B, n_q, n_k) when fused), dense or matrix-free."""
        if name in self.streams:
            return tuple(self.streams[name][0].shape)
        return tuple(self.operators[name][0].shape)

    def _default_stream(self) -> str:
        if not self.streams and self.operators:
            raise ValueError(
                "this AttentionRecord is matrix-free (attention='recompute'): it holds per-layer queries and "
                "keys in record.operators, not attention matrices; capture with attention='dense' for those"
            )
        if not self.streams:
            raise ValueError(
                "this AttentionRecord holds no attention: no forward pass of the model was recorded. With "
                "`with attnroll.capture(model) as rec:` run the model inside the `with` block."
            )
        if "self" in self.streams:
            return "self"
        if len(self.streams) == 1:
            return next(iter(self.streams))
        raise ValueError(
            f"this record has several attention streams ({', '.join(repr(s) for s in self.streams)}); "
            "pick one with record.streams[name] or record.stream(name)"
        )

    @property
    def attentions(self) -> list[torch.Tensor]:
        """The per-layer tensors of the "self" stream (or of the only stream); an error names the streams
        when there are several."""
        return self.streams[self._default_stream()]

    def stream(self, name: str | None = None) -> list[torch.Tensor]:
        """The per-layer tensors of stream ``name`` (None = as :attr:`attentions`)."""
        if name is None:
            return self.attentions
        if name not in self.streams:
            raise ValueError(
                f"stream must be one of {', '.join(repr(s) for s in self.streams) or '(none recorded)'}; "
                f"got {name!r}"
            )
        return self.streams[name]

    @property
    def num_layers(self) -> int:
        """Number of layers of the default stream (see :attr:`attentions`)."""
        return len(self.attentions)

    def stacked(self, stream: str | None = None) -> torch.Tensor:
        """One tensor with a leading layer axis: (L, B, H, n, n), or (L, B, n, n) when fused."""
        return torch.stack(list(self.stream(stream)))

    def gradients(self, stream: str | None = None) -> list[torch.Tensor]:
        """The gradients of the per-layer attention after a backward pass, same shapes as the tensors.

        Needs ``keep_grad=True`` at capture time and a ``.backward()`` call through the recorded outputs.
        """
        layers = self.stream(stream)
        if not self.keep_grad:
            raise ValueError(
                "gradients need keep_grad=True at capture time: attnroll.capture(model, inputs, keep_grad=True)"
            )
        native = self.extra.get("native", {})
        grads = []
        for i, t in enumerate(layers):
            src = native.get((stream or self._default_stream(), i))
            g = t.grad if src is None else src[0].grad
            grads.append(g if src is None or g is None else src[1](g))
        missing = [i for i, g in enumerate(grads) if g is None]
        if missing:
            raise ValueError(
                f"no gradient has reached the attention of layer(s) {missing}: call .backward() on a scalar "
                "computed from record.outputs first"
            )
        return grads

    def __repr__(self) -> str:
        parts = []
        for name, layers in self.streams.items():
            shape = tuple(layers[0].shape) if layers else ()
            parts.append(f"{name}: {len(layers)} x {shape}")
        return (
            f"AttentionRecord(family={self.family!r}, streams={{{', '.join(parts)}}}, prefix={self.prefix}, "
            f"grid={self.grid}, fused={self.fused!r}, keep_grad={self.keep_grad})"
        )
