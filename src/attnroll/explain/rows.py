"""Steps the rollout methods share: the readout's rows rolled out and combined with its weights
(``rollout_rows``, ``combine_rows``), a stage chain composed down to the input patches, the rows of a linked
stream for a VLM (``source_rows``), the options of ``attnroll.rollout`` that explain passes through, and
``protect_prefix``'s default."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _checks
from ..capture.readout import Readout, resolve_readout
from ..capture.record import AttentionRecord, StreamInfo
from .context import Context

__all__ = ["ROLLOUT_OPTIONS", "ROLLOUT_REFUSE", "prefix_default", "rollout_rows", "combine_rows", "source_rows",
           "gather_rows"]


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
        extra = (
            {}
            if protect_prefix is _ABSENT
            else {"protect_prefix": prefix_default(protect_prefix, ctx.info(rec, stream))}
        )
        return rollout_rows(fn, list(layers_of(stream))[:k], readout, ctx.mask(rec, stream), **extra, **opts)[0]

    return rows


def gather_rows(R: torch.Tensor, rows: list[int], positions: list[int], *, layer_axis: bool = False) -> torch.Tensor:
    """Pick, for example b, the row ``positions[b]`` out of R computed for the sorted distinct ``rows``:
    R (B, [H,] r, n) -> (B, [H,] n); with ``layer_axis`` (L, B, [H,] r, n) -> (L, B, [H,] n)."""
    idx = [rows.index(p) for p in positions]
    if layer_axis:
        return torch.stack([R[:, b, ..., i, :] for b, i in enumerate(idx)], dim=1)
    return torch.stack([R[b, ..., i, :] for b, i in enumerate(idx)])
