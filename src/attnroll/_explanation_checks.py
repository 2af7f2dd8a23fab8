"""The checks of an Explanation file (``Explanation.save`` / ``Explanation.load``): arrays numpy cannot store
(bfloat16, float8) are saved as float32 with their dtype recorded and restored on load, and the metadata must
agree with the arrays (prefix and suffix within the row, units = row − prefix − suffix, the grid's size, one
entry per example in tokens / positions / target / readout, the shapes of layers, mask and readout weights).
Only numpy and torch: no other part of the package."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["numpy_array", "stored_dtypes", "restore_dtypes", "check_saved_parts"]

#: Floating arrays of an Explanation file (the rest are masks, or method-specific ``extra__`` arrays).
FLOATING = ("scores", "full_row", "layers", "readout_weights")


def _numpy_lacks(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.dtype not in (
        torch.float16, torch.float32, torch.float64)


def numpy_array(t: Any) -> np.ndarray:
    """A tensor or array as a numpy array (on the CPU, detached); a floating dtype numpy lacks (bfloat16,
    float8) becomes float32, which holds its values exactly."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return (t.to(torch.float32) if _numpy_lacks(t) else t).numpy()
    return np.asarray(t)


def stored_dtypes(tensors: dict[str, Any]) -> dict[str, str]:
    """{array name: torch dtype name} for the tensors :func:`numpy_array` stores as float32."""
    return {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items() if _numpy_lacks(v)}


def restore_dtypes(path: str, t: dict[str, torch.Tensor], dtypes: Any) -> dict[str, torch.Tensor]:
    """The arrays with the dtypes :func:`stored_dtypes` recorded (None: a file from before the record)."""
    if dtypes is None:
        return t
    if not isinstance(dtypes, dict):
        raise ValueError(f"{path}: metadata entry 'dtypes' must be a mapping, got {type(dtypes).__name__}")
    out = dict(t)
    for k, name in dtypes.items():
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if k not in t or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{path}: metadata entry 'dtypes' names {k!r} as {name!r}, which is not a floating "
                             "dtype of an array in the file")
        out[k] = t[k].to(dtype)
    return out


def _per_example(path: str, key: str, value: Any, B: int) -> None:
    if value is not None and (not isinstance(value, list) or len(value) != B):
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{path}: metadata entry {key!r} must hold one entry per example ({B}), got {got}")


def _shape(path: str, key: str, a: Any, want: tuple, what: str) -> None:
    if a is not None and (a.ndim != len(want) or any(w is not None and s != w for s, w in zip(a.shape, want))):
        raise ValueError(f"{path}: {key} has shape {tuple(a.shape)}, expected {what}")


def _arrays(path: str, t: dict[str, torch.Tensor], B: int, n: int) -> None:
    for k in FLOATING:
        if k in t and not t[k].dtype.is_floating_point:
            raise ValueError(f"{path}: {k} must be floating point, got {t[k].dtype}")
    _shape(path, "layers", t.get("layers"), (None, B, n), f"(layers, {B}, {n}) as full_row is ({B}, {n})")
    _shape(path, "attention_mask", t.get("attention_mask"), (B, n), f"({B}, {n}) as full_row")
    _shape(path, "readout_weights", t.get("readout_weights"), (B, None), f"({B}, tokens): one row per example")


def check_saved_parts(path: str, t: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Refuse metadata that contradicts the arrays (``t``: scores (B, units), full_row (B, n), ...)."""
    (B, units), n = t["scores"].shape, t["full_row"].shape[1]
    prefix, suffix = meta["prefix"], meta.get("suffix", 0)
    for key, v in (("prefix", prefix), ("suffix", suffix)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= n:
            raise ValueError(f"{path}: metadata entry {key!r} must be an integer from 0 to {n} (the tokens of "
                             f"full_row), got {v!r}")
    if prefix + units + suffix != n:
        raise ValueError(f"{path}: scores have {units} units, but full_row's {n} tokens less prefix {prefix} and "
                         f"suffix {suffix} leave {n - prefix - suffix}")
    grid = meta["grid"]
    if isinstance(grid, list) and len(grid) == 2 and all(isinstance(g, int) for g in grid):
        if min(grid) < 1 or grid[0] * grid[1] != units:
            raise ValueError(f"{path}: grid {grid[0]}x{grid[1]} does not hold the {units} units of scores")
    tokens = meta["tokens"]
    _per_example(path, "tokens", tokens, B)
    if tokens is not None and not all(isinstance(r, list) and all(isinstance(s, str) for s in r) for r in tokens):
        raise ValueError(f"{path}: metadata entry 'tokens' must be lists of strings, one per example")
    positions = meta["positions"]
    _per_example(path, "positions", positions, B)
    if positions is not None and not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in positions):
        raise ValueError(f"{path}: metadata entry 'positions' must be non-negative integers, got {positions!r}")
    if isinstance(meta.get("target"), list):
        _per_example(path, "target", meta["target"], B)
    readout = meta.get("readout")
    if readout is not None and not isinstance(readout, dict):
        raise ValueError(f"{path}: metadata entry 'readout' must be a mapping, got {type(readout).__name__}")
    _per_example(path, "readout positions", (readout or {}).get("positions"), B)
    _arrays(path, t, B, n)
