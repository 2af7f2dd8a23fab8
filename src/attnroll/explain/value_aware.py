"""Shared wiring of the value-aware methods (norm, norm_rollout, globenc, alti, value_zeroing, decompx):
one forward pass recording attention and layer states (``capture.value_path``), the per-layer value vectors,
and the rollout of per-layer contribution matrices. No model-family knowledge here: weights come only
through the layer anatomy of the adapter contract (``model_facts(model).anatomy``), as arrays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import _checks
from ..capture import model_facts
from ..capture.layers import ModelAnatomy
from ..capture.record import AttentionRecord
from ..capture.value_path import LayerStates, record_states, value_anatomy
from ..core.rollout import rollout as core_rollout
from ..core.value_aware import Block, alti_matrix, apply_norm, normalize_rows, value_outputs
from .context import Context
from .registry import register
from .rows import rollout_rows

#: Options every value-aware method takes.
COMMON = {"dtype": None}
ROLLOUT = {"start_layer": 0, "end_layer": None, "return_layers": False}
REFUSE = {
    "alpha": "the residual share is measured from the value and residual vectors, not a fixed alpha",
    "head_fusion": "the heads are summed as vectors (Σ_h α^h f^h), not fused as weights",
    "stream": "the value-aware methods explain the self-attention stream of one stack of blocks",
}


@dataclass
class Layer:
    """One layer's tensors in the working dtype: ``x`` the block input, ``alpha`` (B, H, n, n), ``F`` the
    per-head value-output vectors f^h (B, n, H, d), ``attn`` the attention branch's actual output (b_O
    included), ``out`` the block output, ``n1`` / ``n2`` the actual inputs of its two norms."""

    block: Block
    x: torch.Tensor
    alpha: torch.Tensor
    F: torch.Tensor
    attn: torch.Tensor
    out: torch.Tensor
    n1: torch.Tensor
    n2: torch.Tensor


def working_dtype(dtype: Any, like: torch.Tensor) -> torch.dtype:
    """``dtype`` option: None = float64 for a float64 model, else float32; or torch.float32 / float64."""
    dt = _checks.check_dtype(dtype)
    if dt is not None:
        return dt
    return torch.float64 if like.dtype == torch.float64 else torch.float32


#: Parameter dtypes the value-aware methods refuse: bfloat16's 8-bit mantissa is coarser than the layer
#: anatomy's checks of each norm (float16 passes them).
REFUSED_DTYPES = (torch.bfloat16,)


def check_precision(ctx: Context) -> None:
    """Refuse a model with bfloat16 weights, naming the dtype and the cast that fixes it: the
    value-aware methods recompute each block's value path (norms, projections) from its weights and hold it
    to the states of the forward pass, which bfloat16 rounding does not reproduce."""
    coarse = sorted({str(p.dtype).replace("torch.", "") for p in ctx.model.parameters() if p.dtype in REFUSED_DTYPES})
    if coarse:
        raise _checks.UnsupportedModelError(
            f"method {ctx.method.name!r} does not support {' / '.join(coarse)} models ({type(ctx.model).__name__} "
            "has such weights): it recomputes each block's value path (norms, projections) from the weights and "
            f"checks it against the forward pass, which {coarse[0]} rounding cannot match. Explain it in float32: "
            "model.float() (or a float32 copy, copy.deepcopy(model).float()), or load it with "
            "torch_dtype=torch.float32"
        )


def record(ctx: Context) -> tuple[AttentionRecord, LayerStates, ModelAnatomy]:
    """One forward pass recording attention and layer states; sets ``ctx.rec``. A model whose layer anatomy
    is unknown, or not one the value-aware maths models, is refused with the reason."""
    check_precision(ctx)
    facts = model_facts(ctx.model)
    anat = value_anatomy(facts.anatomy, facts.anatomy_reason, ctx.model)
    rec, states, anat = record_states(ctx.model, ctx.inputs, anat=anat, tokenizer=ctx.tokenizer)
    chained = [s for s, info in rec.info.items() if info.merges]
    if chained:  # Swin: windows in stage matrices, tokens merging between stages
        raise _checks.UnsupportedModelError(
            f"method {ctx.method.name!r}: {type(ctx.model).__name__}'s tokens merge between stages (a stage "
            "chain with fixed merge maps), and the value-aware methods decompose one stack of blocks over one "
            "token set; use 'rollout', 'raw', 'grad_rollout' or 'gae', which compose the chain"
        )
    ctx.rec = rec
    return rec, states, anat


def layers(rec: AttentionRecord, states: LayerStates, anat: ModelAnatomy, dt: torch.dtype) -> list[Layer]:
    """Per-layer tensors (see :class:`Layer`)."""
    out = []
    for i, blk in enumerate(anat.blocks(dt, states.routing)):
        x = states.inputs[i].to(dt)
        n1, n2 = states.norm1_in[i].to(dt), states.norm2_in[i].to(dt)
        xv = apply_norm(x, blk.norm1) if blk.pre_norm else x
        attn = (n2 if blk.pre_norm else n1) - x
        out.append(Layer(blk, x, rec.attentions[i].to(dt), value_outputs(xv, blk), attn,
                         states.outputs[i].to(dt), n1, n2))
    return out


def alti_layer_matrix(lay: Layer) -> torch.Tensor:
    """ALTI's contribution matrix (B, n, n) of one layer, rows not yet normalised (``alti`` and
    ``alti_logit``): post-LN blocks T_i(x_j) = g1(z_{i←j}) against the actual LN1 output; pre-LN blocks
    z_{i←j} against the stream after the attention sub-block."""
    B, n, d = lay.x.shape
    chunk = chunk_rows(B, n, d)
    if lay.block.pre_norm:
        return alti_matrix(lay.alpha, lay.F, lay.x, lay.n2, chunk=chunk)
    y = apply_norm(lay.n1, lay.block.norm1)
    return alti_matrix(lay.alpha, lay.F, lay.x, y, norm=(lay.block.norm1, lay.n1), chunk=chunk)


def explain_matrices(ctx: Context, matrices: Callable[[list[Layer], LayerStates, ModelAnatomy, Any], list],
                     *, start_layer: Any, end_layer: Any, return_layers: bool, dtype: Any):
    """Record, build one (B, n, n) contribution matrix per layer with ``matrices``, normalise its rows
    (zero rows stay zero, padding masked) and roll them out with no extra identity: R = C_end ⋯ C_start."""
    rec, states, anat = record(ctx)
    dt = working_dtype(dtype, states.inputs[0])
    s = "self" if "self" in rec.streams else next(iter(rec.streams))
    mask = ctx.mask(rec, s)
    ro = ctx.readout(rec, s)  # the rows the output reads: a position, or pooled (a mean-pooling encoder)
    with torch.no_grad():
        Ls = layers(rec, states, anat, dt)
        Cs = [normalize_rows(C, mask) for C in matrices(Ls, states, anat, mask)]
    row, lay = rollout_rows(
        core_rollout, Cs, ro, mask, return_layers=return_layers, head_fusion=None, alpha=0.0,
        check_stochastic=False, start_layer=start_layer, end_layer=end_layer, dtype=dt,
    )
    return ctx.build(rec, row, ro, s, layers=lay)


def logit_classes(ctx: Context, rec: AttentionRecord, method: str, reads: str) -> torch.Tensor:
    """The logit index explained per example (B,) long, for methods that decompose one logit of the head;
    a callable target is refused (``reads`` says what the method reads of the head, for the message)."""
    if callable(ctx.target) and not isinstance(ctx.target, (int, list, tuple)):
        raise ValueError(
            f"target: {method} {reads}; it takes None, a class / token index or one per example, not a callable "
            f"({getattr(ctx.target, '__qualname__', type(ctx.target).__name__)})"
        )
    with torch.no_grad():
        ctx.target_scores(rec)
    return torch.tensor(ctx.target_desc, dtype=torch.long)


def check_head_readout(ctx: Context, rec: AttentionRecord, pos: list[int], method: str) -> None:
    """A ``readout=`` option must name the rows ``pos`` the model's head reads (one per example): methods that
    decompose the head's logit cannot explain other rows. ValueError naming both otherwise (never ignored)."""
    if ctx.options.get("readout") is None:
        return
    asked = ctx.readout(rec, "self").positions()
    if asked != list(pos):
        rows = "pooled" if asked is None else asked
        raise ValueError(
            f"readout: {method} decomposes the logit the model's head computes from row(s) {list(pos)} (the "
            f"head's readout), so readout={ctx.options['readout']!r} (row(s) {rows}) cannot be explained; "
            "leave readout unset, or use a rollout-type method for other rows")


def chunk_rows(B: int, n: int, width: int, budget: int = 1 << 24) -> int:
    """Rows per chunk so that a (B, rows, n, width) intermediate holds about ``budget`` elements."""
    return max(1, budget // max(1, B * n * width))


def register_rolled(name: str, matrices: Callable, *, description: str, reference: str, cost: str) -> None:
    """Register a method whose map is the rollout of ``matrices(layers, states, anat, mask)`` (one
    (B, n, n) non-negative matrix per layer; rows normalised here), with the layer-range options."""

    def method(ctx: Context, *, start_layer, end_layer, return_layers, dtype):
        return explain_matrices(ctx, matrices, start_layer=start_layer, end_layer=end_layer,
                                return_layers=return_layers, dtype=dtype)

    method.__doc__ = f"full_row[b] = row position_b of C_end ⋯ C_start, C_l from {name}'s per-layer matrices."
    method.__module__ = matrices.__module__  # the method file that registers it (the registry test reads this)
    method.__qualname__ = name
    register(name, description=description, options={**ROLLOUT, **COMMON}, cost=cost, reference=reference,
             refuse=REFUSE)(method)
