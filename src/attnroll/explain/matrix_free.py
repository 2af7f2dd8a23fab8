"""The matrix-free route of the row methods (``raw``, ``rollout``, ``grad_rollout``, ``gae``).

``attention=None`` (auto) takes it for transformers models whenever the method's options need only the
explained rows (no sparsification, which ranks a whole matrix); ``"recompute"`` insists on it and says why
when it cannot; ``"dense"`` keeps the eager capture of n×n matrices. Both routes give the same Explanation
(to float32 rounding): the recompute route recomputes each layer's probabilities blockwise from the queries
and keys its own kernel saw (``attnroll.capture.recompute``) and folds them into the row product
(``attnroll.core.operators``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import _checks
from .._checks import UnsupportedModelError
from .._modes import params_require_grad
from ..capture import CaptureError
from ..capture.hybrids import rows_refusal
from ..capture.mixers import composable_mixers
from ..capture.recompute import KeptCapture, capture_kernels
from ..core import operators
from ..core.rollout import LayerPipeline, layer_range
from .context import Context
from .rows import prefix_default
from .target_scores import require_grad_mode

MODES = ("dense", "recompute")


def choose(ctx: Context, attention: Any, refusal: str | None) -> bool:
    """Whether to take the recompute route. ``refusal``: why these options need the dense matrices (None
    when rows suffice)."""
    if attention is not None:
        _checks.check_choice("attention", attention, MODES)
    if attention == "dense":
        return False
    facts = ctx.facts()
    supported = facts is not None and not facts.encoder_decoder
    dense_only = facts.dense_only if supported else ""
    if supported and not dense_only and composable_mixers(ctx.model) and ctx.options.get("mixers") == "attention_only":
        dense_only = "mixers='attention_only' drops its composed mixer layers from the dense record"
    if supported and not dense_only and ctx.method.name != "rollout" and composable_mixers(ctx.model):
        dense_only = (f"method {ctx.method.name!r} reads attention rows or gradients, which its token mixers "
                      "(composed as dense matrices) do not have; `rollout` sweeps them rows-only")
    if supported and not dense_only and ctx.method.name == "rollout" and composable_mixers(ctx.model):
        dense_only = rows_refusal(ctx.model, ctx.options.get("head_fusion", "mean"))
    if attention == "recompute":
        if dense_only:
            raise ValueError(f"attention='recompute' cannot be used for {type(ctx.model).__name__}: {dense_only}; "
                             "use attention='dense'")
        if not supported:
            raise ValueError(
                f"attention='recompute' needs a transformers model whose attention goes through its attention "
                f"interface (decoder-only or encoder-only); got {type(ctx.model).__name__}. Use attention='dense'"
            )
        if refusal:
            raise ValueError(f"attention='recompute' cannot be used here: {refusal}; use attention='dense'")
        return True
    return supported and refusal is None and not dense_only


def sparsity_refusal(opts: dict) -> str | None:
    """Why sparsification options need the dense path (they rank entries of whole matrices), or None."""
    for k in ("discard_ratio", "top_k", "threshold"):
        if opts.get(k):
            return f"{k}={opts[k]!r} sparsifies whole attention matrices"
    return None


def record(ctx: Context, attention: Any, fuse_mean: bool = False) -> Any:
    """Capture kernel inputs (no gradients); in auto mode None when the model's attention did not go through
    the interface (the caller then takes the dense route). ``fuse_mean``: the rule is the head mean of the
    probabilities, so small layers may be fused during the forward (``capture_kernels``)."""
    try:
        kept = kept_capture(ctx, fuse_mean)
        ctx.rec = (kept.capture(ctx.inputs) if kept is not None else
                   capture_kernels(ctx.model, ctx.inputs, tokenizer=ctx.tokenizer, fuse_mean=fuse_mean))
    except (CaptureError, UnsupportedModelError):  # no kernel to record (e.g. attention read from outputs)
        if attention == "recompute":
            raise
        return None
    return ctx.rec


def kept_capture(ctx: Context, fuse_mean: bool) -> KeptCapture | None:
    """The capture session kept open for the calls of a :class:`~attnroll.explain.explainer.Prepared` explain
    (``Prepared.keep``: ``ctx.memo["keep"]``, the block's ExitStack; ``ctx.memo["kept"]``, its sessions), opened
    on its first call; None outside such a block (each call then opens its own)."""
    stack = ctx.memo.get("keep")
    if stack is None:
        return None
    kept = ctx.memo["kept"]
    if fuse_mean not in kept:
        kept[fuse_mean] = stack.enter_context(KeptCapture(ctx.model, tokenizer=ctx.tokenizer, fuse_mean=fuse_mean))
    return kept[fuse_mean]


def grad_record(ctx: Context, attention: Any, stream: str | None) -> Any:
    """Capture with autograd, then dy/dO for every kernel output of the stream(s), stored on the layers as
    ``grad_out`` (B, H, n, d_v). None in auto mode when the capture is not possible."""
    require_grad_mode(ctx.method.name)
    try:
        with params_require_grad(ctx.model, partly=True):
            rec = capture_kernels(ctx.model, ctx.inputs, keep_grad=True, tokenizer=ctx.tokenizer)
    except (CaptureError, UnsupportedModelError):  # no kernel to record (e.g. attention read from outputs)
        if attention == "recompute":
            raise
        return None
    ctx.rec = rec
    outs_by_stream = rec.extra.pop("kernel_outputs")
    names = [stream] if stream else rec.stream_names()
    y = ctx.target_scores(rec)
    outs = [o for s in names for o in outs_by_stream[s]]
    grads = torch.autograd.grad(y.sum(), outs, allow_unused=True)
    layers = [lay for s in names for lay in rec.operators[s]]
    for lay, o, g in zip(layers, outs, grads):
        B, H, nq, _ = lay.shape
        g = torch.zeros_like(o) if g is None else g.detach()
        lay.grad_out = g.reshape(B, nq, H, -1).transpose(1, 2)  # kernels return (B, n, H, d_v)
    return rec


def layers_of(rec: Any, stream: str) -> list[operators.KernelInputs]:
    """The stream's layers; self-attention only (the row operator maps a layer's queries onto its keys)."""
    layers = rec.operators[stream]
    B, H, nq, nk = layers[0].shape
    if nq != nk:
        raise ValueError(
            f"stream {stream!r} is cross-attention ({nq} queries x {nk} keys); the recompute route handles "
            "self-attention streams; use attention='dense'"
        )
    return layers


#: What the dense route's check (``attnroll.rollout``) says after the row sums, here for explain's users.
SINK_HINT = ("Attention sinks take part of each row's softmax mass, so the rows are not stochastic and attention "
             "rollout does not apply; raw, grad_rollout and gae accept such rows.")


def check_stochastic(layers: list[operators.KernelInputs], start: int, end: int, head_fusion: Any,
                     mask: torch.Tensor | None) -> None:
    """Rollout of probabilities needs rows that sum to 1, as the dense route checks on the captured matrices:
    a layer with attention sinks has row sums 1 − exp(sink − lse) (B, H, n) (fused by the mean for
    ``head_fusion="mean"``, per head otherwise, real tokens only). Raises the dense route's ValueError."""
    for i in reversed(range(start, end)):  # top layer first, the order in which the dense route meets them
        lay = layers[i]
        if lay.sinks is None:
            continue
        lse = operators.row_lse(lay)
        sums = 1 - torch.exp(lay.sinks.to(torch.float32).reshape(1, -1, 1) - lse)
        if isinstance(head_fusion, str) and head_fusion == "mean":
            sums = sums.mean(dim=1)
            real = None if mask is None else mask
        else:
            real = None if mask is None else mask[:, None, :].expand_as(sums)
        _checks.check_values(f"attentions[{i}]", 0.0, sums if real is None else sums[real], stochastic=True,
                             how_to_accept=SINK_HINT, atol=_checks.stochastic_atol(torch.float32))


def product(ctx: Context, rec: Any, stream: str, rule: Any, *, alpha: float, residual_mode: str,
            start_layer: int, end_layer: Any, return_layers: bool, head_fusion: Any = None,
            protect_prefix: int = 1, dtype: Any = None) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """The explained row of every example, (B, n) — the readout's weights (B, n) carried through the layers
    as one relevance row — with ``return_layers`` also (L', B, n), and the readout."""
    layers = layers_of(rec, stream)
    B, H, n, _ = layers[0].shape
    pipe = LayerPipeline(n, head_fusion=head_fusion, alpha=alpha, residual_mode=residual_mode,
                         protect_prefix=protect_prefix)  # validates the options, gives a and c
    if head_fusion is not None and not isinstance(head_fusion, str):
        from ..core.fusion import head_weights

        head_weights(head_fusion, H, like=torch.empty(0, device=layers[0].device))  # (a mixer layer has no q)
    start, end = layer_range(len(layers), start_layer, end_layer)
    _checks.check_bool("return_layers", return_layers)
    want = _checks.check_dtype(dtype) or torch.float32
    ro = ctx.readout(rec, stream)
    mask = ctx.mask(rec, stream)
    mask = None if mask is None or bool(mask.all()) else mask.to(layers[0].device).bool()
    if getattr(rule, "stochastic", False):
        check_stochastic(layers, start, end, head_fusion, mask)
    E = ro.weights.to(device=layers[0].device, dtype=want)[:, None, :]
    R = operators.rollout_rows(layers, E, rule, a=pipe.a, c=pipe.c, renorm=pipe.renorm, mask=mask,
                               start=start, end=end, return_layers=return_layers)
    if return_layers:
        return R[-1, :, 0], R[:, :, 0], ro
    return R[:, 0], None, ro


def explain_rows(ctx: Context, attention: Any, rule_for: Any, *, grad: bool, stream_opt: Any,
                 protect_prefix: Any = None, fuse_mean: bool = False, **product_opts: Any) -> Any:
    """The whole recompute route of a row method: capture, product, Explanation; None when auto mode falls
    back to dense. ``rule_for(rec)`` gives the block rule; ``protect_prefix`` None = the record's prefix;
    ``fuse_mean``: the rule is ``fused_probs("mean")`` (see ``record``)."""
    # The fused matrices live in this thread's reused buffers until the product has read them (see
    # ``operators.kept_buffers``: no page faults for the next call's forward); nothing returned aliases them.
    with operators.kept_buffers() if fuse_mean and not grad else contextlib.nullcontext():
        rec = grad_record(ctx, attention, stream_opt) if grad else record(ctx, attention, fuse_mean)
        if rec is None:
            return None
        s = ctx.stream(rec)
        pp = prefix_default(protect_prefix, ctx.info(rec, s))
        row, layers, ro = product(ctx, rec, s, rule_for(rec), protect_prefix=pp, **product_opts)
    options = {**ctx.options, "attention": "recompute"}
    if "protect_prefix" in ctx.options:
        options["protect_prefix"] = pp
    return ctx.build(rec, row, ro, s, layers=layers, options=options)
