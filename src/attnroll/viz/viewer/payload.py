"""What the viewer page carries, built from Explanations: per example and method only the rows it shows
(the final map, the row after each layer, one row per head), quantised (see :mod:`.quant`).

The payload is a JSON-able dict::

    {"title", "notes", "methods": [names], "layers": L (largest layer count, 0 if none),
     "examples": [{"label", "kind": "image" | "tokens" | "matrix", "panels": [[title, key, signed]], "maps": ...}]}

``panels``: what the example's card shows side by side; key None follows the method switcher, a name shows
that map always (the audit's "model A", "model B", "B − A"). ``maps``: name -> {"final", "layers", "heads"}
(packed rows, the last two may be None); "matrix" examples have "rows" (targets × source) and "target"
(targets × target tokens) instead.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .._explanation import is_explanation
from .quant import encode_rows


def _np(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.float64).cpu().numpy()
    return np.asarray(t, dtype=np.float64)


def is_audit_report(x: Any) -> bool:
    """An :class:`~attnroll.evaluate.audit.AuditReport` (by its fields)."""
    return all(hasattr(x, a) for a in ("maps_a", "maps_b", "js", "spearman", "order", "pred_a", "pred_b"))


def named_explanations(explanations: Any) -> dict[str, Any]:
    """One Explanation, a list of them, or {name: Explanation | [Explanation per decoder position]} ->
    an ordered {name: value}; names default to the method, made unique."""
    if is_explanation(explanations):
        items = [(explanations.method, explanations)]
    elif isinstance(explanations, Mapping):
        items = [(str(k), v) for k, v in explanations.items()]
    elif isinstance(explanations, Sequence) and not isinstance(explanations, (str, bytes)):
        items = [(_first(e).method or f"map {i}", e) for i, e in enumerate(explanations)]
    else:
        raise TypeError(
            "explanations must be an Explanation, a list of them or a {name: Explanation} dict (or an "
            f"AuditReport), got {type(explanations).__name__}"
        )
    if not items:
        raise ValueError("explanations is empty: give at least one Explanation")
    out: dict[str, Any] = {}
    for name, e in items:
        for x in (e if isinstance(e, (list, tuple)) else [e]):
            if not is_explanation(x):
                raise TypeError(f"explanations[{name!r}] must be an Explanation (or a list of them for "
                                f"encoder-decoder positions), got {type(x).__name__}")
        key, k = name, 2
        while key in out:
            key, k = f"{name} ({k})", k + 1
        out[key] = list(e) if isinstance(e, (list, tuple)) else e
    return out


def _first(e: Any) -> Any:
    return e[0] if isinstance(e, (list, tuple)) and e else e


def kind_of(expl: Any) -> str:
    """"matrix" for a list (one Explanation per decoder position), "image" for a patch grid, else "tokens"."""
    if isinstance(expl, list):
        return "matrix"
    return "image" if expl.grid is not None else "tokens"


def real_units(expl: Any, b: int) -> np.ndarray:
    """Indices (into ``scores[b]``) of the units shown: the real (unpadded) ones."""
    n = expl.scores.shape[-1]
    if expl.attention_mask is None or expl.grid is not None:
        return np.arange(n)
    m = _np(expl.attention_mask[b, expl.prefix:expl.prefix + n])
    return np.flatnonzero(m > 0)


def map_entry(expl: Any, b: int, keep: np.ndarray, precision: str) -> dict[str, Any]:
    """The rows of example ``b`` restricted to units ``keep``: final (1, u), layers (L, u), heads (H, u)."""
    p = expl.prefix
    final = _np(expl.scores[b])[keep]
    entry: dict[str, Any] = {"final": encode_rows(final, precision), "layers": None, "heads": None}
    if expl.layers is not None:
        entry["layers"] = encode_rows(_np(expl.layers[:, b, p:])[:, keep], precision)
    heads = expl.extra.get("heads") if isinstance(expl.extra, dict) else None
    if heads is not None:
        entry["heads"] = encode_rows(_np(heads)[b][:, p:][:, keep], precision)
    entry["signed"] = bool((final < 0).any())
    return entry


def matrix_entry(expls: list, b: int, precision: str) -> tuple[dict[str, Any], list[int]]:
    """Encoder-decoder rows of example ``b``: one Explanation per explained decoder position, sorted by
    position -> ({"rows": (T, n_src), "target": (T, n_tgt) or None}, positions)."""
    order = sorted(range(len(expls)), key=lambda i: expls[i].positions[b] if expls[i].positions else i)
    keep = real_units(expls[0], b)
    rows = np.stack([_np(expls[i].scores[b])[keep] for i in order])
    tgt = [expls[i].extra.get("target_scores") for i in order]
    entry: dict[str, Any] = {"rows": encode_rows(rows, precision), "target": None, "signed": bool((rows < 0).any())}
    if all(t is not None for t in tgt):
        entry["target"] = encode_rows(np.stack([_np(t)[b] for t in tgt]), precision)
    positions = [int(expls[i].positions[b]) if expls[i].positions else i for i in order]
    return entry, positions


def check_same_inputs(named: dict[str, Any]) -> tuple[str, int]:
    """All explanations must be of one kind and batch size (the same inputs); returns (kind, batch)."""
    kinds = {name: kind_of(e) for name, e in named.items()}
    sizes = {name: _first(e).batch_size for name, e in named.items()}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"explanations must all be over the same kind of input, got {kinds}")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"explanations must all be of the same inputs (batch sizes differ: {sizes})")
    units = {name: _first(e).scores.shape[-1] for name, e in named.items()}
    if len(set(units.values())) > 1:
        raise ValueError(f"explanations must all be over the same units (unit counts differ: {units})")
    return next(iter(kinds.values())), next(iter(sizes.values()))


def pick(value: Any, b: int, batch: int, what: str) -> Any:
    """``value`` for example b: a per-example sequence of length ``batch``, or None."""
    if value is None:
        return None
    if len(value) != batch:
        raise ValueError(f"{what} must have one entry per example ({batch}), got {len(value)}")
    return value[b]
