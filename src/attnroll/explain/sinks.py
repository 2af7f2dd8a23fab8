"""Attention sinks in explanations: found on the captured attention of a decoder (``core.sinks``), kept out of
the map by default, their share recorded; and the warning when one special or sink token holds most of a map.

``sinks="drop"`` (the default, an option of every method): on a causal stream, the sink tokens' columns of
``full_row`` (and of ``layers``) are set to 0 and the rest rescaled to the row's absolute mass;
``extra["sinks"]`` (their positions per example) and ``extra["sink_share"]`` ((B,) the share of the row they
held) record what was taken out. ``sinks="keep"``: the map as the method gave it, the sinks still recorded.
Encoders (non-causal streams) are left as they are. Either way, a map with more than
:data:`DOMINANT_SHARE` of its mass on one special token, sink or (for a decoder) first token warns.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..core import sinks as core_sinks

__all__ = ["SINK_CHOICES", "DOMINANT_SHARE", "attention_rows", "detect", "apply", "warn_dominant"]

SINK_CHOICES = ("drop", "keep")
#: A map with more than this share on one special / sink / first token is reported.
DOMINANT_SHARE = 0.9


def attention_rows(layers: list[Any], queries: torch.Tensor) -> torch.Tensor:
    """(L, B, Q, n) float32 head-mean attention of the query rows ``queries`` in every layer: dense layers
    (B, H, n, n) or fused (B, n, n), or the matrix-free route's ``KernelInputs`` / ``FusedLayer``."""
    from ..core import operators

    out = []
    rows = queries.tolist()
    for lay in layers:
        if isinstance(lay, torch.Tensor):
            a = lay.detach()[..., queries, :]
            out.append((a.mean(dim=1) if a.ndim == 4 else a).to(torch.float32).cpu())
        elif isinstance(lay, operators.FusedLayer):
            out.append(lay.probs[:, queries].to(torch.float32).cpu())
        elif hasattr(lay, "apply_rows"):  # a token mixer's rows-only layer (core.mixers.SSDRows): one-hot rows
            B, _, _, nk = lay.shape
            hot = torch.zeros(B, len(rows), nk, dtype=torch.float32, device=lay.device)
            hot[:, torch.arange(len(rows)), queries.to(lay.device)] = 1.0
            out.append(lay.apply_rows(hot, a=1.0, c=0.0).cpu())
        else:
            out.append(operators.attention_rows(lay, rows).mean(dim=1).to(torch.float32).cpu())
    return torch.stack(out)


def detect(layers: list[Any], mask: torch.Tensor | None, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sinks (B, n) bool, held (B, n)) of a causal stream's ``layers`` (see :func:`core.sinks.find_sinks`)."""
    real = torch.ones(batch, n, dtype=torch.bool) if mask is None else mask.cpu().to(torch.bool)
    picks = [core_sinks.sample_queries(real[b]) for b in range(batch)]
    union = torch.unique(torch.cat(picks)) if picks else torch.zeros(0, dtype=torch.int64)
    sinks = torch.zeros(batch, n, dtype=torch.bool)
    held = torch.zeros(batch, n)
    if union.numel() == 0 or not layers:
        return sinks, held
    rows = attention_rows(layers, union)  # (L, B, U, n)
    where = {int(p): i for i, p in enumerate(union.tolist())}
    for b, q in enumerate(picks):
        if q.numel():
            idx = torch.tensor([where[int(p)] for p in q.tolist()])
            sinks[b], held[b] = core_sinks.find_sinks(rows[:, b, idx], q, real[b])
    return sinks, held


def _layers(rec: Any, stream: str) -> list[Any]:
    if stream in rec.streams:
        return list(rec.streams[stream])
    return list(rec.operators.get(stream, []))


def causal(info: Any, layer: Any) -> bool:
    """Whether a stream is a decoder's: the adapter says so, or (a dense layer whose padded query rows hold
    anything) no real query row of ``layer`` attends ahead."""
    if info.causal:
        return True
    if not isinstance(layer, torch.Tensor) or info.mask is None:
        return False
    ahead = torch.triu(layer.detach().abs().to(torch.float32), diagonal=1)
    real = info.mask.to(device=layer.device, dtype=torch.bool)
    rows = real[:, None, :, None] if layer.ndim == 4 else real[:, :, None]
    return bool(torch.where(rows, ahead.nan_to_num(1.0), torch.zeros((), device=layer.device)).amax() == 0)


def apply(rec: Any, stream: str, info: Any, full_row: torch.Tensor, layers: torch.Tensor | None,
          extra: dict, mode: str) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Sink handling of a built row (see the module docstring); returns (full_row, layers, extra)."""
    B, n = full_row.shape
    lay = _layers(rec, stream)
    if not lay or lay[0].shape[-1] != n or lay[0].shape[-2] != n or not causal(info, lay[0]):
        return full_row, layers, extra
    found, _ = detect(lay, info.mask, B, n)
    extra = dict(extra)
    extra["sinks"] = [torch.nonzero(found[b]).reshape(-1).tolist() for b in range(B)]
    new, share = core_sinks.drop_columns(full_row, found)
    extra["sink_share"] = share
    if mode == "drop" and bool(found.any()):
        full_row = new
        if layers is not None:
            layers = core_sinks.drop_columns(layers, found.unsqueeze(0))[0]
    return full_row, layers, extra


def special_positions(ids: Any, tokenizer: Any, model: Any, n: int) -> torch.Tensor | None:
    """(B, n) bool: the positions of special tokens (the tokenizer's special ids, else the model config's
    bos / eos / pad / cls / sep ids), or None when ``ids`` is not (B, n) token ids."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[-1] != n or ids.is_floating_point():
        return None
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    if not special:
        cfg = getattr(model, "config", None)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "cls_token_id", "sep_token_id"):
            v = getattr(cfg, k, None)
            special |= set(v) if isinstance(v, (list, tuple)) else ({v} if isinstance(v, int) else set())
    if not special:
        return None
    return torch.isin(ids.cpu(), torch.tensor(sorted(special), dtype=ids.dtype))


def warn_dominant(full_row: torch.Tensor, flagged: torch.Tensor, tokens: Any, method: str, kept: bool) -> None:
    """Warn once when a row has more than :data:`DOMINANT_SHARE` of its mass on a ``flagged`` (B, n) token."""
    share, pos = core_sinks.top_share(full_row)
    hits = [b for b in range(full_row.shape[0]) if share[b] > DOMINANT_SHARE and bool(flagged[b, pos[b]])]
    if not hits:
        return
    b = hits[0]
    p = int(pos[b])
    name = repr(tokens[b][p]) if tokens is not None and b < len(tokens) and p < len(tokens[b]) else f"token {p}"
    more = f" (and {len(hits) - 1} more example(s))" if len(hits) > 1 else ""
    hint = ("the option sinks='keep' kept the attention sinks in the map; sinks='drop' (the default) takes "
            "them out" if kept else "it is a special token or the first token, not found to be an attention "
            "sink by the measured rule; read the rest of the map with this in mind")
    warnings.warn(f"method {method!r}: {100 * float(share[b]):.1f}% of the map of example {b} is on {name} at "
                  f"position {p}{more}: {hint}", stacklevel=4)


def finish(ctx: Any, rec: Any, stream: str, info: Any, full_row: torch.Tensor, layers: torch.Tensor | None,
           extra: dict) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """``Context.build``'s step: :func:`apply` with the ``sinks`` option, then :func:`warn_dominant` on the
    sinks kept, the special tokens and (decoders) the first real token."""
    mode = ctx.options.get("sinks") or "drop"
    full_row, layers, extra = apply(rec, stream, info, full_row, layers, extra, mode)
    B, n = full_row.shape
    flagged = torch.zeros(B, n, dtype=torch.bool)
    ids = ctx.inputs.get(info.input_key or "input_ids") if isinstance(ctx.inputs, dict) else None
    special = special_positions(ids, ctx.tokenizer, ctx.model, n)
    if special is not None:
        flagged |= special
    if "sinks" in extra:
        for b, ps in enumerate(extra["sinks"]):
            flagged[b, ps] = True
    if "sinks" in extra:  # a decoder: its first real token too
        real = torch.ones(B, n, dtype=torch.bool) if info.mask is None else info.mask.cpu().to(torch.bool)
        first = real.to(torch.int64).argmax(dim=-1)
        flagged[torch.arange(B), first] = True
    warn_dominant(full_row, flagged, info.tokens, ctx.method.name, mode == "keep")
    return full_row, layers, extra
