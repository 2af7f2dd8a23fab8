"""Model-independent capture machinery: the per-layer recorder, the capture session (hooks installed and
removed, model state restored) and the generic ``modules=`` / ``to_probs=`` adapter.

An adapter knows one model family. It lists the attention *sites* (one per layer and stream), switches the
model onto a code path that materialises the attention probabilities (eager attention, fused attention
off), installs whatever hook hands each site's probabilities to :meth:`Recorder.store`, and fills in token
metadata (prefix tokens, patch grid, padding mask). Every change it makes is registered on an
``ExitStack`` so that the session can undo it, in reverse order, also when the forward pass raises.
"""

from __future__ import annotations

import functools
import inspect
import re
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .. import _checks
from .._modes import eval_mode
from ..core.fusion import fuse_tensor
from .record import AttentionRecord, ModelFacts, StreamInfo, is_causal, resolve_readout

#: The "Supported: ..." text of the unsupported-model messages. The family registry (``registry.py``, which
#: generates it from its entries) hands it over when ``attnroll.capture`` is imported; the adapters sit below
#: the registry that names them, so they read it here, at the time they raise.
_SUPPORTED = {"text": "the families of attnroll.capture.registry.FAMILIES, or modules=[...] with to_probs="}


def supported_families() -> str:
    """The supported families, as the unsupported-model messages list them (the family registry's text)."""
    return _SUPPORTED["text"]


def set_supported_families(text: str) -> None:
    """Called once by the family registry with the text it generates from its entries."""
    _SUPPORTED["text"] = text


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_FAMILIES":  # the name of the text before the registry generated it
        return supported_families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(kw_only=True)
class Site:
    """One attention module whose probabilities make one layer of one stream."""

    module: nn.Module
    name: str  # qualified module name in the model
    stream: str
    layer: int  # index within the stream, in module order (never hook-firing order)


def stream_names(names: Sequence[str], *, towers: bool = True) -> list[str]:
    """Stream of each self-attention module from its qualified name.

    Encoder/decoder names are used only when the model has both (an encoder-only model whose stack is
    called ``encoder``, like ViT, stays "self"); likewise "vision"/"text" only when both towers exist.
    """
    parts = [name.split(".") for name in names]

    def tower(comps: list[str]) -> str | None:
        for c in comps:
            if c.startswith("vision") or c == "visual":
                return "vision"
            if c.startswith("text"):
                return "text"
        return None

    def side(comps: list[str]) -> str | None:
        if "decoder" in comps:
            return "decoder"
        if "encoder" in comps:
            return "encoder"
        for c in comps:  # a named stack: "text_encoder" / "text_decoder" (SeamlessM4T)
            if c.endswith("_decoder"):
                return "decoder"
            if c.endswith("_encoder"):
                return "encoder"
        return None

    if towers:
        t = [tower(c) for c in parts]
        if {"vision", "text"} <= set(t) and None not in t:
            return t  # type: ignore[return-value]
    s = [side(c) for c in parts]
    if {"encoder", "decoder"} <= set(s) and None not in s:
        return s  # type: ignore[return-value]
    return ["self"] * len(names)


def make_sites(entries: Sequence[tuple]) -> list[Site]:
    """Number the layers of each stream in the order given (callers pass module order).

    An entry is (name, module, stream) or (name, module, stream, group): consecutive entries of one stream
    with the same non-None group are branches of ONE layer (timm parallel blocks); their heads are
    concatenated into that layer's tensor."""
    counters: dict[str, int] = {}
    last_group: dict[str, Any] = {}
    sites = []
    for entry in entries:
        name, module, stream = entry[:3]
        group = entry[3] if len(entry) > 3 else None
        if group is not None and last_group.get(stream) == group:
            layer = counters[stream] - 1
        else:
            layer = counters.get(stream, 0)
            counters[stream] = layer + 1
        last_group[stream] = group
        sites.append(Site(module=module, name=name, stream=stream, layer=layer))
    return sites


class Recorder:
    """Collects one forward pass's attention: exactly one tensor per (stream, layer).

    ``store`` runs inside hooks: it fuses heads there (so per-head tensors are never kept when
    ``fuse_heads`` is set), detaches unless ``keep_grad``, and casts to ``dtype``.
    """

    #: Whether the session's hooks record (a session kept open between passes, ``recompute.KeptCapture``,
    #: lets the model run untouched in between); a plain session is active from enter to exit.
    active = True

    def __init__(self, sites: Sequence[Site], *, fuse: Any, keep_grad: bool, dtype: torch.dtype | None):
        self.sites = list(sites)
        self.fuse = fuse
        self.keep_grad = keep_grad
        self.dtype = dtype
        self.layout: dict[str, list[str]] = {}
        self.branches: dict[tuple[str, int], list[str]] = {}
        for s in self.sites:
            names = self.layout.setdefault(s.stream, [])
            if s.layer < len(names):
                names[s.layer] += "+" + s.name  # a parallel branch of the same layer
            else:
                names.append(s.name)
            self.branches.setdefault((s.stream, s.layer), []).append(s.name)
        self.reset()

    def reset(self) -> None:
        self.slots: dict[str, list[torch.Tensor | None]] = {k: [None] * len(v) for k, v in self.layout.items()}
        self.parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.fired: dict[tuple[str, int], int] = {}
        self.returned_none: list[str] = []
        self.dirty = False

    def store(self, site: Site, probs: Any) -> None:
        """Keep ``probs`` (B, H, n_q, n_k) — or (B, n_q, n_k), read as one head — for ``site``."""
        self.dirty = True
        key = (site.stream, site.layer)
        branches = self.branches.get(key, [site.name])
        if len(branches) > 1:
            key = (site.stream, site.layer, site.name)  # type: ignore[assignment]
        self.fired[key] = self.fired.get(key, 0) + 1
        if probs is None:
            self.returned_none.append(site.name)
            return
        if not isinstance(probs, torch.Tensor):
            raise TypeError(
                f"the attention of module {site.name!r} must be a torch.Tensor of probabilities, got "
                f"{_checks.describe(probs)}"
            )
        if probs.ndim == 3:
            probs = probs.unsqueeze(1)
        if probs.ndim != 4:
            raise _checks.CaptureError(
                f"module {site.name!r} gave attention of shape {tuple(probs.shape)}; expected (B, H, n_q, n_k)"
            )
        if len(branches) > 1:
            # Parallel branches of one layer (timm parallel blocks): each adds its attention's output to the
            # same residual, so the layer mixes tokens with all their heads together: heads concatenated,
            # then treated as one layer. The branch tensors stay in `parts` for their gradients.
            got = self.parts.setdefault((site.stream, site.layer), {})
            got[site.name] = probs
            if len(got) < len(branches):
                return
            for t in got.values():
                if self.keep_grad and t.requires_grad:
                    t.retain_grad()
            probs = torch.cat([got[b] for b in branches], dim=1)
            if self.keep_grad:
                self.slots[site.stream][site.layer] = probs
                return
        self.slots[site.stream][site.layer] = self._kept(site, probs)

    def _kept(self, site: Site, probs: torch.Tensor) -> torch.Tensor:
        """The tensor kept for a layer: in the graph (keep_grad), or detached, head-fused and cast."""
        if self.keep_grad:
            if probs.requires_grad:
                # retain_grad makes .grad appear on this very tensor after backward (it is a non-leaf).
                probs.retain_grad()
            return probs
        t = probs.detach()
        if self.fuse is not None:
            how = self.fuse
            if isinstance(how, torch.Tensor):
                if how.numel() != t.shape[1]:
                    raise ValueError(
                        f"fuse_heads weights must have one entry per head: module {site.name!r} has "
                        f"H={t.shape[1]} heads, got {how.numel()} weights"
                    )
                how = how.to(device=t.device, dtype=t.dtype if t.is_floating_point() else torch.float32)
            t = fuse_tensor(t, how)
        if self.dtype is not None:
            t = t.to(self.dtype)
        return t

    def finish(self) -> dict[str, list[torch.Tensor]]:
        """The complete streams of this pass; raises CaptureError naming missing or repeated layers.

        Streams of which no layer ran are left out (e.g. only the vision tower of CLIP was called)."""
        repeated = [
            f"{key[2] if len(key) > 2 else self.layout[key[0]][key[1]]} ({n} times)"
            for key, n in sorted(self.fired.items()) if n > 1
        ]
        if repeated:
            raise _checks.CaptureError(
                "each attention module must run exactly once per forward pass, but "
                + ", ".join(repeated)
                + " ran more than once. Capture one forward pass at a time (modules shared across layers, "
                "as in ALBERT, are not supported; use modules=/to_probs= with distinct modules)."
            )
        streams: dict[str, list[torch.Tensor]] = {}
        for stream, slots in self.slots.items():
            missing = [i for i, t in enumerate(slots) if t is None]
            if len(missing) == len(slots):
                continue
            if missing:
                names = ", ".join(f"{i} ({self.layout[stream][i]})" for i in missing)
                hint = ""
                if self.returned_none:
                    hint = (
                        " These modules returned no attention weights: "
                        + ", ".join(self.returned_none)
                        + " (a fused / SDPA / flash attention path does not compute them)." + _NO_WEIGHTS_FIX
                    )
                raise _checks.CaptureError(
                    f"stream {stream!r}: no attention was captured for layer(s) {names} of "
                    f"{len(slots)}.{hint}"
                )
            streams[stream] = list(slots)  # type: ignore[arg-type]
        if not streams:
            detail = ""
            if self.returned_none:
                detail = (
                    " The attention modules ran but returned no weights (a fused / SDPA / flash path): "
                    + ", ".join(self.returned_none[:4]) + "." + _NO_WEIGHTS_FIX
                )
            raise _checks.CaptureError("no attention was captured in the forward pass." + detail)
        if self.keep_grad and not any(t.requires_grad for layers in streams.values() for t in layers):
            raise _checks.CaptureError(
                "keep_grad=True, but the captured attention is not part of an autograd graph: run the forward "
                "pass with gradients enabled (not under torch.no_grad() / torch.inference_mode()) and make sure "
                "some parameter or input requires grad."
            )
        return streams


class Adapter:
    """Base class of the family adapters (see module docstring)."""

    family = "?"
    #: True for adapters that read the attention from the model's own return value (transformers'
    #: public ``output_attentions=True`` path) instead of hooking modules: :meth:`sites` is empty and
    #: :meth:`output_streams` names the tensors after each pass.
    from_outputs = False

    def output_streams(self, output: Any) -> dict[str, list[Any]]:
        """Stream name -> per-layer attention tensors found in the model's output (``from_outputs``)."""
        return {}

    def call_inputs(self, inputs: Any) -> Any:
        """How the function form calls the model with ``inputs`` (see :func:`run_forward`)."""
        return inputs

    def bound_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The forward arguments by name, as the metadata reads them (a family may unwrap them)."""
        return inputs

    def __init__(self, model: nn.Module):
        self.model = model

    def sites(self) -> list[Site]:
        raise NotImplementedError

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        """Switch the model onto a path that materialises attention and hook every site. Every change must
        be undone through ``stack``. The default hooks each site's forward output via :meth:`extract`."""
        for site in sites:
            stack.enter_context(forward_hook(site.module, self._hook_for(site, recorder)))

    def _hook_for(self, site: Site, recorder: Recorder) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            recorder.store(site, self.extract(site, args, output))

        return hook

    def extract(self, site: Site, args: tuple, output: Any) -> Any:
        """Turn a site's forward (args, output) into (B, H, n_q, n_k) probabilities."""
        return output

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        """Fill prefix / grid / tokens / attention_mask from the bound forward arguments ``inputs``."""

    def input_hint(self, inputs: Any) -> str:
        """A family-specific hint added to the error when the forward rejects ``inputs`` ("" = none)."""
        return ""

    #: Keys of which inputs must hold at least one (e.g. input_ids or pixel_values); () = no such rule.
    main_inputs: tuple[str, ...] = ()
    #: An example of valid inputs for error messages.
    inputs_example = ""

    def check_inputs(self, inputs: Any) -> None:
        """Refuse inputs the forward cannot take, before it runs: the wrong container, keys that are not
        arguments of the forward, required arguments missing (see ``_checks.check_model_inputs``)."""
        params, required, open_kw = forward_params(self.model)
        positional = isinstance(inputs, (torch.Tensor, tuple, list))
        main = tuple(k for k in self.main_inputs if k in params)
        _checks.check_model_inputs(
            inputs,
            model=type(self.model).__name__,
            params=params,
            required=() if positional else required,
            required_any=main,
            open_keywords=open_kw,
            hint=self.inputs_example,
        )

    # -- the contract ---------------------------------------------------------------------------------
    def stream_infos(self, record: AttentionRecord, inputs: dict[str, Any]) -> dict[str, StreamInfo]:
        """One :class:`StreamInfo` per recorded stream, from the flat metadata :meth:`metadata` filled in.

        The conventional stream names mean: "self" / "encoder" / "text" take ``record.attention_mask``,
        "decoder" ``extra["decoder_attention_mask"]``; only "self" and "vision" streams have prefix tokens
        and a patch grid; the decoder's tokens are ``extra["decoder_tokens"]``. Adapters refine this
        through :meth:`stream_kind`, :meth:`affixes` and :meth:`readout_spec`."""
        out = {}
        for s, layers in record.streams.items():
            B, n = layers[0].shape[0], layers[0].shape[-1]
            mask = record.extra.get("decoder_attention_mask") if s == "decoder" else (
                record.attention_mask if s in ("self", "encoder", "text") else None
            )
            if not isinstance(mask, torch.Tensor) or mask.shape[-1] != n or mask.shape[0] != B:
                mask = None
            image = s in ("self", "vision")
            info = StreamInfo(
                kind=self.stream_kind(s, record, inputs),
                mask=None if mask is None else mask.detach().to(torch.long),
                prefix=(record.prefix or 0) if image else 0,
                grid=record.grid if image else None,
                tokens=record.extra.get("decoder_tokens") if s == "decoder" else record.tokens,
                causal=s == "decoder" or is_causal(layers[0]),
                input_key=self.input_key(s, inputs),
            )
            info.prefix, info.suffix = self.affixes(s, record, info)
            if info.kind == "image" and info.grid is None:
                info.grid_reason = record.extra.get("grid_reason", "the patch grid is unknown for this model")
            if s != "cross" and layers[0].shape[-2] == n and not self.readout_after_layout(s, record):
                spec, source = self.readout_spec(s, record, info, inputs)
                if spec is None:
                    info.readout_reason = source
                else:
                    info.readout = resolve_readout(
                        spec, batch=B, n=n, mask=info.mask, prefix=info.prefix, suffix=info.suffix, source=source,
                        eot=record.extra.get(f"{s}_eot"),
                    )
            out[s] = info
        return out

    def readout_after_layout(self, stream: str, record: AttentionRecord) -> bool:
        """Whether this adapter's own ``stream_infos`` resolves the readout of ``stream`` after the base one
        (once its token layout is known), so that the base leaves it to it."""
        return False

    def stream_kind(self, stream: str, record: AttentionRecord, inputs: dict[str, Any]) -> str:
        """"image", "text", "audio" or "tokens" for a stream."""
        if stream == "vision" or (stream == "self" and record.grid is not None):
            return "image"
        if stream in ("text", "encoder", "decoder") or inputs.get("input_ids") is not None:
            return "text"
        return "tokens"

    def affixes(self, stream: str, record: AttentionRecord, info: StreamInfo) -> tuple[int, int]:
        """(prefix, suffix) token counts of a stream (default: as filled in, no suffix)."""
        return info.prefix, int(record.extra.get(f"{stream}_suffix", 0))

    def input_key(self, stream: str, inputs: dict[str, Any]) -> str | None:
        """The forward argument carrying a stream's input."""
        for key in ("pixel_values", "input_ids", "input_values", "inputs_embeds", "x", "src"):
            if inputs.get(key) is not None and (key != "pixel_values" or stream in ("self", "vision", "encoder")):
                return key
        return None

    def readout_spec(
        self, stream: str, record: AttentionRecord, info: StreamInfo, inputs: dict[str, Any]
    ) -> tuple[Any, str]:
        """The default readout of a stream and where it comes from: the last real token of causal
        streams, else the first token (CLS)."""
        return ("last", "default: causal attention reads the last real token") if info.causal else (
            "cls", "default: the first token"
        )

    def facts(self) -> ModelFacts:
        """Facts about the model that need no forward pass (see :class:`ModelFacts`)."""
        return ModelFacts(family=self.family)


class forward_hook:
    """Context manager: a forward hook registered on enter and removed on exit."""

    def __init__(self, module: nn.Module, hook: Callable):
        self.module, self.hook, self.handle = module, hook, None

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self.hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()


def set_attr_temporarily(stack: ExitStack, obj: Any, name: str, value: Any) -> None:
    """Set ``obj.name = value`` and register restoring it exactly (deleting it if it was not an instance
    attribute before, so a class attribute or method shows through again)."""
    had_own = name in getattr(obj, "__dict__", {})
    old = obj.__dict__[name] if had_own else None

    def restore() -> None:
        if had_own:
            obj.__dict__[name] = old
        elif name in obj.__dict__:
            del obj.__dict__[name]

    stack.callback(restore)
    # Plain values (flags, bound functions) live in __dict__, which is also where nn.Module.__setattr__
    # would put them; writing there directly keeps restore() exact.
    obj.__dict__[name] = value


def forward_signature(model: nn.Module) -> inspect.Signature:
    """The signature of ``model.forward`` (bound: no ``self``), read once per forward function (every capture
    asks for it twice). Raises TypeError / ValueError as ``inspect.signature`` does."""
    fwd = model.forward
    func = getattr(fwd, "__func__", None)
    if func is None or getattr(fwd, "__self__", None) is not model:
        return inspect.signature(fwd)  # a forward set on the instance, a partial, ...: not cached
    try:
        return _bound_signature(func)
    except TypeError:  # an unhashable function object
        return inspect.signature(fwd)


@functools.lru_cache(maxsize=256)
def _bound_signature(func: Callable) -> inspect.Signature:
    sig = inspect.signature(func)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def forward_params(model: nn.Module) -> tuple[list[str], list[str], bool]:
    """(named parameters of ``model.forward``, those without a default, whether it takes ``**kwargs``);
    everything open when the signature cannot be read."""
    try:
        sig = forward_signature(model)
    except (TypeError, ValueError):
        return [], [], True
    kinds = inspect.Parameter
    named = [p for p in sig.parameters.values() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    required = [p.name for p in named if p.default is kinds.empty]
    open_kw = any(p.kind is kinds.VAR_KEYWORD for p in sig.parameters.values())
    return [p.name for p in named], required, open_kw


def bind_inputs(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The forward arguments by parameter name (positional ones included), best effort."""
    try:
        sig = forward_signature(model)
        bound = sig.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return dict(kwargs)
    out = dict(bound.arguments)
    for k, v in list(out.items()):
        # **kwargs of the forward arrive as one dict under the parameter's name; flatten it.
        if sig.parameters[k].kind is inspect.Parameter.VAR_KEYWORD and isinstance(v, dict):
            out.pop(k)
            out.update(v)
    return out


# ----------------------------------------------------------------------------------- generic adapter
class ModulesAdapter(Adapter):
    """Any model: the user names the attention modules and how to read probabilities from them."""

    family = "modules"

    def __init__(self, model: nn.Module, modules: Any, to_probs: Callable | None):
        super().__init__(model)
        if to_probs is not None and not callable(to_probs):
            raise TypeError(
                f"to_probs must be a callable f(module, args, output) -> probabilities, got "
                f"{_checks.describe(to_probs)}"
            )
        self.to_probs = to_probs
        self.entries = self._resolve(modules)

    def _resolve(self, modules: Any) -> list[tuple[str, nn.Module]]:
        named = list(self.model.named_modules())
        by_name = dict(named)
        order = {id(m): i for i, (_, m) in enumerate(named)}
        name_of = {id(m): n for n, m in named}
        if isinstance(modules, str):
            try:
                pattern = re.compile(modules)
            except re.error as e:
                raise ValueError(f"modules={modules!r} is not a valid regular expression: {e}") from None
            found = [(n, m) for n, m in named if n and pattern.fullmatch(n)]
            if not found:
                sample = ", ".join(n for n, _ in named[1:8])
                raise ValueError(
                    f"modules={modules!r} matches no module name (matched with re.fullmatch against qualified "
                    f"names such as {sample}, ...)"
                )
            return found
        if isinstance(modules, nn.Module):
            modules = [modules]
        if not isinstance(modules, (list, tuple)) or not modules:
            raise TypeError(
                "modules must be a non-empty list of modules or module names, or a regular expression string; "
                f"got {_checks.describe(modules)}"
            )
        found = []
        for i, m in enumerate(modules):
            if isinstance(m, str):
                if m not in by_name:
                    raise ValueError(f"modules[{i}]={m!r} is not the name of a submodule of the model")
                m = by_name[m]
            if not isinstance(m, nn.Module):
                raise TypeError(f"modules[{i}] must be an nn.Module or a module name, got {_checks.describe(m)}")
            if id(m) not in order:
                raise ValueError(f"modules[{i}] ({type(m).__name__}) is not a submodule of the model")
            found.append((name_of[id(m)], m))
        if len({id(m) for _, m in found}) != len(found):
            raise ValueError("modules lists the same module twice")
        # Layer index = module order in the model, whatever order the user listed them in.
        return sorted(found, key=lambda nm: order[id(nm[1])])

    def sites(self) -> list[Site]:
        return make_sites([(n, m, "self") for n, m in self.entries])

    def extract(self, site: Site, args: tuple, output: Any) -> Any:
        if self.to_probs is not None:
            return self.to_probs(site.module, args, output)
        if isinstance(output, torch.Tensor):
            return output
        raise TypeError(
            f"module {site.name!r} returned {_checks.describe(output)}, not a tensor of probabilities: pass "
            "to_probs=f(module, args, output) that returns the (B, H, n, n) attention"
        )


# ------------------------------------------------------------------------------------------ session
class Capture:
    """A capture session; use as a context manager (``with attnroll.capture(model) as rec:``).

    On enter: the model is switched to eval mode (unless ``eval_mode=False``) and onto a path that
    materialises attention, and hooks are installed; the returned :class:`AttentionRecord` is filled each
    time the model's own forward returns (it then holds the latest pass: after ``model.generate(...)``
    that is the last decoding step, whose attention rows cover only the new token). If the model itself is
    never called (only a submodule such as a CLIP tower), the record is filled on exit, without the
    input-derived metadata (prefix, grid, mask). On exit everything is restored, also when the block
    raises.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: Adapter,
        *,
        fuse: Any,
        keep_grad: bool,
        dtype: torch.dtype | None,
        eval_mode: bool,
        tokenizer: Any = None,
    ):
        self.model = model
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.eval_mode = eval_mode
        self.site_list = adapter.sites()
        self._recorder_args = dict(fuse=fuse, keep_grad=keep_grad, dtype=dtype)
        if not self.site_list and not adapter.from_outputs:
            raise _checks.UnsupportedModelError(
                f"found no attention module in {type(model).__name__}. Supported: {supported_families()}"
            )
        self.recorder = Recorder(self.site_list, fuse=fuse, keep_grad=keep_grad, dtype=dtype)
        self.fuse_label = None if fuse is None else (fuse if isinstance(fuse, str) else "weights")
        self.record = AttentionRecord(fused=self.fuse_label, keep_grad=keep_grad, family=adapter.family)
        self.passes = 0
        self._inputs: dict[str, Any] = {}
        self._stack: ExitStack | None = None

    # -- hooks on the model itself delimit passes
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.recorder.active:
            return
        self.recorder.reset()
        self._inputs = self.adapter.bound_inputs(bind_inputs(self.model, args, kwargs))

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.recorder.active:
            return
        if self.adapter.from_outputs:
            self._collect(output)
        self._finalize(output)

    def _collect(self, output: Any) -> None:
        """Public path: the attention tensors the model returned become this pass's layers."""
        streams = self.adapter.output_streams(output)
        entries = [(f"outputs.{s}[{i}]", self.model, s) for s, ts in streams.items() for i in range(len(ts))]
        self.recorder = Recorder(make_sites(entries), **self._recorder_args)
        for site in self.recorder.sites:
            self.recorder.store(site, streams[site.stream][site.layer])

    def _finalize(self, outputs: Any) -> None:
        streams = self.recorder.finish()
        rec = self.record
        rec.streams = streams
        rec.layer_names = {s: list(self.recorder.layout[s]) for s in streams}
        rec.outputs = outputs
        rec.prefix, rec.grid, rec.tokens, rec.attention_mask = None, None, None, None
        rec.extra = {}
        if self.recorder.keep_grad and self.recorder.parts:
            rec.extra["branches"] = {k: list(v.values()) for k, v in self.recorder.parts.items()}
        self.adapter.metadata(rec, self._inputs)
        if self.tokenizer is not None:
            rec.tokens = tokens_of(self.tokenizer, self._inputs.get("input_ids"), "input_ids")
            if self._inputs.get("decoder_input_ids") is not None:
                rec.extra["decoder_tokens"] = tokens_of(
                    self.tokenizer, self._inputs["decoder_input_ids"], "decoder_input_ids"
                )
        rec.info = self.adapter.stream_infos(rec, self._inputs)
        self.passes += 1
        self.recorder.reset()

    def __enter__(self) -> AttentionRecord:
        stack = ExitStack()
        try:
            if self.eval_mode:
                stack.enter_context(eval_mode(self.model))
            self.adapter.install(stack, self.recorder, self.site_list)
            pre = self.model.register_forward_pre_hook(self._pre, with_kwargs=True)
            stack.callback(pre.remove)
            post = self.model.register_forward_hook(self._post, with_kwargs=True)
            stack.callback(post.remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self.record

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        stack, self._stack = self._stack, None
        try:
            if exc_type is None and self.recorder.dirty:
                # A submodule was called directly (the model's own forward did not close the pass).
                self._finalize(None)
        finally:
            if stack is not None:
                stack.close()
        return False


#: The fix an attention module that returned no weights needs (named in the capture's errors).
_NO_WEIGHTS_FIX = (
    " For a transformers model: load it with attn_implementation=\"eager\", or leave out modules= so that "
    "attnroll.capture / attnroll.explain read the attention under any kernel."
)


def tokens_of(tokenizer: Any, ids: Any, name: str) -> list[list[str]] | None:
    """Token strings per example via ``tokenizer.convert_ids_to_tokens``."""
    if ids is None:
        return None
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise TypeError(
            f"tokenizer must have a convert_ids_to_tokens method (a transformers tokenizer), got "
            f"{_checks.describe(tokenizer)}"
        )
    ids_t = torch.as_tensor(ids)
    if ids_t.ndim == 1:
        ids_t = ids_t.unsqueeze(0)
    return [list(tokenizer.convert_ids_to_tokens(row)) for row in ids_t.tolist()]


def run_forward(model: nn.Module, inputs: Any, hint: Callable[[Any], str] | None = None) -> Any:
    """Call the model on ``inputs``: a mapping is passed as keyword arguments, a tensor as the one
    positional argument, a tuple/list as positional arguments. When the forward rejects them, a note
    (plus the adapter's ``hint(inputs)``) is added to the exception."""
    if isinstance(inputs, Mapping):
        call = lambda: model(**inputs)  # noqa: E731
    elif isinstance(inputs, torch.Tensor):
        call = lambda: model(inputs)  # noqa: E731
    elif isinstance(inputs, (tuple, list)):
        call = lambda: model(*inputs)  # noqa: E731
    else:
        raise TypeError(
            "inputs must be a dict of keyword arguments (what a processor / tokenizer returns), a tensor, or a "
            f"tuple of positional arguments; got {_checks.describe(inputs)}"
        )
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the note is added to every error of the model's own forward
        if isinstance(e, (_checks.CaptureError, _checks.UnsupportedModelError)) or not hasattr(e, "add_note"):
            raise
        what = (
            "keys " + ", ".join(map(str, inputs.keys())) if isinstance(inputs, Mapping) else _checks.describe(inputs)
        )
        e.add_note(
            f"attnroll.capture: the forward pass of {type(model).__name__} failed on the given inputs ({what}). "
            "Check that they are what the model's processor / tokenizer produces (image size, required keys)."
            + (" " + hint(inputs) if hint is not None and hint(inputs) else "")
        )
        raise
