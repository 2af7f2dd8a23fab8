"""Matrix-free capture for transformers models: what each attention kernel received, under the model's own
kernel (SDPA, flash, flex, eager — whatever the model is set to), never switching it.

transformers (5.x) attention modules fetch their kernel with
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)`` and call it
as ``kernel(module, query, key, value, attention_mask, scaling=..., dropout=..., sliding_window=...,
softcap=..., ...)`` with query and key after the position encoding. For the duration of the capture,
``AttentionInterface.get_interface`` hands out a wrapper of the very kernel it would return: the wrapper
records (query, key, mask, scaling, softcapping, window, sinks, position bias; value and the output for
gradient rules) as :class:`~attnroll.core.operators.KernelInputs` and then calls the original kernel
(``ALL_ATTENTION_FUNCTIONS[impl]``, which a few modules use directly, is wrapped the same way). For a layer
that rollout's head mean fuses (``KernelRecorder.fuses``) under transformers' SDPA kernel on CPU, the
wrapper computes softmax·v itself (``own_attention_applies``, ``operators.attend_mean``): the
probabilities once for the output and the head mean, equal to the kernel's output to float32 rounding. While the
kernel of a layer too large for the small-n path (``operators.whole_size``) runs, a dispatch mode below
autograd notes the row log-sum-exp that fused kernels compute and SDPA drops, so that the probabilities can
later be recomputed without normalising them again (small layers are recomputed whole and need none). Both
interface methods are restored on exit, also when the forward raises. Nothing n×n is kept beyond what the
model itself builds (a padding mask, when it makes one). The transformers adapter's module walks are done
once per model structure (``kernel_adapter``). The interface patch and the other private transformers names
are :mod:`attnroll.capture.transformers_private`'s.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from contextlib import ExitStack
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _checks
from .._modes import submodules
from ..core.operators import FusedLayer, KernelInputs, attend_mean, fusable, mean_probs, whole_size
from .hf import HFAdapter, pool_heads
from .hooks import Adapter, Capture, Site
from .hybrids import RowsWiring
from .mixers import WIRED, InProjTap, rows_layer
from .readout import is_causal
from .registry import refuse_known
from .transformers_private import attn_implementation, sdpa_kernel, wrap_attention_interface


class KernelRecorder:
    """Collects one :class:`KernelInputs` per site and pass (the interface of ``hooks.Recorder`` that
    Capture drives: reset, store, finish, dirty). With ``fuse_mean`` each layer that ``fusable`` admits is
    replaced by its head-mean probabilities (``mean_probs``) right after its kernel ran, while its queries
    and keys are still in cache, except the stream's top layer: a row product needs only its live rows.
    Where the capture computes such a layer's attention itself (``own_attention_applies``), the kernel's
    output and the head mean come from one computation of the probabilities (``attend_mean``), the top
    layer's included."""

    #: Whether the kernel wrapper records (see ``hooks.Recorder.active``; False while a kept session waits).
    active = True

    def __init__(self, sites: list[Site], keep_grad: bool, fuse_mean: bool = False):
        self.sites = sites
        self.keep_grad = keep_grad
        self.fuse_mean = fuse_mean and not keep_grad
        self.layout: dict[str, list[str]] = {}
        for s in sites:
            self.layout.setdefault(s.stream, []).append(s.name)
        self.taken: dict[str, list[KernelInputs]] = {}
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.reset()

    def reset(self) -> None:
        self.slots: dict[str, list[KernelInputs | None]] = {k: [None] * len(v) for k, v in self.layout.items()}
        self.outs: dict[str, list[torch.Tensor | None]] = {k: [None] * len(v) for k, v in self.layout.items()}
        self.fired: dict[tuple[str, int], int] = {}
        self.parts: dict = {}  # the dense recorder's multi-branch attention; kernels have none
        self.dirty = False

    def fuses(self, site: Site, layer: KernelInputs, computed: bool = False) -> bool:
        """Whether ``store`` keeps this layer as its head-mean probabilities. ``computed``: when the capture
        computes the layer's attention itself (``attend_mean``: every probability is there anyway), the
        stream's top layer too; otherwise not, since a row product needs only its live rows."""
        top = site.layer == len(self.layout[site.stream]) - 1
        return self.fuse_mean and (computed or not top) and fusable(layer)

    def store(self, site: Site, layer: KernelInputs | FusedLayer, output: torch.Tensor) -> None:
        """Keep what the kernel of ``site`` saw (fused by ``mean_probs`` when ``fuses``; a FusedLayer the
        wrapper computed with the output, ``attend_mean``, as it is)."""
        self.dirty = True
        key = (site.stream, site.layer)
        self.fired[key] = self.fired.get(key, 0) + 1
        if self.keep_grad:
            self.outs[site.stream][site.layer] = output
        if isinstance(layer, KernelInputs) and self.fuses(site, layer):
            layer = mean_probs(layer)
        self.slots[site.stream][site.layer] = layer

    def finish(self) -> dict[str, list[torch.Tensor]]:
        """Check the pass and keep its layers in ``taken``; returns shape-only (meta) stand-ins of the
        attention so that the adapter's metadata (prefix, grid) can read n."""
        repeated = [f"{self.layout[s][i]} ({n} times)" for (s, i), n in sorted(self.fired.items()) if n > 1]
        if repeated:
            raise _checks.CaptureError(
                "each attention kernel must run exactly once per forward pass, but " + ", ".join(repeated)
                + " ran more than once; capture one forward pass at a time"
            )
        taken, outs = {}, {}
        for stream, slots in self.slots.items():
            missing = [i for i, t in enumerate(slots) if t is None]
            if len(missing) == len(slots):
                continue
            if missing:
                names = ", ".join(f"{i} ({self.layout[stream][i]})" for i in missing)
                raise _checks.CaptureError(
                    f"stream {stream!r}: the attention of layer(s) {names} did not go through transformers' "
                    "attention interface, so it cannot be recomputed; use attention='dense'"
                )
            taken[stream] = list(slots)
            outs[stream] = list(self.outs[stream])
        if not taken:
            raise _checks.CaptureError(
                "no attention kernel was called through transformers' attention interface in the forward pass, "
                "so nothing can be recomputed; use attention='dense'"
            )
        self.taken, self.outputs = taken, outs
        return {s: [torch.empty(lay.shape, device="meta") for lay in layers] for s, layers in taken.items()}


def sites_by_module(sites: list[Site]) -> dict[int, Site]:
    """id(module) -> site for every module a site's kernel may be called with: the site module itself or
    a child (ViTAttention -> ViTSelfAttention)."""
    out: dict[int, Site] = {}
    for site in sites:
        for m in site.module.modules():
            out.setdefault(id(m), site)
    return out


#: The public methods of Adapter that the kernel adapter takes from the transformers adapter as they are.
_DELEGATED = tuple(name for name, value in vars(Adapter).items() if callable(value) and not name.startswith("_")
                   and name not in {"sites", "install", "extract", "metadata", "input_hint", "stream_infos"})

#: model -> (structure key, transformers adapter without its model, site_of, pooling heads). Building the transformers
#: adapter walks every module several times per call, and its sites change only with the model's modules or
#: config (the key: every module's identity, the config's identity, model type and attention kernel). Weakly
#: keyed, and the entry holds no reference to the model (submodules only), so it goes with the model.
_ADAPTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _structure_key(model: nn.Module, modules: list[nn.Module]) -> tuple:
    config = getattr(model, "config", None)
    return (tuple(map(id, modules)), id(config), getattr(config, "model_type", None), attn_implementation(config))


def kernel_adapter(model: nn.Module, modules: list[nn.Module] | None = None) -> "KernelAdapter":
    """The kernel adapter of a transformers ``model``, the transformers adapter's module walks done once per
    model structure (see ``_ADAPTERS``); a fresh adapter object per capture. ``modules``: ``submodules(model)``
    when the caller has them."""
    key = _structure_key(model, submodules(model) if modules is None else modules)
    hit = _ADAPTERS.get(model)
    if hit is None or hit[0] != key:
        refuse_known(model)
        inner = HFAdapter(model)
        template = copy.copy(inner)
        template.model = None
        hit = (key, template, sites_by_module(inner.sites()), pool_heads(model))
        _ADAPTERS[model] = hit
    inner = copy.copy(hit[1])
    inner.model = model
    return KernelAdapter(inner, hit[2], hit[3])


class KernelAdapter(Adapter):
    """The transformers adapter's sites and metadata; installs the kernel wrapper instead of eager."""

    def __init__(self, inner: HFAdapter, site_of: dict[int, Site] | None = None,
                 pools: list[tuple[str, nn.Module]] | None = None):
        super().__init__(inner.model)
        self.inner = inner
        self.family = inner.family
        # Everything but where the attention comes from is the transformers adapter's own.
        for name in _DELEGATED:
            setattr(self, name, getattr(inner, name))
        self.site_of = site_of if site_of is not None else sites_by_module(inner.sites())
        self.pools = pools  # the model's attention-pooling heads (None: looked up at install)
        self._recorder: Any = None  # the session's KernelRecorder, from install
        self.rows_wiring: RowsWiring | None = None  # the joined attention-and-mixer layers, from install

    def sites(self) -> list[Site]:
        return self.inner.sites()

    def metadata(self, record: Any, inputs: dict[str, Any]) -> None:
        self.inner.metadata(record, inputs)

    def input_hint(self, inputs: Any) -> str:
        return self.inner.input_hint(inputs)

    def stream_infos(self, record: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        """The transformers adapter's stream infos; a stream whose kernels attended causally (by flag or by
        their mask) is causal, as the dense route reads it from its matrices, with the readout that follows."""
        infos = self.inner.stream_infos(record, inputs)
        taken = getattr(self._recorder, "taken", {})  # this pass's kernels (KernelRecorder.finish ran)
        for s, info in infos.items():
            layers = taken.get(s)
            if layers and not info.causal and s != "cross" and kernel_causal(layers[0]):
                self.inner.mark_causal(record, inputs, s, info)
        return infos

    def install(self, stack: ExitStack, recorder: Any, sites: list[Site]) -> None:
        def wrap(kernel: Callable, impl: str) -> Callable:
            # The lookup (get_interface, or ALL_ATTENTION_FUNCTIONS[impl]) runs through __getitem__: wrap once.
            # Another session's wrapper (a kept session waiting under this one) is wrapped like any kernel, and
            # a chain that holds this session's wrapper anywhere (the sessions' lookups call each other) is not
            # wrapped again.
            mine = recorder in getattr(kernel, "_attnroll_wrappers", ())
            return kernel if mine else self._wrapper(kernel, impl, recorder)

        wrap_attention_interface(stack, wrap)
        self.inner.install_pool_hooks(stack, self.pools)
        self._recorder = recorder
        self.rows_wiring = self._install_wiring(stack, recorder)
        for site in sites:  # Mamba-2 mixers: their gates, for the rows-only form (core.mixers.SSDRows)
            if id(site.module) in self.inner.mixer_ids:
                tap = InProjTap(site.module)  # the gates read off the mixer's own in_proj output
                stack.callback(tap.remove)
                handle = site.module.register_forward_hook(
                    lambda m, a, k, o, site=site, tap=tap: recorder.store(
                        site, self._mixer_rows(m, a, k, tap), o[0] if isinstance(o, tuple) else o)
                    if recorder.active else None, with_kwargs=True)
                stack.callback(handle.remove)

    def _mixer_rows(self, m: nn.Module, a: tuple, k: dict, tap: InProjTap) -> Any:
        """A composed mixer's layer of the row sweep: a mixer joined with attention (capture/hybrids.py
        RowsWiring), else ``rows_layer``."""
        if self.rows_wiring is not None and type(m).__name__ in WIRED:
            return self.rows_wiring.mixer(m, a, k)
        return rows_layer(m, a, k, self.inner.mixer_heads, tap=tap)

    def _install_wiring(self, stack: ExitStack, recorder: "KernelRecorder") -> RowsWiring | None:
        """The hooks of the layers that join attention and a mixer (capture/hybrids.py Wiring), rows-only; None
        when the model has none."""
        wiring = getattr(self.inner, "wiring", None)
        if not wiring:
            return None
        rows = RowsWiring(wiring, self.inner.mixer_heads)

        def join(attention: nn.Module, fn: Callable[[Any], Any]) -> None:
            site = self.site_of.get(id(attention))
            if recorder.active and site is not None and recorder.slots[site.stream][site.layer] is not None:
                recorder.slots[site.stream][site.layer] = fn(recorder.slots[site.stream][site.layer])

        def hook(m: nn.Module, fn: Callable[..., Any], pre: bool = False) -> None:
            def guarded(*args: Any) -> None:
                if recorder.active:
                    fn(*args)

            add = m.register_forward_pre_hook if pre else m.register_forward_hook
            stack.callback(add(guarded, with_kwargs=True).remove)

        rows.install(hook, join)
        return rows

    def _wrapper(self, kernel: Callable, impl: str, recorder: KernelRecorder) -> Callable:
        # Over another session's wrapper, the arguments are read by the model's kernel's own signature.
        base = getattr(kernel, "_attnroll_kernel", kernel)
        sig = _signature(base)

        def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            site = self.site_of.get(id(module)) if recorder.active else None
            if site is None:
                wiring = getattr(self, "rows_wiring", None)
                if recorder.active and wiring is not None and id(module) in wiring.shared_attention:
                    # a shared attention block (Zamba): kept for the hybrid layer that runs it (RowsWiring)
                    bound = sig.bind(module, *args, **kwargs) if sig is not None else None
                    wiring.attention_inputs(kernel_inputs(module, impl, _arguments(bound, args, kwargs), False))
                return kernel(module, *args, **kwargs)
            bound = sig.bind(module, *args, **kwargs) if sig is not None else None
            arguments = _arguments(bound, args, kwargs)
            layer = kernel_inputs(module, impl, arguments, recorder.keep_grad)
            if recorder.fuses(site, layer, computed=True) and own_attention_applies(base, layer, arguments):
                out, fused = attend_mean(layer, arguments["value"])  # the probabilities computed once
                recorder.store(site, fused, out)
                return out, None
            if whole_size(layer):  # recomputed whole, with its own row max: no log-sum-exp needed
                out = kernel(module, *args, **kwargs)
            else:
                with LseWatch() as watch:  # the fused kernel's own row log-sum-exp, which SDPA drops
                    out = kernel(module, *args, **kwargs)
                layer.lse = watch.lse(layer.shape)
            o = out[0] if isinstance(out, (tuple, list)) else out
            recorder.store(site, layer, o)
            return out

        call._attnroll_kernel = base  # type: ignore[attr-defined]
        #: the recorders of every session's wrapper in this chain, this one's included
        call._attnroll_wrappers = (*getattr(kernel, "_attnroll_wrappers", ()), recorder)  # type: ignore[attr-defined]
        return call


def own_attention_applies(kernel: Callable, layer: KernelInputs, a: dict[str, Any]) -> bool:
    """Whether the capture may compute a layer that it fuses (``KernelRecorder.fuses``) itself
    (``operators.attend_mean``) instead of calling the model's kernel and then computing the probabilities a
    second time: transformers' SDPA kernel on CPU in float32 without dropout, gradients, a window (which SDPA
    does not apply without a mask) or a mask, bias, softcapping or sinks (``fusable``), where what that kernel
    computes is softmax(scaling·q·kᵀ, causal or not)·v exactly. (Where the fused kernel is fast, on
    accelerators, it keeps running and the probabilities are computed after it.)"""
    q, k, v = a["query"], a["key"], a["value"]
    tensors = (q, k, v)
    return (
        kernel is sdpa_kernel()
        and q.device.type == "cpu"
        and layer.window is None
        and not float(a.get("dropout") or 0.0)
        and all(t.dtype == torch.float32 and not t.requires_grad for t in tensors)
        and v.ndim == 4
        and v.shape[:3] == k.shape[:3]
        and not a.get("output_attentions")
    )


#: Fused attention operators that return each query row's log-sum-exp as their second output (CPU flash,
#: CUDA flash / memory-efficient / cuDNN, the backend-neutral override).
_LSE_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_fused_attention_overrideable")


class LseWatch(TorchDispatchMode):
    """While active, notes the log-sum-exp output of every fused attention operator that runs (below
    autograd: the operator and its outputs are untouched). ``lse(shape)`` gives it when exactly one ran
    and it fits the layer, else None (the operators then recompute it)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.name().split("::")[-1] in _LSE_OPS and isinstance(out, (tuple, list)) and len(out) > 1:
            if isinstance(out[1], torch.Tensor):
                self.seen.append(out[1])
        return out

    def lse(self, shape: tuple[int, int, int, int]) -> torch.Tensor | None:
        B, H, nq, _ = shape
        if len(self.seen) != 1:
            return None
        lse = self.seen[0]
        if lse.ndim == 4 and lse.shape[-1] == 1:
            lse = lse[..., 0]
        # The memory-efficient kernel pads rows to a multiple of 32.
        if lse.ndim != 3 or tuple(lse.shape[:2]) != (B, H) or lse.shape[2] < nq or lse.dtype != torch.float32:
            return None
        return lse[..., :nq].detach()


def _signature(fn: Callable) -> inspect.Signature | None:
    """The kernel's signature, cached: every attention forward asks for its kernel again."""
    try:
        return _cached_signature(fn)
    except TypeError:  # an unhashable callable
        return _uncached_signature(fn)


@functools.lru_cache(maxsize=64)
def _cached_signature(fn: Callable) -> inspect.Signature | None:
    return _uncached_signature(fn)


#: The arguments transformers passes every attention kernel first, in order (after the module).
_KERNEL_ARGS = ("query", "key", "value", "attention_mask")


def _uncached_signature(fn: Callable) -> inspect.Signature | None:
    """The signature the kernel's arguments are bound by: ``fn``'s own, through ``functools.wraps``'
    ``__wrapped__`` chain (``inspect.signature`` follows it); None when it cannot be read or does not name
    query, key and value (a decorator's ``(*args, **kwargs)`` wrapper without ``__wrapped__``): the arguments
    are then read by transformers' calling convention, ``kernel(module, query, key, value, attention_mask,
    **kwargs)``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sig if set(_KERNEL_ARGS[:3]) <= set(sig.parameters) else None


def _arguments(bound: inspect.BoundArguments | None, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The kernel's arguments by name (its **kwargs flattened in)."""
    if bound is None:
        return {**dict(zip(_KERNEL_ARGS, args)), **kwargs}
    out = {}
    for k, v in bound.arguments.items():
        if bound.signature.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(v)
        else:
            out[k] = v
    return out


def kernel_inputs(module: nn.Module, impl: str | None, a: dict[str, Any], keep_value: bool) -> KernelInputs:
    """What one kernel call sees, with transformers' conventions: ``scaling`` None = 1/√d; a missing mask
    means causal attention for the fused kernels (SDPA, flash: ``is_causal``, else the module's flag) and
    no mask at all for eager; a 2-D mask is flash's padding mask (causality and ``sliding_window`` then come
    from the flags); a 4-D mask already carries causality and the window."""
    missing = [name for name in _KERNEL_ARGS[:3] if not isinstance(a.get(name), torch.Tensor)]
    if missing:
        raise _checks.CaptureError(
            f"the attention kernel {impl!r} of {type(module).__name__} was called without tensors for "
            f"{', '.join(missing)} (arguments: {', '.join(a) or 'none'}), so its queries and keys cannot be "
            "recorded; use attention='dense'")
    q, k, v, mask = a["query"], a["key"], a["value"], a.get("attention_mask")
    scaling = a.get("scaling")
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise _checks.CaptureError(
            f"the attention kernel {impl!r} got a {type(mask).__name__} mask (e.g. flex attention's BlockMask), "
            "which attnroll cannot recompute blockwise; use attention='dense' or an sdpa/eager/flash model"
        )
    module_causal = bool(getattr(module, "is_causal", False))
    padding_2d = mask is not None and mask.ndim == 2  # flash kernels: (B, n_k) 1 = real token
    if padding_2d:
        mask = mask[:, None, None, :].bool()
    # Fused kernels build causality and the window themselves when no 4-D mask carries them.
    structural = (mask is None or padding_2d) and impl not in (None, "eager", "paged|eager")
    causal = False
    if structural:
        flag = a.get("is_causal")
        causal = q.shape[-2] > 1 and bool(getattr(module, "is_causal", True) if flag is None else flag)
    window = a.get("sliding_window") if structural else None
    sinks = a.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    bias = a.get("position_bias")
    return KernelInputs(
        q=_own(q, not keep_value),
        k=_own(k, not keep_value),
        scaling=float(scaling),
        mask=None if mask is None else mask.detach(),
        causal=causal,
        window=int(window) if window else None,
        softcap=float(a["softcap"]) if a.get("softcap") else None,
        sinks=None if sinks is None else sinks.detach(),
        bias=None if bias is None else bias.detach(),
        v=v.detach() if keep_value else None,
        is_causal_model=module_causal,
    )


def kernel_causal(layer: KernelInputs | FusedLayer) -> bool:
    """Whether a kernel call attended causally: by its flag, or by a square (.., n, n) mask that hides every key
    after its query (boolean False, or an additive mask of -1e4 or less); a layer fused to its head-mean
    probabilities by what they show, as the dense route reads its matrices."""
    if isinstance(layer, FusedLayer):
        return is_causal(layer.probs)
    mask = layer.mask
    if layer.causal:
        return True
    if mask is None or mask.ndim != 4 or mask.shape[-1] != mask.shape[-2] or mask.shape[-1] < 2:
        return False
    n = mask.shape[-1]
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=mask.device), diagonal=1)
    above = mask[0, 0][upper]  # causality is structural: the first example's mask shows it (n x n, not B x n x n)
    return bool((~above).all()) if mask.dtype == torch.bool else bool((above <= -1e4).all())


def _own(t: torch.Tensor, compact: bool) -> torch.Tensor:
    """``t`` detached; with ``compact``, copied when it is a view into a larger buffer (GPT-2's fused q/k/v
    projection: keeping q and k as views would keep v alive too)."""
    t = t.detach()
    if compact and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


class KernelCapture(Capture):
    """A capture session recording kernel inputs instead of attention matrices; the record's ``operators``
    holds them (``streams`` stays empty)."""

    def __init__(self, model: nn.Module, *, keep_grad: bool, tokenizer: Any = None, eval_mode: bool = True,
                 fuse_mean: bool = False, modules: list[nn.Module] | None = None):
        super().__init__(
            model, kernel_adapter(model, modules), fuse=None, keep_grad=keep_grad, dtype=None,
            eval_mode=eval_mode, tokenizer=tokenizer,
        )
        self.recorder = KernelRecorder(self.site_list, keep_grad, fuse_mean)  # type: ignore[assignment]
        self.record.fused = None

    def _finalize(self, outputs: Any) -> None:
        super()._finalize(outputs)
        self.record.operators = self.recorder.taken
        for s, layers in self.record.operators.items():  # causality from the modules, not from a matrix
            if s in self.record.info:
                self.record.info[s].causal = self.record.info[s].causal or layers[0].is_causal_model
        self.record.extra["kernel_outputs"] = self.recorder.outputs
        self.record.streams = {}


def capture_kernels(model: nn.Module, inputs: Any, *, keep_grad: bool = False, tokenizer: Any = None,
                    fuse_mean: bool = False) -> Any:
    """One forward pass of a transformers ``model`` under its own attention kernel; returns an
    AttentionRecord whose ``operators[stream]`` are per-layer ``KernelInputs``. With ``keep_grad`` the forward
    runs with autograd and ``extra["kernel_outputs"][stream]`` holds each kernel's output (B, n, H, d_v),
    still in the graph, for dy/dO. With ``fuse_mean`` (head-mean rules only; not with ``keep_grad``) small
    layers below each stream's top one are kept as :class:`~attnroll.core.operators.FusedLayer`."""
    modules = submodules(model)
    _checks.check_model_device(model, modules)
    session = KernelCapture(model, keep_grad=keep_grad, tokenizer=tokenizer, fuse_mean=fuse_mean, modules=modules)
    session.adapter.check_inputs(inputs)
    with session as record:
        _one_pass(session, inputs, keep_grad)
    return record


def _one_pass(session: KernelCapture, inputs: Any, keep_grad: bool) -> None:
    """Run the model once on ``inputs`` under the open ``session``; CaptureError when its own forward never
    returned (so no record was filled)."""
    from .hooks import run_forward

    before = session.passes
    with torch.enable_grad() if keep_grad else torch.no_grad():
        run_forward(session.model, inputs, session.adapter.input_hint)
    if session.passes == before:
        raise _checks.CaptureError("the forward pass finished without the model's own forward returning")


class KeptCapture:
    """``capture_kernels(model, inputs, tokenizer=, fuse_mean=)`` for many forward passes of one model with one
    session: the adapter, its kernel wrapper and hooks and eval mode are set up on enter and undone on exit
    (also when the block raises), not once per pass. Between :meth:`capture` calls the session waits
    (``KernelRecorder.active`` False): the model, and any other capture of it, run as if it were not there.
    Each pass gives a fresh AttentionRecord, the same as ``capture_kernels`` would (no gradients).

    For a model whose modules, config and attention implementation stay as they were at enter (the batch
    engine's own, loaded for the run); ``capture`` refuses a model whose config or attention implementation
    changed. Not thread-safe: one pass at a time."""

    def __init__(self, model: nn.Module, *, tokenizer: Any = None, fuse_mean: bool = False):
        self.model, self.tokenizer, self.fuse_mean = model, tokenizer, fuse_mean
        self.session: KernelCapture | None = None
        self._key: tuple = ()

    def __enter__(self) -> "KeptCapture":
        modules = submodules(self.model)
        _checks.check_model_device(self.model, modules)
        session = KernelCapture(self.model, keep_grad=False, tokenizer=self.tokenizer, fuse_mean=self.fuse_mean,
                                modules=modules)
        session.__enter__()
        session.recorder.active = False
        self.session, self._key = session, _config_key(self.model)
        return self

    def __exit__(self, *exc: Any) -> bool:
        session, self.session = self.session, None
        if session is not None:  # (no pass is pending: each capture resets the recorder after it)
            session.__exit__(*exc)
        return False

    def capture(self, inputs: Any) -> Any:
        """One forward pass of the model on ``inputs``: its AttentionRecord, as ``capture_kernels`` returns."""
        session = self.session
        if session is None:
            raise RuntimeError("KeptCapture.capture: the session is not open (use it inside its with block)")
        if _config_key(self.model) != self._key:
            raise _checks.CaptureError(
                f"the config or attention implementation of {type(self.model).__name__} changed while a kept capture "
                "session was open; capture with a fresh session (capture_kernels)")
        session.adapter.check_inputs(inputs)
        record = session.record = _fresh_record(session)
        session.recorder.reset()
        session.recorder.active = True
        try:
            _one_pass(session, inputs, False)
        finally:
            # Nothing of the pass stays with the session (as with a session per pass): the record, the kept
            # layers (which may alias the thread's reused buffers, operators.kept_buffers) and the inputs.
            session.recorder.active = False
            session.recorder.reset()
            session.recorder.taken, session.recorder.outputs, session._inputs = {}, {}, {}
            session.record = _fresh_record(session)
        return record


def _config_key(model: nn.Module) -> tuple:
    config = getattr(model, "config", None)
    return id(config), attn_implementation(config)


def _fresh_record(session: KernelCapture) -> Any:
    """An empty record for the session's next pass (what ``KernelCapture.__init__`` starts with)."""
    from .record import AttentionRecord

    return AttentionRecord(fused=None, keep_grad=False, family=session.adapter.family)

