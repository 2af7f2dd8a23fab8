"""Attention rollout (Abnar & Zuidema, 2020) and its per-head variant.

Per layer l the captured attention A(l) goes through one fixed pipeline (``LayerPipeline``):

    fuse heads -> drop padding -> sparsify -> rescale rows -> residual:  Ã(l) = (a·P(l) + c·I) / s

and rollout is the product R = Ã(end−1) ··· Ã(start), newest layer on the left. Row i of R is the share
of output token i traced back to each input token.

``rows=[...]`` computes only those rows, right to left, as vector–matrix products: O(L·n²) instead of
O(L·n³), and — for mean or weighted head fusion without masking or sparsification — without ever forming
the fused matrix, so the cost is one read of the attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import _checks
from . import fusion, residual, sparsify

_ACCEPT_HINT = (
    "Pass check_stochastic=False to accept non-stochastic non-negative matrices (e.g. gradient-weighted or "
    "norm-based mixing matrices), or residual_mode='renorm' together with it to renormalise rows."
)


# ------------------------------------------------------------------------------------------- input parsing
@dataclass
class Layers:
    """Structurally validated attention: per-layer tensors with a batch axis, plus how to read them (working
    dtype, value checks) and how to give results back. Values are checked layer by layer as they are read
    (``layer(i)``), so that no path pays for an extra pass over the data."""

    tensors: list[torch.Tensor]  # each (B, H, n, n), or (B, n, n) when already fused; caller's dtype
    batched: bool
    was_numpy: bool
    fused: bool
    mask: torch.Tensor | None  # (B, n) bool, None when every token is real
    dtype: torch.dtype
    check_stochastic: bool = True
    name: str = "attentions"
    validate: bool = True
    atol: float = _checks.STOCHASTIC_ATOL  # row-sum tolerance for the input's dtype
    _pending: list = field(default_factory=list, repr=False)

    @property
    def n(self) -> int:
        return self.tensors[0].shape[-1]

    @property
    def batch(self) -> int:
        return self.tensors[0].shape[0]

    def layer(self, i: int) -> torch.Tensor:
        """Layer i in the working dtype, its values checked. Rows of padded queries are set to 0 first: they
        carry nothing, and a model may leave anything there (NaN for an example that is all padding)."""
        t = self.tensors[i].to(self.dtype)
        if self.mask is not None:
            rows = (self.mask if self.fused else self.mask.unsqueeze(1)).unsqueeze(-1)
            t = torch.where(rows, t, torch.zeros((), dtype=t.dtype, device=t.device))
        if self.validate and t.numel():
            d = t.detach()  # statistics only: no autograd graph, no warning for grad-tracking input
            self.check(i, float(d.amin()), d.sum(dim=-1), d)
        return t

    def check(self, i: int, minimum: float, sums: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Judge layer i (or a block of it) from its minimum and row sums (B, [H,] rows)."""
        if self.mask is not None and sums.shape[-1] == self.n:
            # Padding rows may hold anything (zeros, uniform rows); only real queries must be stochastic.
            row_mask = self.mask if self.fused else self.mask.unsqueeze(1)
            sums = sums[row_mask.expand_as(sums)]
        _checks.check_values(
            f"{self.name}[{i}]", minimum, sums, stochastic=self.check_stochastic, how_to_accept=_ACCEPT_HINT,
            atol=self.atol, source=self.tensors[i] if source is None else source,
        )

    def defer(self, i: int, minimum: torch.Tensor, sums: torch.Tensor) -> None:
        """Record a block's statistics (0-d minimum, row sums) to be judged by ``flush``."""
        self._pending.append((i, minimum, sums))

    def flush(self) -> None:
        """Judge the deferred statistics in one pass; on failure, report the first bad layer."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        minimum = float(torch.stack([p[1] for p in pending]).amin())
        sums = torch.cat([p[2].reshape(-1) for p in pending])
        ok = minimum >= 0 and bool(torch.isfinite(sums).all())
        if ok and self.check_stochastic:
            ok = float((sums - 1).abs().max()) <= self.atol
        if ok:
            return
        for i in sorted({p[0] for p in pending}):
            mine = [p for p in pending if p[0] == i]
            self.check(i, float(torch.stack([p[1] for p in mine]).amin()), torch.cat([p[2].reshape(-1) for p in mine]))
        raise AssertionError("deferred statistics failed, but no single layer did")  # pragma: no cover

    def give_back(self, out: torch.Tensor, batch_axis: int = 0) -> Any:
        """Drop the batch axis for unbatched input and convert to numpy for numpy input."""
        if not self.batched:
            out = out.squeeze(batch_axis)
        return out.numpy() if self.was_numpy else out


#: What an empty ``attentions`` most often is: a transformers model's ``outputs.attentions`` under its default
#: attention kernel (SDPA / flash attention compute no probabilities, and the tuple comes back empty).
_EMPTY_HINT = (
    " An empty outputs.attentions of a transformers model means its attention kernel (SDPA, the default, or "
    "flash attention) computed no probabilities: load it with attn_implementation=\"eager\" (e.g. "
    "from_pretrained(path, attn_implementation=\"eager\")), or use attnroll.explain / attnroll.capture, which "
    "read the attention under any kernel."
)


def _layer_items(attentions: Any, fused: bool, name: str, hint: str) -> list:
    """The per-layer arrays of a list / tuple, or of one stacked array (its leading layer axis).

    A stacked array must carry the batch axis ((L, B, H, n, n), or (L, B, n, n) fused): without it, one
    array (L, H, n, n) reads the same as one layer's batch (B, H, n, n), so that shape is refused."""
    if attentions is None:
        raise TypeError(f"{name} is None: expected one attention tensor per layer.{_EMPTY_HINT}")
    if isinstance(attentions, (list, tuple)):
        if len(attentions) == 0:
            raise ValueError(f"{name} is empty: expected one attention tensor per layer.{_EMPTY_HINT}")
        return list(attentions)
    if isinstance(attentions, (torch.Tensor,)) or type(attentions).__module__ == "numpy":
        t, _ = _checks.as_tensor(name, attentions)
        if t.ndim == 0 or t.shape[0] == 0:
            raise ValueError(f"{name} is empty: expected a leading layer axis with at least one layer")
        stacked, layer = ("(L, B, n, n)", "(B, n, n)") if fused else ("(L, B, H, n, n)", "(B, H, n, n)")
        if t.ndim == (3 if fused else 4):
            raise ValueError(
                f"{name} is one {t.ndim}-D array {tuple(t.shape)}, which reads both as one layer's batch "
                f"{layer} and as layers stacked without a batch axis: pass a list of per-layer arrays (e.g. "
                f"[a] for one layer, list(outputs.attentions)), or one stacked array {stacked} (add the batch "
                "axis: a[:, None] for one example)"
            )
        if t.ndim != (4 if fused else 5):
            raise ValueError(f"{name} as one stacked array must have shape {stacked}, got {tuple(t.shape)}.{hint}")
        return [attentions[i] for i in range(t.shape[0])]
    raise TypeError(
        f"{name} must be a list/tuple of per-layer arrays or one stacked array (torch or numpy), "
        f"got {_checks.describe(attentions)}"
    )


def parse_attentions(
    attentions: Any,
    *,
    fused: bool,
    dtype: Any = None,
    attention_mask: Any = None,
    check_stochastic: bool = True,
    name: str = "attentions",
    validate: bool = True,
) -> Layers:
    """Validate the structure of ``attentions`` (see ``rollout``) and wrap them with a batch axis.

    Checks here: non-empty; the right number of axes; square; every layer the same shape; the mask.
    ``Layers.layer(i)`` checks values when a layer is read: finite, non-negative, and rows summing to 1
    when ``check_stochastic`` (only the rows of real tokens when an ``attention_mask`` is given).
    """
    per_layer = "(B, n, n) or (n, n)" if fused else "(B, H, n, n) or (H, n, n)"
    hint = (
        " If the heads are already fused, pass head_fusion=None."
        if not fused
        else " Per-head input needs a head_fusion ('mean', 'max', 'min' or weights)."
    )
    items = _layer_items(attentions, fused, name, hint)
    tensors, kinds = [], set()
    for i, item in enumerate(items):
        t, was_numpy = _checks.as_tensor(f"{name}[{i}]", item)
        kinds.add(was_numpy)
        batched_ndim = 3 if fused else 4
        if t.ndim not in (batched_ndim, batched_ndim - 1):
            raise ValueError(f"{name}[{i}] must have shape {per_layer}, got {tuple(t.shape)}.{hint}")
        _checks.check_square(f"{name}[{i}]", t)
        tensors.append(t)
    if len(kinds) > 1:
        raise TypeError(f"{name} mixes numpy arrays and torch tensors; pass all layers as one kind")
    ndims = {t.ndim for t in tensors}
    if len(ndims) > 1:
        raise ValueError(f"{name}: layers mix batched and unbatched shapes {[tuple(t.shape) for t in tensors]}")
    first = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != first:
            what = "number of tokens n" if t.shape[-1] != first[-1] else (
                "number of heads H" if (not fused and t.shape[-3] != first[-3]) else "batch size B"
            )
            raise ValueError(
                f"{name}: layers differ in {what}: layer 0 has shape {tuple(first)}, layer {i} has {tuple(t.shape)}"
            )
    if first[-1] == 0:
        raise ValueError(f"{name} has zero tokens (n = 0)")
    batched = tensors[0].ndim == (3 if fused else 4)
    if not batched:
        tensors = [t.unsqueeze(0) for t in tensors]

    want = _checks.check_dtype(dtype)
    if want is None:
        want = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32

    n, B = tensors[0].shape[-1], tensors[0].shape[0]
    mask = None
    if attention_mask is not None:
        mask = _checks.check_mask("attention_mask", attention_mask, B if batched else None, n)
        mask = mask.to(tensors[0].device)
        if bool(mask.all()):
            mask = None
    check_stochastic = _checks.check_bool("check_stochastic", check_stochastic)
    validate = _checks.check_bool("validate", validate)
    atol = _checks.stochastic_atol(tensors[0].dtype)
    return Layers(tensors, batched, next(iter(kinds)), fused, mask, want, check_stochastic, name, validate, atol)


def layer_range(num_layers: int, start_layer: Any, end_layer: Any) -> tuple[int, int]:
    """0-based [start, end) with Python-style negative indices; start must come before end."""
    start = _checks.check_int("start_layer", start_layer)
    if not -num_layers <= start < num_layers:
        raise ValueError(
            f"start_layer={start} is out of range for {num_layers} layers: expected an index in "
            f"[{-num_layers}, {num_layers - 1}]"
        )
    start %= num_layers
    if end_layer is None:
        end = num_layers
    else:
        end = _checks.check_int("end_layer", end_layer)
        if not -num_layers <= end <= num_layers:
            raise ValueError(
                f"end_layer={end} is out of range for {num_layers} layers: expected [{-num_layers}, {num_layers}] "
                "(exclusive end, like a Python slice)"
            )
        if end < 0:
            end += num_layers
    if start >= end:
        raise ValueError(
            f"start_layer ({start}) must be < end_layer ({end}): layers are taken from start_layer "
            "up to but not including end_layer"
        )
    return start, end


def parse_rows(rows: Any, n: int) -> list[int] | None:
    """None, an int, or a non-empty sequence of token indices (negative = from the end)."""
    if rows is None:
        return None
    if (
        isinstance(rows, (list, tuple, range, torch.Tensor, np.ndarray))
        and getattr(rows, "ndim", 1) != 0
        and len(rows) == 0
    ):
        raise ValueError("rows is empty: give at least one output token index, or rows=None for all rows")
    return _checks.check_indices("rows", rows, n)


# ------------------------------------------------------------------------------------------- the pipeline
class LayerPipeline:
    """Validated options turning one captured layer into the pieces of Ã = (a·P + c·I) / s (s: the
    renorm mode's row sums, else 1).

    ``matrix(t)`` gives P (fused, padding dropped, sparsified, rows rescaled); ``augmented(t)`` gives Ã;
    ``left(t, R)`` = Ã·R and ``right(V, t)`` = V·Ã, both without forming Ã.
    """

    def __init__(
        self,
        n: int,
        *,
        head_fusion: Any = "mean",
        alpha: float = 0.5,
        residual_mode: str = "blend",
        discard_ratio: float = 0.0,
        discard_scope: str = "layer",
        top_k: int | None = None,
        threshold: float | None = None,
        protect_prefix: int = 1,
        mask: torch.Tensor | None = None,
    ) -> None:
        self.head_fusion = _checks.check_head_fusion("head_fusion", head_fusion)
        self.a, self.c = residual.residual_coefficients(alpha, residual_mode)
        self.renorm = residual_mode == "renorm"
        (self.discard_ratio, self.discard_scope, self.top_k, self.threshold, self.protect_prefix) = (
            sparsify.check_options(n, discard_ratio, discard_scope, top_k, threshold, protect_prefix)
        )
        self.mask = mask
        self.sparse = bool(self.discard_ratio) or self.top_k is not None or self.threshold is not None

    # P --------------------------------------------------------------------------------------------------
    def fuse(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.head_fusion is None else fusion.fuse_tensor(t, self.head_fusion)

    def matrix(self, t: torch.Tensor) -> torch.Tensor:
        """P for one layer: (B, n, n) fused (or any (..., n, n) with ``head_fusion=None``)."""
        mask = self.mask
        P = self.fuse(t)
        if mask is not None:
            # Drop padding as if it had been cropped away: real rows are rescaled to their full sum (1 for
            # attention probabilities), padded rows become 0.
            valid = mask[..., :, None] & mask[..., None, :]
            P = sparsify.restrict(P, valid, P.sum(dim=-1, keepdim=True) * mask[..., :, None])
        if self.sparse:
            keep = sparsify.keep_mask(
                P,
                discard_ratio=self.discard_ratio,
                discard_scope=self.discard_scope,
                top_k=self.top_k,
                threshold=self.threshold,
                protect_prefix=self.protect_prefix,
                mask=mask,
            )
            if keep is not None:
                P = sparsify.restrict(P, keep)
        return P

    def totals(self, P: torch.Tensor) -> torch.Tensor | None:
        """The renorm mode's row sums of a·P + c·I (…, n), else None."""
        return residual.row_totals(P, self.a, self.c, self.mask) if self.renorm else None

    def augmented(self, t: torch.Tensor) -> torch.Tensor:
        """Ã for one layer, materialised."""
        return residual.apply_residual(self.matrix(t), self.a, self.c, self.renorm, self.mask)

    # products -------------------------------------------------------------------------------------------
    def left(self, t: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
        """Ã·R for (…, n, m) R."""
        mask = self.mask
        P = self.matrix(t)
        out = self.a * (P @ R)
        out = out + self.c * (R if mask is None else R * mask[..., :, None])
        s = self.totals(P)
        return out if s is None else residual.divide_rows(out, s)

    def can_stream(self, layers: Layers) -> bool:
        """Whether V·Ã can be computed straight from the captured layer: mean or weighted fusion of per-head
        input, or already-fused input, with nothing that needs the fused matrix itself (no padding,
        sparsification or renorm row sums). Per-head rollout (head_fusion None on per-head input) does not."""
        simple = self.mask is None and not self.sparse and not self.renorm
        if self.head_fusion is None:
            return simple and layers.fused
        return simple and not (isinstance(self.head_fusion, str) and self.head_fusion != "mean")

    def right(self, V: torch.Tensor, layers: Layers, i: int) -> torch.Tensor:
        """V·Ã(i) for (…, r, n) V, reading and checking layer i of ``layers``."""
        if self.can_stream(layers):
            return self.a * _streamed_contract(V, layers, i, self.head_fusion) + self.c * V
        return Prepared(self, layers.layer(i)).right(V)


#: Elements per block of the streamed contraction: 4 MiB of float32, so that a block read from memory for
#: the value checks is still in cache for the product.
BLOCK_ELEMENTS = 1 << 20


def _streamed_contract(V: torch.Tensor, layers: Layers, i: int, how: Any) -> torch.Tensor:
    """Σ_h w_h · V·A_h for V (B, r, n) and layer i (B, H, n, n) -> (B, r, n), w = 1/H for "mean"; for
    already-fused input (B, n, n), ``how`` None, simply V·A.

    Uses V·mean_h(A_h) = mean_h(V·A_h): the fused n×n matrix is never formed, and the sum over heads is
    folded into one matrix product, (w ⊗ V) (B, r, H·n) times the layer seen as (B, H·n, n). Large layers
    are walked in cache-sized blocks (groups of heads, or row ranges of one head) so that each block's value
    statistics (minimum, row sums), taken for the checks, are read while the block is in cache. The checks
    themselves are deferred to ``Layers.flush`` to keep per-layer overhead low.
    """
    raw = layers.tensors[i]
    if raw.ndim == 3:  # already fused: one "head"
        raw = raw.unsqueeze(1)
    B, H, n, _ = raw.shape
    dtype = layers.dtype
    w = None if how is None or isinstance(how, str) else fusion.head_weights(how, H, like=V)
    per_head = B * n * n
    heads_per_block = max(1, BLOCK_ELEMENTS // per_head)
    rows_per_block = n if per_head <= BLOCK_ELEMENTS else max(1, BLOCK_ELEMENTS // (B * n))
    acc = None
    for h0 in range(0, H, heads_per_block):
        h1 = min(H, h0 + heads_per_block)
        wv = V.unsqueeze(-2) if w is None else V.unsqueeze(-2) * w[h0:h1, None]  # (B, r, 1 | h, n)
        for r0 in range(0, n, rows_per_block):
            r1 = min(n, r0 + rows_per_block)
            blk = raw[:, h0:h1, r0:r1, :].to(dtype)  # (B, h, rows, n)
            if layers.validate:
                d = blk.detach()
                layers.defer(i, d.amin(), d.sum(dim=-1))
            u = wv[..., r0:r1].expand(B, V.shape[1], h1 - h0, r1 - r0).reshape(B, V.shape[1], -1)
            part = u @ blk.reshape(B, -1, n)  # sums over the heads of the block and its rows
            acc = part if acc is None else acc.add_(part)
    assert acc is not None  # H ≥ 1 and n ≥ 1: at least one block
    return acc / H if w is None else acc


# ------------------------------------------------------------------------------------------- rollout
def _product(
    layers: Layers,
    start: int,
    end: int,
    pipe: LayerPipeline,
    rows: list[int] | None,
    return_layers: bool,
) -> torch.Tensor:
    """R (B, n, n) or its rows (B, r, n) for layers [start, end); with ``return_layers`` a leading axis of
    every partial product Ã(k)···Ã(start), k = start..end-1."""
    first = layers.tensors[start]
    n, mask = layers.n, pipe.mask
    lead = first.shape[:-3] if pipe.head_fusion is not None else first.shape[:-2]
    dtype, device = layers.dtype, first.device
    if rows is None:
        R = pipe.augmented(layers.layer(start))
        partials = [R]
        for i in range(start + 1, end):
            R = pipe.left(layers.layer(i), R)
            if return_layers:
                partials.append(R)
        return torch.stack(partials) if return_layers else R
    E = torch.zeros(*lead, len(rows), n, dtype=dtype, device=device)
    E[..., torch.arange(len(rows)), torch.tensor(rows)] = 1.0
    if mask is not None:
        E = E * _row_valid(mask, rows).to(dtype)
    if not return_layers:
        V = E
        for i in range(end - 1, start - 1, -1):
            V = pipe.right(V, layers, i)
        layers.flush()
        return V
    # Every partial product's rows: prepare each layer once, then one right-to-left sweep per prefix.
    mats = [Prepared(pipe, layers.layer(i)) for i in range(start, end)]
    partials = []
    for k in range(len(mats)):
        V = E
        for m in reversed(mats[: k + 1]):
            V = m.right(V)
        partials.append(V)
    return torch.stack(partials)


def _row_valid(mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """(…, r, 1): whether each chosen output row is a real token (padded output rows are 0)."""
    return mask[..., rows].unsqueeze(-1)


class Prepared:
    """One layer as Ã = a·P' + diag(g), computed once for repeated V·Ã products: P' is P with its rows
    divided by the renorm sums (P itself otherwise) and g the identity weight of each row. Dividing P's
    rows, rather than V's columns, keeps tiny identity weights exact."""

    def __init__(self, pipe: LayerPipeline, t: torch.Tensor) -> None:
        self.a = pipe.a
        P = pipe.matrix(t)
        s = pipe.totals(P)
        mask = pipe.mask
        g = torch.full(P.shape[:-1], pipe.c, dtype=P.dtype, device=P.device)
        if mask is not None:
            g = g * mask
        if s is not None:
            P = residual.divide_rows(P, s)
            g = residual.divide_rows(g.unsqueeze(-1), s).squeeze(-1)
        self.P, self.g = P, g

    def right(self, V: torch.Tensor) -> torch.Tensor:
        return self.a * (V @ self.P) + V * self.g[..., None, :]


def rollout(
    attentions: Any,
    *,
    head_fusion: Any = "mean",
    alpha: float = 0.5,
    residual_mode: str = "blend",
    discard_ratio: float = 0.0,
    discard_scope: str = "layer",
    top_k: int | None = None,
    threshold: float | None = None,
    protect_prefix: int = 1,
    start_layer: int = 0,
    end_layer: int | None = None,
    rows: Any = None,
    return_layers: bool = False,
    attention_mask: Any = None,
    check_stochastic: bool = True,
    dtype: Any = None,
    validate: bool = True,
) -> Any:
    """Attention rollout: R = Ã(end−1)···Ã(start), newest layer on the left.

    Args:
        attentions: L per-layer arrays (torch or numpy), each (B, H, n, n) as HF's ``outputs.attentions``
            gives or (H, n, n) for one example; or one stacked (L, B, H, n, n) array. With
            ``head_fusion=None`` the layers are already fused: (B, n, n) / (n, n), stacked (L, B, n, n).
            One 4-D array ((L, n, n) fused) is refused: it reads as one layer's batch too. Rows are queries.
        head_fusion: "mean" | "max" | "min" | a length-H weight vector | None (already fused).
        alpha: identity weight of the residual correction, in [0, 1].
        residual_mode: "blend" (1−α)·A + α·I | "renorm" the same divided by its row sums | "add"
            A + α/(1−α)·I, unnormalised. See ``attnroll.add_residual``.
        discard_ratio, discard_scope, top_k, threshold, protect_prefix: sparsification, applied after head
            fusion and before the residual; rows are rescaled to their previous sum. See
            ``attnroll.sparsify``.
        start_layer, end_layer: 0-based layer range [start, end) (end exclusive, like a slice; negative
            values count from the end; ``start_layer=-1`` uses the last layer only).
        rows: output token index or indices; returns only those rows, computed right to left in O(L·n²).
        return_layers: also return every partial product: a leading layer axis of length end − start
            whose entry k is Ã(start+k)···Ã(start); the last entry equals R.
        attention_mask: (B, n) — or (n,) unbatched — of 0/1, 1 = real token. Padded tokens neither give nor
            receive: their rows and columns of R are exactly 0; real rows are rescaled as if the padding
            had been cropped away.
        check_stochastic: rows of the input (real tokens) must sum to 1 within 1e-3 (4 machine epsilons for
            bfloat16 / float16 input); False accepts any non-negative matrices.
        dtype: working and output dtype, float32 or float64; default float64 for float64 input, else float32.
        validate: check the values of the input (finite, non-negative, and stochastic rows when
            ``check_stochastic``). These checks cost two extra in-cache passes over the attention; ``False``
            skips them for trusted input on hot paths (garbage in, garbage out). Shapes and options are
            always checked.

    Returns:
        (B, n, n), or (B, len(rows), n) with ``rows``; with ``return_layers`` a leading (end − start) axis.
        Unbatched input gives no batch axis. Same kind (torch / numpy) as the input.
    """
    layers = parse_attentions(
        attentions,
        fused=head_fusion is None,
        dtype=dtype,
        attention_mask=attention_mask,
        check_stochastic=check_stochastic,
        validate=validate,
    )
    if head_fusion is not None:
        fusion.head_weights(head_fusion, layers.tensors[0].shape[-3], like=layers.tensors[0])
    start, end = layer_range(len(layers.tensors), start_layer, end_layer)
    row_idx = parse_rows(rows, layers.n)
    pipe = LayerPipeline(
        layers.n,
        head_fusion=head_fusion,
        alpha=alpha,
        residual_mode=residual_mode,
        discard_ratio=discard_ratio,
        discard_scope=discard_scope,
        top_k=top_k,
        threshold=threshold,
        protect_prefix=protect_prefix,
        mask=layers.mask,
    )
    out = _product(layers, start, end, pipe, row_idx, _checks.check_bool("return_layers", return_layers))
    return layers.give_back(out, batch_axis=1 if return_layers else 0)


def per_head_rollout(
    attentions: Any,
    *,
    alpha: float = 0.5,
    residual_mode: str = "blend",
    discard_ratio: float = 0.0,
    discard_scope: str = "layer",
    top_k: int | None = None,
    threshold: float | None = None,
    protect_prefix: int = 1,
    start_layer: int = 0,
    end_layer: int | None = None,
    rows: Any = None,
    return_layers: bool = False,
    attention_mask: Any = None,
    check_stochastic: bool = True,
    dtype: Any = None,
    validate: bool = True,
) -> Any:
    """Rollout taken separately for each head h: R_h = Ã_h(end−1)···Ã_h(start).

    Same input and options as ``rollout`` (without ``head_fusion``: nothing is fused); every layer must
    have the same number of heads, and head h of one layer is chained with head h of the next.

    Returns:
        (B, H, n, n), or (B, H, len(rows), n) with ``rows``; with ``return_layers`` a leading layer axis.
        Unbatched input gives (H, …).
    """
    layers = parse_attentions(
        attentions,
        fused=False,
        dtype=dtype,
        attention_mask=attention_mask,
        check_stochastic=check_stochastic,
        validate=validate,
    )
    start, end = layer_range(len(layers.tensors), start_layer, end_layer)
    row_idx = parse_rows(rows, layers.n)
    mask = None if layers.mask is None else layers.mask.unsqueeze(1)  # (B, 1, n): broadcast over heads
    pipe = LayerPipeline(
        layers.n,
        head_fusion=None,
        alpha=alpha,
        residual_mode=residual_mode,
        discard_ratio=discard_ratio,
        discard_scope=discard_scope,
        top_k=top_k,
        threshold=threshold,
        protect_prefix=protect_prefix,
        mask=mask,
    )
    out = _product(layers, start, end, pipe, row_idx, _checks.check_bool("return_layers", return_layers))
    return layers.give_back(out, batch_axis=1 if return_layers else 0)


def augmented_layers(attentions: Any, **options: Any) -> tuple[list[torch.Tensor], Layers, tuple[int, int]]:
    """Ã for each layer in [start_layer, end_layer), exactly as ``rollout`` builds them (for attention flow
    and diagnostics). Takes ``rollout``'s input and options except rows/return_layers; returns the list of
    (B, n, n) tensors, the parsed input and the (start, end) range."""
    layers = parse_attentions(
        attentions,
        fused=options.get("head_fusion", "mean") is None,
        dtype=options.pop("dtype", None),
        attention_mask=options.pop("attention_mask", None),
        check_stochastic=options.pop("check_stochastic", True),
        validate=options.pop("validate", True),
    )
    start, end = layer_range(len(layers.tensors), options.pop("start_layer", 0), options.pop("end_layer", None))
    head_fusion = options.get("head_fusion", "mean")
    if head_fusion is not None:
        fusion.head_weights(head_fusion, layers.tensors[0].shape[-3], like=layers.tensors[0])
    pipe = LayerPipeline(layers.n, mask=layers.mask, **options)
    return [pipe.augmented(layers.layer(i)) for i in range(start, end)], layers, (start, end)
