"""Gradient baselines through Captum (not re-implemented here): integrated gradients, saliency and
input × gradient, on the pixels (image models) or the input embeddings (text models), summed to the same units
as the attention methods (patches or tokens) so that all compare side by side.

Units: image attributions (B, C, H, W) are summed over channels and the pixels of each patch -> (B, h·w);
prefix tokens have no pixels and get 0 in ``full_row``. Text attributions (B, n, d) on the embedding layer's
output are summed over d -> (B, n). Saliency is the absolute gradient (Captum's default), summed.
The model runs with its own attention implementation (SDPA is fine: no attention is captured for this)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _checks
from .._modes import eval_mode
from ..capture import model_facts
from ..capture.outputs import main_logits
from ..explain.context import Context
from ..explain.registry import register


def _captum():
    try:
        import captum.attr as ca
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the Captum baselines need captum: pip install 'attnroll[captum]' (or pip install captum)"
        ) from None
    return ca


def _score_fn(ctx: Context, rec: Any, B: int, pos: list[int]) -> Any:
    """The target score f(outputs) -> (m,) Captum differentiates, for m = B x (integration steps) rows."""
    target = ctx.target
    classes = None if callable(target) else ctx.describe_target(rec)
    if classes is None and not callable(target):
        raise ValueError(
            f"method {ctx.method.name!r} needs a target score: the model's output has no logits, so pass "
            "target=a callable f(outputs) -> (B,)"
        )
    token_level = (lg := main_logits(rec.outputs)) is not None and lg.ndim == 3
    cls_t = None if classes is None else torch.tensor(classes)
    pos_t = torch.tensor(pos)

    def score(out: Any) -> torch.Tensor:
        if callable(target):
            y = target(out)
            m = main_logits(out)
            return _checks.check_target_output(y, None if m is None else m.shape[0], target)
        logits = main_logits(out)
        m = logits.shape[0]
        reps = m // B  # Captum stacks the steps as [step 0: all B examples, step 1: ...]
        ar = torch.arange(m, device=logits.device)
        if token_level:
            logits = logits[ar, pos_t.repeat(reps).to(logits.device)]
        return logits[ar, cls_t.repeat(reps).to(logits.device)]

    return score


def _pixel_row(ca: Any, kind: str, ctx: Context, info: Any, score: Any, pixels: torch.Tensor, B: int, opts: dict):
    """(B, n) attributions of the pixels summed per patch (prefix and suffix tokens 0); ``info`` is the
    stream's StreamInfo (grid, prefix, suffix, input key)."""
    inputs, model, key = ctx.inputs, ctx.model, info.input_key
    is_dict = isinstance(inputs, dict) or hasattr(inputs, "keys")
    rest = {k: v for k, v in inputs.items() if k != key} if is_dict else {}

    def fwd(px):
        return score(model(**{key: px}, **rest) if is_dict else model(px))

    px = pixels.detach().clone().requires_grad_(kind != "integrated_gradients")
    if kind == "integrated_gradients":
        if opts["baseline"] not in ("pad", "zeros"):
            raise ValueError(f"baseline for images must be 'zeros' (black after normalisation), got "
                             f"{opts['baseline']!r}")
        attr = ca.IntegratedGradients(fwd).attribute(
            px, baselines=torch.zeros_like(px), n_steps=opts["n_steps"], internal_batch_size=opts["internal_batch_size"]
        )
    elif kind == "saliency":
        attr = ca.Saliency(fwd).attribute(px, abs=True)
    else:
        attr = ca.InputXGradient(fwd).attribute(px)
    if info.grid is None:
        raise ValueError(f"cannot sum pixel attributions to patches: {info.grid_reason or 'the patch grid is unknown'}")
    gh, gw = info.grid
    H, W = px.shape[-2:]
    ph, pw = H // gh, W // gw
    a = attr[..., : gh * ph, : gw * pw].reshape(B, attr.shape[1], gh, ph, gw, pw).sum(dim=(1, 3, 5))
    zeros = lambda k: torch.zeros(B, k, dtype=a.dtype)  # noqa: E731  (prefix / suffix tokens have no pixels)
    return torch.cat([zeros(info.prefix), a.reshape(B, gh * gw).cpu(), zeros(info.suffix)], dim=1)


def _token_row(ca: Any, kind: str, ctx: Context, key: str | None, score: Any, opts: dict) -> torch.Tensor:
    """(B, n) attributions of the input embeddings summed over the embedding axis."""
    inputs, model = ctx.inputs, ctx.model
    facts = model_facts(model)
    if not (isinstance(inputs, dict) or hasattr(inputs, "keys")) or key is None or key not in inputs or (
        facts.embedding is None
    ):
        raise ValueError(
            f"method {ctx.method.name!r} needs image pixels (B, 3, H, W) or token ids in the inputs of a model whose "
            f"input embedding layer is known; {type(model).__name__} gave neither"
        )
    emb = facts.embedding
    keys = [k for k in inputs if k != key and isinstance(inputs[k], torch.Tensor)]
    others = tuple(inputs[k] for k in keys)

    def fwd_ids(ids, *rest):
        return score(model(**{key: ids}, **dict(zip(keys, rest))))

    ids, baseline = inputs[key], opts["baseline"]
    if kind == "integrated_gradients":
        pad = facts.pad_token_id if baseline == "pad" else baseline
        if baseline == "zeros":
            raise ValueError("baseline='zeros' is for images; text baselines are token ids: 'pad' or an int id")
        pad = _checks.check_int("baseline", 0 if pad is None else pad, low=0)
        attr = ca.LayerIntegratedGradients(fwd_ids, emb).attribute(
            ids, baselines=torch.full_like(ids, pad), additional_forward_args=others, n_steps=opts["n_steps"],
            internal_batch_size=opts["internal_batch_size"],
        )
    else:
        attr = ca.LayerGradientXActivation(fwd_ids, emb, multiply_by_inputs=kind == "input_x_gradient").attribute(
            ids, additional_forward_args=others
        )
        if kind == "saliency":
            attr = attr.abs()
    return attr.sum(dim=-1).detach().cpu()


def _run(ctx: Context, kind: str, n_steps: int = 50, internal_batch_size: Any = None, baseline: Any = "pad"):
    ca = _captum()
    rec = ctx.record(fuse_heads="mean")  # metadata (grid, prefix, tokens, mask) and the resolved target
    s = ctx.stream(rec)
    B = rec.streams[s][0].shape[0]
    pos = ctx.positions(rec, s)
    score = _score_fn(ctx, rec, B, pos)
    inputs = ctx.inputs
    info = ctx.info(rec, s)
    ctx.composes(rec, s, None)  # a VLM's linked streams: refused here, before perturbed inputs reach the model
    key = info.input_key
    is_dict = isinstance(inputs, dict) or hasattr(inputs, "keys")
    pixels = inputs.get(key) if is_dict and key else inputs if isinstance(inputs, torch.Tensor) else None
    opts = {"n_steps": _checks.check_int("n_steps", n_steps, low=1), "internal_batch_size": internal_batch_size,
            "baseline": baseline}
    with eval_mode(ctx.model):
        if pixels is not None and pixels.is_floating_point() and pixels.ndim == 4:
            row = _pixel_row(ca, kind, ctx, info, score, pixels, B, opts)
        else:
            row = _token_row(ca, kind, ctx, key, score, opts)
    return ctx.build(rec, row.to(torch.float32), None, s)


_COMMON = dict(needs_grad=True, class_specific=True, reads_layers=False)


@register(
    "integrated_gradients",
    description="Captum integrated gradients on pixels / input embeddings, summed per patch / token (class-specific)",
    options={"n_steps": 50, "internal_batch_size": None, "baseline": "pad"},
    cost="n_steps forwards + backwards (50 by default)",
    reference="Sundararajan, Taly & Yan, Axiomatic Attribution for Deep Networks, ICML 2017 (via Captum)",
    **_COMMON,
)
def integrated_gradients(ctx: Context, **opts):
    """Integrated gradients from a black image (zeros) / an all-pad-token sequence, n_steps Riemann steps."""
    return _run(ctx, "integrated_gradients", **opts)


@register(
    "saliency",
    description="Captum saliency: |dy/dinput| summed per patch / token (class-specific)",
    cost="1 forward + 1 backward",
    reference="Simonyan, Vedaldi & Zisserman, Deep Inside Convolutional Networks, 2014 (via Captum)",
    **_COMMON,
)
def saliency(ctx: Context):
    """Absolute input gradient, summed over channels and patch pixels / embedding dimensions."""
    return _run(ctx, "saliency")


@register(
    "input_x_gradient",
    description="Captum input × gradient summed per patch / token (class-specific)",
    cost="1 forward + 1 backward",
    reference="Shrikumar et al., Learning Important Features Through Propagating Activation Differences, 2017 (via "
              "Captum)",
    **_COMMON,
)
def input_x_gradient(ctx: Context):
    """Input times gradient (signed), summed over channels and patch pixels / embedding dimensions."""
    return _run(ctx, "input_x_gradient")
