"""``Context``: what a method works on — the model, the inputs, the target, the options — and the steps every
method shares: capture (with or without attention gradients), the stream to explain, its output positions
and readout rows (the policy is :mod:`attnroll.capture.readout`), the target's scores, and ``build``, which
assembles the :class:`~attnroll.explain.explanation.Explanation` (composed over two streams for a VLM).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from .. import _checks
from .._modes import params_require_grad
from ..capture import capture as _capture
from ..capture import model_facts
from ..capture.hf import is_hf_model
from ..capture.mixers import check_mixers, describe
from ..capture.outputs import main_logits
from ..capture.readout import Readout, explained_positions, explained_readout, resolve_readout
from ..capture.record import AttentionRecord, StreamInfo
from .explanation import Explanation
from .linked import compose_link
from .memory import check_dense_memory
from .registry import Method
from .sinks import finish as finish_sinks
from .specials import apply as apply_specials
from .target_scores import require_grad_mode, resolve_target

__all__ = ["Context", "unread_layers", "CHAIN_METHODS"]

#: Methods that compose a stage chain (``StreamInfo.merges``: Swin) down to the input patches.
CHAIN_METHODS = ("rollout", "raw", "grad_rollout", "gae")


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

    def check_mixers(self) -> None:
        """Refuse (``mixers="compose"``) or record and warn about (``mixers="attention_only"``) the token mixers
        other than softmax attention in the model's block stack (:mod:`attnroll.capture.mixers`), for the
        methods that read its layers; found once per model and mode (``memo``)."""
        mode = self.options.get("mixers") or "compose"
        if not self.method.reads_layers:
            return
        key = ("mixers", mode)
        if key not in self.memo:
            self.memo[key] = describe(check_mixers(self.model, mode, self.method.name))
        left_out = self.memo[key]
        if left_out:
            warnings.warn(
                f"mixers='attention_only': method {self.method.name!r} rolls out through the attention layers of "
                f"{type(self.model).__name__} alone, leaving out its {len(left_out)} other token mixers "
                f"({'; '.join(left_out)}): a partial map", UserWarning, stacklevel=4)

    def mixer_extra(self) -> dict:
        """``{"mixers": "attention_only", "mixers_left_out": [...]}`` when the map leaves mixers out, else {}."""
        left_out = self.memo.get(("mixers", self.options.get("mixers") or "compose"))
        return {"mixers": "attention_only", "mixers_left_out": list(left_out)} if left_out else {}

    # -- capture ------------------------------------------------------------------------------------
    def record(self, fuse_heads: Any = None) -> AttentionRecord:
        """Capture the attention of one forward pass (no gradients), resolving the target for the record."""
        check_dense_memory(self.model, self.inputs, self.method.name, fused=fuse_heads is not None)
        self.rec = self.drop_mixers(_capture(self.model, self.inputs, fuse_heads=fuse_heads, tokenizer=self.tokenizer))
        self.check_attention(self.rec)
        return self.rec

    def drop_mixers(self, rec: AttentionRecord) -> AttentionRecord:
        """With ``mixers="attention_only"``, the record without its composed mixers' layers (the adapter lists them
        in ``extra["mixer_layers"]``): the attention layers alone, as the option says; else ``rec`` unchanged."""
        layers = rec.extra.get("mixer_layers")
        if (self.options.get("mixers") or "compose") != "attention_only" or not layers:
            return rec
        drop = set(map(tuple, layers))
        for s in {s for s, _ in drop}:
            rec.streams[s] = [a for i, a in enumerate(rec.streams[s]) if (s, i) not in drop]
        rec.extra.pop("mixer_weighted", None)
        return rec

    def check_attention(self, rec: AttentionRecord) -> None:
        """Refuse NaN / infinite attention at real tokens (what every method reads); padded query rows may
        hold anything (an example that is all padding gives NaN rows) and are zeroed by the methods."""
        for s, layers in rec.streams.items():
            mask = self.mask(rec, s)
            for i, t in enumerate(layers):
                x = t.detach()
                if mask is not None and x.shape[-2] == mask.shape[-1]:
                    rows = mask.to(device=x.device, dtype=torch.bool)[:, None, :, None]
                    x = torch.where(
                        rows if x.ndim == 4 else rows[:, 0], x, torch.zeros((), dtype=x.dtype, device=x.device)
                    )
                _checks.check_finite(f"the attention of {type(self.model).__name__} (stream {s!r}, layer {i})", x)

    def grad_record(self, streams: list[str] | None = None, scores: Callable | None = None,
                    clamp: str = "per_head"):
        """Forward with autograd, the target scores y (B,), and dy/dA for every layer of ``streams``.

        Returns (record, {stream: [A_l detached]}, {stream: [dy/dA_l]}), layers in layer-index order (the
        order of the attention modules in the model, never hook order). ``scores(record) -> (B,)`` replaces
        the default target resolution (CLIP, encoder-decoders). A composed token mixer's layer
        (``record.extra["mixer_weighted"]``) comes as its gradient-weighted matrix (B, 1, n, n) (``clamp``: where
        its positive part is taken, capture/mixers.py ``mixer_reading``) with a gradient of ones, so that
        ``gradient_weighted`` gives that matrix back."""
        require_grad_mode(self.method.name)
        check_dense_memory(self.model, self.inputs, self.method.name, keep_grad=True)
        with params_require_grad(self.model, partly=True):
            rec = self.drop_mixers(_capture(self.model, self.inputs, keep_grad=True, tokenizer=self.tokenizer))
        self.rec = rec
        self.check_attention(rec)
        names = list(rec.streams) if streams is None else streams
        y = scores(rec) if scores is not None else self.target_scores(rec)
        # Parallel branches of one layer are separate tensors in the graph: differentiate each, then
        # concatenate their heads as the layer's tensor was.
        branches = rec.extra.get("branches", {})
        # A layer the adapter rebuilt from the model's own tensor (Swin windows, CaiT class rows) is
        # differentiated through that tensor; lift() puts the gradient in the layer's layout.
        native = {**rec.extra.get("native", {}), **rec.extra.get("mixer_weighted", {})}
        weighted = rec.extra.get("mixer_weighted", {})  # a layer that joins paths weighs several tensors' gradients
        parts = [(s, i, branches.get((s, i)) or _differentiated(native.get((s, i)), t))
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
            if (s, i) in weighted:
                out_a[s][i] = weighted[(s, i)][1]([g.detach() for g in gs] if len(gs) > 1 else gs[0].detach(),
                                                  clamp)[:, None]
                out_g[s].append(torch.ones_like(out_a[s][i]))
                continue
            g = torch.cat([g.detach() for g in gs], dim=1) if len(gs) > 1 else gs[0].detach()
            out_g[s].append(native[(s, i)][1](g) if (s, i) in rec.extra.get("native", {}) else g)
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
        """The stream to explain: the ``stream`` option, else the record's only / "self" stream; refused when
        its token positions cannot label a map (``StreamInfo.units_reason``)."""
        name = self._stream(rec)
        self.check_units(rec, name)
        return name

    def check_units(self, rec: AttentionRecord, stream: str) -> None:
        """UnsupportedModelError when the stream's token positions cannot label a map (``units_reason``)."""
        reason = rec.info[stream].units_reason if stream in rec.info else ""
        if reason:
            raise _checks.UnsupportedModelError(
                f"{type(self.model).__name__}: stream {stream!r} cannot be explained: {reason}")

    def _stream(self, rec: AttentionRecord) -> str:
        name = self.options.get("stream")
        if name is not None:
            names = rec.stream_names()  # dense or matrix-free (whose record holds operators, not streams)
            if name not in names:
                raise ValueError(f"stream must be one of {', '.join(map(repr, names)) or '(none recorded)'}; "
                                 f"got {name!r}")
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
        outputs (decoder-only LMs), else the row of the stream's readout when it is one row, else 0
        (``capture.readout.explained_positions``)."""
        return explained_positions(rec, stream, self.options.get("position"))

    def readout(self, rec: AttentionRecord, stream: str) -> Readout:
        """The rows explained: the ``readout`` option (a position, "cls", "mean", "last", "eot", a weight
        vector), else ``position``, else the adapter's declared readout of the stream (the rows the model's
        prediction reads), else the first token (the last real one for causal streams)
        (``capture.readout.explained_readout``)."""
        return explained_readout(rec, stream, spec=self.options.get("readout"), position=self.options.get("position"),
                                 model=type(self.model).__name__)

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
        self.check_units(rec, stream)  # (every method ends here, whichever way it chose its stream)
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
        full_row, layers, extra = finish_sinks(self, rec, stream, info, full_row, layers, extra or {})
        extra = {**extra, **self.mixer_extra()}
        p = info.prefix if prefix is None else prefix
        stop = full_row.shape[-1] - info.suffix
        if isinstance(readout, (list, tuple)):
            readout = resolve_readout(list(readout), batch=full_row.shape[0], n=full_row.shape[-1], mask=mask,
                                      source="position")
        scores, extra = apply_specials(self, info, full_row, full_row[:, p:stop].clone(), p, extra)
        return Explanation(
            scores=scores,
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
        image, text, composed = compose_link(row, link, rec.stream_shape(link.source), source, stream)
        extra = {"text_scores": text, "language_row": row, "image_share": image.sum(dim=-1),
                 "text_share": text.sum(dim=-1), **composed}
        if layers is not None:
            extra["language_layers"] = layers
        P = link.placement
        e = self.build(rec, image, readout, link.source, extra=extra, options=options,
                       prefix=None if P is None else P.prefix)
        if P is not None:
            e.grid = None if P.views else P.grid  # several images: one map each, in extra["image_maps"]
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


def _differentiated(native: Any, layer: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a layer's gradient is taken at: its native tensor (a tuple of them where a layer joins several
    paths, capture/hybrids.py Wiring), else the recorded layer itself."""
    if native is None:
        return [layer]
    return list(native[0]) if isinstance(native[0], tuple) else [native[0]]
