"""One entry point for every method: the registry, ``explain``, ``Explainer``, ``methods()`` and targets.

A method is a function ``fn(ctx, **options) -> Explanation`` registered under a name with the options it
accepts (and their defaults). ``explain`` validates the method name and the options, builds a
:class:`Context` (model, inputs, target and the shared steps: capture, output positions, target scores,
attention gradients) and calls the method. Methods are each one file in this package.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .. import _checks
from .._modes import params_require_grad
from ..capture import capture as _capture
from ..capture import model_facts
from ..capture.hf import is_hf_model
from ..capture.outputs import main_logits
from ..capture.record import AttentionRecord, Readout, StreamInfo, is_causal, last_real, resolve_readout
from ..core import multimodal
from . import _option_checks
from .explanation import Explanation

__all__ = ["Explanation", "Explainer", "explain", "methods", "method_info", "check_options", "register", "Method",
           "Context", "Prepared", "main_logits", "gather_rows", "rollout_rows", "source_rows", "prefix_default", "ROLLOUT_OPTIONS", "ROLLOUT_REFUSE"]

#: Options every method takes (besides its own): the output position to explain (row of the map, and the
#: position of a token-level target), and the readout (which rows, with what weights; overrides the model's).
COMMON_OPTIONS = {"position": None, "readout": None}


@dataclass
class Method:
    """A registered method: its function, accepted options with defaults, and table facts."""

    name: str
    fn: Callable[..., Explanation]
    description: str
    options: dict[str, Any]
    needs_grad: bool = False
    class_specific: bool = False
    cost: str = ""
    reference: str = ""
    #: option name -> why it is refused and what to use instead (for options of other methods)
    refuse: dict[str, str] = field(default_factory=dict)


_REGISTRY: dict[str, Method] = {}


def register(
    name: str,
    *,
    description: str,
    options: dict[str, Any] | None = None,
    needs_grad: bool = False,
    class_specific: bool = False,
    cost: str = "",
    reference: str = "",
    refuse: dict[str, str] | None = None,
) -> Callable:
    """Decorator registering ``fn(ctx, **options) -> Explanation`` under ``name``."""

    if name in _REGISTRY:
        raise ValueError(f"method name {name!r} is already registered (by {_REGISTRY[name].fn.__module__}); "
                         "choose another name")

    def deco(fn: Callable) -> Callable:
        _REGISTRY[name] = Method(
            name, fn, description, dict(options or {}), needs_grad, class_specific, cost, reference, dict(refuse or {})
        )
        return fn

    return deco


def methods() -> dict[str, str]:
    """Registered method names -> one-line descriptions (in registration order)."""
    return {name: m.description for name, m in _REGISTRY.items()}


def method_info(name: str) -> Method:
    """The registry entry of ``name`` (options, cost, reference...); ValueError listing the methods if unknown."""
    return _get(name)


def _get(name: Any) -> Method:
    if not isinstance(name, str) or name not in _REGISTRY:
        listing = "; ".join(f"{k}: {m.description}" for k, m in _REGISTRY.items())
        raise ValueError(f"method must be one of the registered methods, got {name!r}. Methods: {listing}")
    return _REGISTRY[name]


# ------------------------------------------------------------------------------------------- context
class Context:
    """What a method works on: the model, the inputs, the requested target and shared steps.

    Methods call :meth:`record` (no gradients) or :meth:`grad_record` (attention and d target / d attention),
    then :meth:`positions` and :meth:`build` to make the Explanation.
    """

    def __init__(self, model: nn.Module, inputs: Any, target: Any, method: Method, options: dict, tokenizer: Any,
                 memo: dict | None = None):
        self.model = model
        self.inputs = inputs
        self.target = target
        self.method = method
        self.options = options
        self.tokenizer = tokenizer
        self.rec: AttentionRecord | None = None
        self.target_desc: Any = None
        self.memo = {} if memo is None else memo  # what Prepared keeps from call to call (see facts)

    def facts(self) -> Any:
        """``capture.model_facts(model, anatomy=False)`` for a transformers model, else None: how the model
        is called and how its attention is computed (no forward pass). Remembered in ``memo``, which
        :class:`Prepared` keeps for every call on its model."""
        if "facts" not in self.memo:
            self.memo["facts"] = model_facts(self.model, anatomy=False) if is_hf_model(self.model) else None
        return self.memo["facts"]

    # -- capture ------------------------------------------------------------------------------------
    def record(self, fuse_heads: Any = None) -> AttentionRecord:
        """Capture the attention of one forward pass (no gradients), resolving the target for the record."""
        self.rec = _capture(self.model, self.inputs, fuse_heads=fuse_heads, tokenizer=self.tokenizer)
        self.check_attention(self.rec)
        return self.rec

    def check_attention(self, rec: AttentionRecord) -> None:
        """Refuse NaN / infinite attention at real tokens (what every method reads); padded query rows may
        hold anything (an example that is all padding gives NaN rows) and are zeroed by the methods."""
        for s, layers in rec.streams.items():
            mask = self.mask(rec, s)
            for i, t in enumerate(layers):
                x = t.detach()
                if mask is not None and x.shape[-2] == mask.shape[-1]:
                    rows = mask.to(device=x.device, dtype=torch.bool)[:, None, :, None]
                    x = torch.where(rows if x.ndim == 4 else rows[:, 0], x, torch.zeros((), dtype=x.dtype, device=x.device))
                _checks.check_finite(f"the attention of {type(self.model).__name__} (stream {s!r}, layer {i})", x)

    def grad_record(self, streams: list[str] | None = None, scores: Callable | None = None):
        """Forward with autograd, the target scores y (B,), and dy/dA for every layer of ``streams``.

        Returns (record, {stream: [A_l detached]}, {stream: [dy/dA_l]}), layers in layer-index order (the
        order of the attention modules in the model, never hook order). ``scores(record) -> (B,)`` replaces
        the default target resolution (CLIP, encoder-decoders)."""
        require_grad_mode(self.method.name)
        with params_require_grad(self.model, partly=True):
            rec = _capture(self.model, self.inputs, keep_grad=True, tokenizer=self.tokenizer)
        self.rec = rec
        self.check_attention(rec)
        names = list(rec.streams) if streams is None else streams
        y = scores(rec) if scores is not None else self.target_scores(rec)
        # Parallel branches of one layer are separate tensors in the graph: differentiate each, then
        # concatenate their heads as the layer's tensor was.
        branches = rec.extra.get("branches", {})
        # A layer the adapter rebuilt from the model's own tensor (Swin windows, CaiT class rows) is
        # differentiated through that tensor; lift() puts the gradient in the layer's layout.
        native = rec.extra.get("native", {})
        parts = [(s, i, branches.get((s, i)) or [native[(s, i)][0] if (s, i) in native else t])
                 for s in names for i, t in enumerate(rec.streams[s])]
        flat = [p for _, _, ps in parts for p in ps]
        grads = list(torch.autograd.grad(y.sum(), flat, allow_unused=True))
        # Examples of a batch are independent (eval mode), so d(sum_b y_b)/dA_b = dy_b/dA_b.
        out_a = {s: [t.detach() for t in rec.streams[s]] for s in names}
        out_g: dict[str, list[torch.Tensor]] = {s: [] for s in names}
        unreached, unread = [], unread_layers(rec)
        for s, i, ps in parts:
            gs = [grads.pop(0) for _ in ps]
            if any(g is None for g in gs) and (s, i) not in unread:
                unreached.append(f"{s} layer {i}")
            gs = [torch.zeros_like(p) if g is None else g for p, g in zip(ps, gs)]
            g = torch.cat([g.detach() for g in gs], dim=1) if len(gs) > 1 else gs[0].detach()
            out_g[s].append(native[(s, i)][1](g) if (s, i) in native else g)
        if unreached:
            raise _checks.CaptureError(
                f"method {self.method.name!r}: the gradient of the target never reaches the captured attention of "
                f"{type(self.model).__name__} ({', '.join(unreached[:6])}{', ...' if len(unreached) > 6 else ''}): "
                "the probabilities this model returns are not the tensor its output is computed from (e.g. "
                "block-sparse or re-computed attention), so a gradient method would return zeros. Use a "
                "gradient-free method ('rollout', 'raw') or capture with modules=/to_probs= on the tensor used."
            )
        return rec, out_a, out_g

    # -- positions and targets ----------------------------------------------------------------------
    def stream(self, rec: AttentionRecord) -> str:
        """The stream to explain: the ``stream`` option, else the record's only / "self" stream."""
        name = self.options.get("stream")
        if name is not None:
            rec.stream(name)  # validates
            return name
        names = rec.stream_names()
        if "self" in names or len(names) == 1:
            return "self" if "self" in names else names[0]
        linked = [s for s in names if s in rec.info and (rec.info[s].link is not None or rec.info[s].link_reason)]
        if len(linked) == 1:  # a VLM: the language stream, which holds the other stream's tokens
            return linked[0]
        special = {"encoder": "'encdec_rollout' or 'encdec_gae'", "vision": "'clip'"}
        hint = next((v for k, v in special.items() if k in names), None)
        raise ValueError(
            f"{type(self.model).__name__} has several attention streams ({', '.join(names)}); method "
            f"{self.method.name!r} explains one: pass stream=one of {names}"
            + (f", or use method={hint}, which composes them" if hint else "")
        )

    def info(self, rec: AttentionRecord, stream: str) -> StreamInfo:
        """The adapter's :class:`StreamInfo` of ``stream`` (mask, prefix, grid, tokens, causal, readout)."""
        return rec.stream_info(stream)

    def mask(self, rec: AttentionRecord, stream: str) -> torch.Tensor | None:
        """(B, n) 0/1 padding mask of ``stream``, or None when every token is real."""
        return self.info(rec, stream).mask

    def positions(self, rec: AttentionRecord, stream: str) -> list[int]:
        """The output position of a token-level target (and the row of one-hot readouts): the ``position``
        option (an int or one per example), else the last real token for causal attention or token-level
        outputs (decoder-only LMs), else the row of the stream's readout when it is one row, else 0."""
        B, n = _readout_size(rec, stream, self.info(rec, stream))
        pos = self.options.get("position")
        if pos is not None:
            return _checks.check_positions(pos, B, n)
        info = self.info(rec, stream)
        if rec.streams:
            causal = is_causal(rec.streams[stream][0])
        else:
            causal = rec.operators[stream][0].is_causal_model
        if info.causal or causal or (stream in ("self", "decoder") and _token_level(rec.outputs, n)):
            return last_real(info.mask, B, n)
        one = info.readout.positions() if info.readout is not None else None
        return one if one is not None else [0] * B

    def readout(self, rec: AttentionRecord, stream: str) -> Readout:
        """The rows explained: the ``readout`` option (a position, "cls", "mean", "last", "eot", a weight
        vector), else ``position``, else the adapter's declared readout of the stream (the rows the model's
        prediction reads), else the first token (the last real one for causal streams)."""
        info = self.info(rec, stream)
        B, n = _readout_size(rec, stream, info)
        spec = self.options.get("readout")
        common = dict(batch=B, n=n, mask=info.mask, prefix=info.prefix, suffix=info.suffix)
        if spec is not None:
            eot = info.readout.positions() if info.readout is not None and info.readout.kind == "eot" else None
            return resolve_readout(spec, source="readout= option", eot=eot, **common)
        if self.options.get("position") is not None:
            return resolve_readout(self.positions(rec, stream), source="position= option", **common)
        if info.readout is not None and not _token_level(rec.outputs, n):
            return info.readout
        if info.readout is None and info.readout_reason and not _token_level(rec.outputs, n):
            raise ValueError(f"readout: {type(self.model).__name__} has no default readout: {info.readout_reason}")
        # Token-level outputs (a language model's next-token logits): the rows of the explained position.
        return resolve_readout(self.positions(rec, stream), source="the explained token's position", **common)

    def target_scores(self, rec: AttentionRecord) -> torch.Tensor:
        """y (B,): the target's score per example from the recorded outputs (see :func:`resolve_target`)."""
        stream = "decoder" if "decoder" in rec.stream_names() else self.stream(rec)
        pos = None
        logits = main_logits(rec.outputs)
        if logits is not None and logits.ndim == 3 and not callable(self.target):
            n = rec.stream_shape(stream)[-1]
            if logits.shape[1] != n:
                raise ValueError(
                    f"target: the model's logits {tuple(logits.shape)} have one row per query ({logits.shape[1]}), "
                    f"not per token ({n}), e.g. object-detection queries; pass target=a callable "
                    "f(outputs) -> (B,) (e.g. lambda o: o.logits[:, 0].max(-1).values)"
                )
            pos = self.positions(rec, stream)
        y, self.target_desc = resolve_target(rec.outputs, self.target, positions=pos)
        return y

    def describe_target(self, rec: AttentionRecord) -> Any:
        """Resolve (and validate) the target for a method that does not need its gradient; returns the
        description stored in the Explanation."""
        if self.target_desc is None:
            logits = main_logits(rec.outputs)
            if logits is None and self.target is None:
                return None
            stream = "decoder" if "decoder" in rec.stream_names() else self.stream(rec)
            if logits is not None and logits.ndim == 3 and self.target is None and (
                logits.shape[1] != rec.stream_shape(stream)[-1]
            ):
                return None  # per-query outputs (detection): no single class to name for a class-agnostic map
            with torch.no_grad():
                self.target_scores(rec)
        return self.target_desc

    # -- result -------------------------------------------------------------------------------------
    def build(
        self,
        rec: AttentionRecord,
        full_row: torch.Tensor,
        readout: Readout | list[int] | None,
        stream: str = "self",
        layers: torch.Tensor | None = None,
        extra: dict | None = None,
        prefix: int | None = None,
        options: dict | None = None,
        source: Callable | None = None,
    ) -> Explanation:
        """Assemble the Explanation: padded tokens zeroed, prefix (and suffix) tokens dropped from ``scores``.

        ``readout``: the :class:`Readout` that chose the rows, a list of one position per example, or None
        (input-gradient baselines, which have no rows). ``source``: for a stream linked to another (a VLM's
        language stream), ``f(stream, readout, layers) -> (N, n_v)`` rows of that stream's relevance (see
        :func:`source_rows`); the Explanation is then composed over both (see :meth:`build_linked`)."""
        info = self.info(rec, stream)
        if info.merges and full_row.shape[-1] != rec.stream_shape(stream)[-1]:
            raise ValueError(
                f"method {self.method.name!r} gave a row over {full_row.shape[-1]} tokens, but "
                f"{type(self.model).__name__}'s stream is a stage chain (tokens merge between stages) and its "
                f"units are the {rec.stream_shape(stream)[-1]} input patches; methods that compose the chain: "
                f"{', '.join(CHAIN_METHODS)}"
            )
        if self.composes(rec, stream, source):
            return self.build_linked(rec, full_row, readout, stream, source, layers=layers, options=options)
        full_row = full_row.detach().to(torch.float32).cpu()
        mask = info.mask
        if mask is not None:
            # where, not a product: a model may leave NaN at padding (an example that is all padding).
            real = mask.cpu().bool()
            full_row = torch.where(real, full_row, torch.zeros((), dtype=full_row.dtype))
            if layers is not None:
                layers = torch.where(real, layers.cpu(), torch.zeros((), dtype=layers.dtype))
        p = info.prefix if prefix is None else prefix
        stop = full_row.shape[-1] - info.suffix
        if isinstance(readout, (list, tuple)):
            readout = resolve_readout(list(readout), batch=full_row.shape[0], n=full_row.shape[-1], mask=mask,
                                      source="position")
        return Explanation(
            scores=full_row[:, p:stop].clone(),
            full_row=full_row,
            layers=None if layers is None else layers.detach().to(torch.float32).cpu(),
            tokens=info.tokens,
            grid=info.grid,
            prefix=p,
            method=self.method.name,
            options=dict(self.options if options is None else options),
            target=self.describe_target(rec),
            positions=None if readout is None else readout.positions(),
            attention_mask=None if mask is None else mask.cpu(),
            extra=extra or {},
            readout=None if readout is None else readout.describe(),
            readout_weights=None if readout is None else readout.weights.detach().cpu(),
            suffix=info.suffix,
        )

    def composes(self, rec: AttentionRecord, stream: str, source: Callable | None) -> bool:
        """Whether ``stream`` is linked to another recorded stream (a VLM's image tokens) and the Explanation is
        composed over both: needs a ``source`` (ValueError naming the methods that compose, or the reason the
        tokens cannot be linked); never when the ``stream`` option picks one stream."""
        info = self.info(rec, stream)
        if self.options.get("stream") is not None:
            return False
        if info.link_reason:
            raise ValueError(
                f"{type(self.model).__name__}: the image tokens of the {stream} stream cannot be mapped to the vision "
                f"tokens ({info.link_reason}); pass stream='{stream}' to explain that stream alone (image tokens as "
                "positions) or stream='vision'"
            )
        linked = info.link is not None and info.link.source in rec.streams
        if linked and source is None:
            raise ValueError(
                f"method {self.method.name!r} does not compose the streams of {type(self.model).__name__} (a vision-"
                "language model); use 'rollout', 'grad_rollout' or 'gae', or pass stream='language' or "
                "stream='vision' to explain one stream alone"
            )
        return linked

    def build_linked(self, rec: AttentionRecord, row: torch.Tensor, readout: Readout, stream: str,
                     source: Callable, *, layers: torch.Tensor | None = None,
                     options: dict | None = None) -> Explanation:
        """The Explanation of a VLM (attnroll.core.multimodal): the language row's shares of the image tokens
        pushed through the vision stream's relevance onto its patch grid (``scores`` (B, h·w), ``grid``), the
        text positions' shares in ``extra["text_scores"]`` (B, n_l) (0 at image tokens and padding);
        ``extra["image_share"] + extra["text_share"]`` = the row's total (1 for rollout)."""
        link = self.info(rec, stream).link
        mask = self.mask(rec, stream)
        row = row.detach().to(torch.float32).cpu()
        if mask is not None:
            row = torch.where(mask.cpu().bool(), row, torch.zeros((), dtype=row.dtype))
        shape = rec.stream_shape(link.source)
        W = multimodal.source_weights(row, link.example, link.position, link.item, link.token, shape[0], shape[-1])
        weights, totals = multimodal.split_mass(W)
        src = source(link.source, Readout("weights", weights, f"the {stream} stream's shares of the image tokens"),
                     link.source_layers)
        M = multimodal.push_through(src.detach().to(torch.float32).cpu(), totals)
        image = multimodal.per_example(M, multimodal.item_examples(link.example, link.item, shape[0]), row.shape[0])
        text = multimodal.unlinked(row, link.example, link.position)
        extra = {
            "text_scores": text, "language_row": row, "image_share": image.sum(dim=-1), "text_share": text.sum(dim=-1),
            "image_positions": [link.position[link.example == b].tolist() for b in range(row.shape[0])],
        }
        if layers is not None:
            extra["language_layers"] = layers
        e = self.build(rec, image, readout, link.source, extra=extra, options=options)
        e.tokens = self.info(rec, stream).tokens
        return e


def unread_layers(rec: AttentionRecord) -> set[tuple[str, int]]:
    """(stream, layer) pairs whose output no linked stream reads (a VLM's vision layers after the feature
    layer): a gradient never reaches them, by the model's construction."""
    out = set()
    for info in rec.info.values():
        link = info.link
        if link is not None and link.source in rec.streams:
            out |= {(link.source, i) for i in range(link.source_layers, len(rec.streams[link.source]))}
    return out


_ABSENT = object()  # source_rows: the method takes no protect_prefix option


def source_rows(ctx: Context, rec: AttentionRecord, fn: Callable, layers_of: Callable, *,
                protect_prefix: Any = _ABSENT, **options: Any) -> Callable:
    """The ``source=`` of :meth:`Context.build` for a linked stream: ``f(stream, readout, k) -> (N, n)`` rows
    of ``fn`` (a core rollout) over the first k layers of ``layers_of(stream)``, with the method's per-layer
    options; start_layer / end_layer / return_layers belong to the explained stream and are not passed on.
    ``protect_prefix`` (when the method takes it) is resolved for the source stream's own prefix."""
    opts = {k: v for k, v in options.items() if k not in ("start_layer", "end_layer", "return_layers")}

    def rows(stream: str, readout: Readout, k: int) -> torch.Tensor:
        if k == 0:  # the projector reads the embeddings: no vision layer mixes the tokens
            return readout.weights
        extra = {} if protect_prefix is _ABSENT else {"protect_prefix": prefix_default(protect_prefix, ctx.info(rec, stream))}
        return rollout_rows(fn, list(layers_of(stream))[:k], readout, ctx.mask(rec, stream), **extra, **opts)[0]

    return rows


def gather_rows(R: torch.Tensor, rows: list[int], positions: list[int], *, layer_axis: bool = False) -> torch.Tensor:
    """Pick, for example b, the row ``positions[b]`` out of R computed for the sorted distinct ``rows``:
    R (B, [H,] r, n) -> (B, [H,] n); with ``layer_axis`` (L, B, [H,] r, n) -> (L, B, [H,] n)."""
    idx = [rows.index(p) for p in positions]
    if layer_axis:
        return torch.stack([R[:, b, ..., i, :] for b, i in enumerate(idx)], dim=1)
    return torch.stack([R[b, ..., i, :] for b, i in enumerate(idx)])


def _token_level(outputs: Any, n: int | None = None) -> bool:
    """Whether the main logits are per token (B, n, V) — not per query (detection heads, other lengths)."""
    logits = main_logits(outputs)
    return logits is not None and logits.ndim == 3 and (n is None or logits.shape[1] == n)


#: Methods that compose a stage chain (``StreamInfo.merges``: Swin) down to the input patches.
CHAIN_METHODS = ("rollout", "raw", "grad_rollout", "gae")


def _readout_size(rec: AttentionRecord, stream: str, info: StreamInfo) -> tuple[int, int]:
    """(B, n) of the rows a readout picks: the last layer's tokens for a stage chain, else the stream's."""
    shape = rec.stream_shape(stream)
    if info.merges and rec.streams.get(stream):
        return shape[0], rec.streams[stream][-1].shape[-1]
    return shape[0], shape[-1]


def resolve_target(outputs: Any, target: Any, *, positions: list[int] | None = None) -> tuple[torch.Tensor, Any]:
    """The target's score per example, y (B,), and how to record the target.

    * ``target`` callable: ``target(outputs)`` must return a tensor of shape (B,).
    * otherwise the main logits are used: (B, C) class scores, or (B, n, V) token-level scores read at
      ``positions`` (one per example: the next-token logits of a decoder). ``None`` = the argmax per
      example; an int = that index for every example; a list = one index per example.
    """
    if callable(target) and not isinstance(target, (int, list, tuple)):
        y = target(outputs)
        logits = main_logits(outputs)
        B = None if logits is None else logits.shape[0]
        return _checks.check_target_output(y, B, target), f"callable: {getattr(target, '__qualname__', type(target).__name__)}"
    logits = main_logits(outputs)
    if logits is None:
        raise ValueError(
            f"target: the model's output ({type(outputs).__name__}) has no logits to take a class score from; "
            "pass target=a callable f(outputs) -> (B,) scores (e.g. lambda o: o.pooler_output.norm(dim=-1))"
        )
    if logits.ndim == 3:
        if positions is None:
            positions = [logits.shape[1] - 1] * logits.shape[0]
        logits = logits[torch.arange(logits.shape[0], device=logits.device), torch.tensor(positions, device=logits.device)]
    if logits.ndim != 2:
        raise ValueError(
            f"target: the model's logits have shape {tuple(logits.shape)}; class targets need (B, C) or (B, n, V). "
            "Pass target=a callable f(outputs) -> (B,) instead"
        )
    B, C = logits.shape
    idx = _checks.check_target(target, B, C, default=logits.detach().argmax(dim=-1).tolist())
    y = logits[torch.arange(B, device=logits.device), torch.tensor(idx, device=logits.device)]
    return y, idx


def require_grad_mode(name: str) -> None:
    """Gradient methods need autograd: refuse torch.no_grad() / inference_mode() with the way out."""
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        where = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise RuntimeError(
            f"method {name!r} needs gradients of the target with respect to the attention, but it was called "
            f"under {where}. Call attnroll.explain outside that block (attnroll computes no parameter "
            "gradients and leaves .grad untouched), or use a gradient-free method such as 'rollout' or 'raw'."
        )


# ------------------------------------------------------------------------------------------- entry points
def check_options(method: str | Method, options: dict) -> dict:
    """Validate ``options`` for ``method`` (a name or its registry entry) and return them completed with the
    defaults. ValueError for an unknown method, an option it does not take (naming the methods that do) or
    an option it refuses (saying why)."""
    m = method if isinstance(method, Method) else _get(method)
    allowed = {**COMMON_OPTIONS, **m.options}
    for k in options:
        if k in allowed:
            continue
        if k in m.refuse:
            raise ValueError(f"option {k}= makes no sense for method {m.name!r}: {m.refuse[k]}")
        takers = [n for n, other in _REGISTRY.items() if k in other.options]
        hint = f" Methods that take {k}=: {', '.join(takers)}." if takers else ""
        raise ValueError(
            f"method {m.name!r} has no option {k!r}. Its options: {', '.join(sorted(allowed))}.{hint}"
        )
    _option_checks.check_values(m.name, options)  # values too, before any model runs
    return {**allowed, **options}


def explain(
    model: nn.Module,
    inputs: Any,
    method: str = "rollout",
    target: Any = None,
    *,
    tokenizer: Any = None,
    **options: Any,
) -> Explanation:
    """Explain what ``model`` looked at for ``inputs`` with a registered method.

    Args:
        model: a model ``attnroll.capture`` supports (transformers ViT/DeiT/BEiT/DINOv2/BERT-likes/GPT-2/
            Llama/CLIP/T5/BART/Marian, timm ViTs, nn.MultiheadAttention models).
        inputs: what the model's processor / tokenizer returns (a dict / BatchEncoding), or a pixel tensor
            (B, 3, H, W).
        method: a name from :func:`methods` ("rollout" by default).
        target: None = the predicted class (argmax of the logits; for decoder-only LMs the argmax next token
            at the explained position); an int = that class / token id for every example; a list of ints =
            one per example; a callable ``f(model_outputs) -> (B,)`` tensor for anything else.
        tokenizer: fills ``Explanation.tokens`` from ``input_ids``.
        **options: the method's options (see ``method_info(name).options``), plus ``position``: the output
            row to explain (an int or one per example; also the position of a token-level target), and
            ``readout``: which output rows, with what weights — "cls", "mean" (the real tokens after the
            prefix), "last", "eot", a position, one position per example, or a weight vector (n,) / (B, n).
            Default: the rows the model's prediction reads, as its adapter declares (CLS for CLS
            classifiers, the mean for mean-pooled encoders, the last real token for decoders, ...); the
            Explanation records it in ``readout`` / ``readout_weights``.

    Returns:
        an :class:`Explanation` (scores (B, units), full_row (B, n), ...).

    Raises:
        ValueError: unknown method (the message lists them), an option the method does not take, a target
            out of range or a callable returning the wrong shape.
        RuntimeError: a gradient method under ``torch.no_grad()`` / ``torch.inference_mode()``.
    """
    return Prepared(model, method, tokenizer=tokenizer, **options)(inputs, target)


class Prepared:
    """``explain(model, inputs, method, target, tokenizer=tokenizer, **options)`` for many calls, with what
    depends only on the model, the method and the options resolved once, at construction: the method's
    registry entry, the options validated and completed with the defaults, and the facts a method reads of
    the model without a forward pass (``Context.facts``: its family, how its attention is computed), which
    are remembered from the first call. Each call then runs only the method itself (the forward, the
    product, the Explanation), with the same result as ``explain``.

    For a model that keeps its structure and attention implementation between calls (the batch engine's
    own, loaded for the run); :func:`explain` makes a fresh one per call. ``overrides`` of a call are
    validated again with the fixed options (e.g. the ``random`` control's per-batch seed)."""

    def __init__(self, model: nn.Module, method: str = "rollout", *, tokenizer: Any = None, **options: Any):
        self.model, self.tokenizer = model, tokenizer
        self.method = _get(method)
        self.given = dict(options)
        self.options = check_options(self.method, self.given)
        self.memo: dict[Any, Any] = {}  # the model facts of Context.facts, filled by the first call

    @contextlib.contextmanager
    def keep(self) -> Iterator["Prepared"]:
        """Within the block, the calls share one capture session (the recompute route's: its adapter, kernel
        wrapper, hooks and eval mode set up on the first call instead of on each), closed at the end of the
        block, also when it raises; the model is then as before. Results are those of fresh sessions. For the
        batch engine's own model (see the class docstring); one call at a time."""
        if "keep" in self.memo:
            raise RuntimeError("Prepared.keep: already inside a keep() block of this explain")
        with contextlib.ExitStack() as stack:
            self.memo["keep"], self.memo["kept"] = stack, {}  # the sessions, opened by their first call
            try:
                yield self
            finally:
                del self.memo["keep"], self.memo["kept"]

    def __call__(self, inputs: Any, target: Any = None, **overrides: Any) -> Explanation:
        m = self.method
        opts = check_options(m, {**self.given, **overrides}) if overrides else dict(self.options)
        if m.needs_grad:
            require_grad_mode(m.name)
        ctx = Context(self.model, inputs, target, m, opts, self.tokenizer, memo=self.memo)
        return m.fn(ctx, **{k: v for k, v in opts.items() if k not in COMMON_OPTIONS})


class Explainer:
    """A model and a method with fixed options, to explain many inputs: ``Explainer(model, "gae")(inputs)``.

    Options are validated once, at construction."""

    def __init__(self, model: nn.Module, method: str = "rollout", *, tokenizer: Any = None, **options: Any):
        self.model = model
        self.method = _get(method).name
        check_options(self.method, options)
        self.tokenizer = tokenizer
        self.options = options

    def __call__(self, inputs: Any, target: Any = None, **overrides: Any) -> Explanation:
        return explain(
            self.model, inputs, self.method, target, tokenizer=self.tokenizer, **{**self.options, **overrides}
        )

    def __repr__(self) -> str:
        return f"Explainer({type(self.model).__name__}, method={self.method!r}, options={self.options!r})"


# ------------------------------------------------------------------------- shared by the rollout methods
#: The options of ``attnroll.rollout`` that explain passes through (rows / attention_mask are set by explain).
ROLLOUT_OPTIONS = {
    "head_fusion": "mean",
    "alpha": 0.5,
    "residual_mode": "blend",
    "discard_ratio": 0.0,
    "discard_scope": "layer",
    "top_k": None,
    "threshold": None,
    "protect_prefix": None,
    "start_layer": 0,
    "end_layer": None,
    "return_layers": False,
    "dtype": None,
}
#: Options of ``attnroll.rollout`` that explain sets itself, and what to use instead.
ROLLOUT_REFUSE = {
    "rows": "explain picks the output row itself; pass position=k (an int or one per example)",
    "attention_mask": "explain takes the padding mask from the inputs",
    "check_stochastic": "captured attention is always softmax probabilities",
}


def prefix_default(protect_prefix: int | None, info: Any) -> int:
    """protect_prefix=None: the stream's prefix tokens (CLS, distillation, registers), at least 1.

    ``info``: the stream's StreamInfo (or a record: its main-stream prefix)."""
    return max(1, info.prefix or 0) if protect_prefix is None else protect_prefix


def rollout_rows(fn: Callable, attentions: Any, readout: Readout | list[int], mask: torch.Tensor | None, *,
                 return_layers: bool = False, info: StreamInfo | None = None,
                 **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a core rollout function (``rollout`` / ``per_head_rollout``) for only the rows the readout reads
    and combine them with its weights: (B, [H,] n) and, with ``return_layers``, (L', B, [H,] n).

    ``readout`` may also be a list of one position per example (a one-hot readout). ``info``: the stream's
    StreamInfo; a stage chain (``info.merges``) is composed down to the first layer's tokens
    (``core.stages.chain_rollout``), and layers whose rows are not probabilities (``info.nonstochastic``)
    are refused unless the options accept any non-negative matrices (``check_stochastic=False``)."""
    if not isinstance(readout, Readout):
        B = len(readout)
        n = (attentions[0] if isinstance(attentions, (list, tuple)) else attentions[0]).shape[-1]
        readout = resolve_readout(list(readout), batch=B, n=n, mask=None)
    return_layers = _checks.check_bool("return_layers", return_layers)
    if info is not None:
        _check_stochastic_layers(info, len(attentions), options)
    if info is not None and info.merges:
        return _chain_rows(fn, attentions, readout, info, return_layers, options), None
    rows = readout.rows()
    R = fn(attentions, rows=rows, return_layers=return_layers, attention_mask=mask, **options)
    return combine_rows(R, readout, rows, layered=return_layers)


def combine_rows(R: torch.Tensor, readout: Readout, rows: list[int], *, layered: bool = False):
    """Weighted sum of rows: R (B, [H,] r, n) computed for ``rows`` -> (B, [H,] n) (and with ``layered``,
    R (L', B, [H,] r, n) -> (last (B, [H,] n), all (L', B, [H,] n)))."""
    w = readout.weights[:, rows].to(device=R.device, dtype=R.dtype)
    if layered:
        sel = torch.einsum("br,lb...rn->lb...n", w, R)
        return sel[-1], sel
    return torch.einsum("br,b...rn->b...n", w, R), None


def _check_stochastic_layers(info: StreamInfo, num_layers: int, options: dict) -> None:
    """Refuse, with the adapter's reason, a rollout of probabilities over layers that hold none."""
    if not info.nonstochastic or options.get("check_stochastic") is False:
        return
    from ..core.rollout import layer_range

    start, end = layer_range(num_layers, options.get("start_layer", 0), options.get("end_layer"))
    hit = [i for i in info.nonstochastic if start <= i < end]
    if hit:
        raise ValueError(
            f"layers {hit[:4]}{'...' if len(hit) > 4 else ''} hold no attention probabilities: "
            f"{info.stochastic_reason}. Rollout of probabilities does not apply there; use a gradient method "
            f"('grad_rollout', 'gae'), 'raw', or start_layer={max(hit) + 1} to roll out only the layers after them"
        )


def _chain_rows(fn: Callable, attentions: Any, readout: Readout, info: StreamInfo, return_layers: bool,
                options: dict) -> torch.Tensor:
    """The readout's weighted row composed down a stage chain: (B, n_0)."""
    from ..core.rollout import rollout as core_rollout
    from ..core.stages import chain_rollout

    if fn is not core_rollout:
        raise ValueError(
            f"{getattr(fn, '__name__', fn)} keeps one chain per head, but this stream's stages have their own "
            "heads and merge between them (a stage chain); use method='rollout' (heads fused per layer)"
        )
    if return_layers:
        raise ValueError(
            "return_layers=True: the partial products of a stage chain live on different token grids (the "
            "readout's rows exist only after the last merge); use return_layers=False"
        )
    opts = {k: v for k, v in options.items() if k != "attention_mask"}
    return chain_rollout(list(attentions), info.merges, readout.weights, **opts)
