"""AttentionRecord: what one forward pass's attention looked like, plus the token metadata methods need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: Conventional stream names. Single-stream models use "self"; encoder-decoders "encoder", "decoder" and
#: "cross"; dual-tower models (CLIP) "vision" and "text".
STREAM_NAMES = ("self", "encoder", "decoder", "cross", "vision", "text")


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
    operators: dict[str, list[Any]] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------------- access
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

    def stream_names(self) -> list[str]:
        """Names of the recorded streams, dense or matrix-free."""
        return list(self.streams or self.operators)

    def stream_shape(self, name: str) -> tuple[int, ...]:
        """(B, H, n_q, n_k) of stream ``name``'s layers ((B, n_q, n_k) when fused), dense or matrix-free."""
        if name in self.streams:
            return tuple(self.streams[name][0].shape)
        return tuple(self.operators[name][0].shape)

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
        grads = [t.grad for t in layers]
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
