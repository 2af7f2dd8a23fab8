"""Rows of values packed for the page: quantised to uint8 / uint16 per row, base64 text.

A row r of n values is stored as ``lo``, ``hi`` (its min and max, float) and n unsigned integers q with
v ≈ lo + (hi − lo) · q / qmax (qmax = 255 or 65535): the error is at most (hi − lo) / (2 · qmax). The
integers of all rows are concatenated, little-endian, and base64-encoded once, so that the browser decodes
them with one ``atob`` into a typed array.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

PRECISIONS = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2")}


def encode_rows(rows: Any, precision: str = "uint16") -> dict[str, Any]:
    """(R, n) or (n,) finite values -> {"n", "lo": [R], "hi": [R], "bits", "data": base64}.

    Non-finite values are a ValueError (the page could not show them honestly)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    a = np.asarray(rows, dtype=np.float64)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2:
        raise ValueError(f"rows must be (R, n) or (n,), got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("rows hold NaN or infinite values; the viewer needs finite scores")
    dt = PRECISIONS[precision]
    qmax = float(np.iinfo(dt).max)
    lo = a.min(axis=1, keepdims=True) if a.size else np.zeros((a.shape[0], 1))
    hi = a.max(axis=1, keepdims=True) if a.size else np.zeros((a.shape[0], 1))
    span = np.where(hi > lo, hi - lo, 1.0)
    q = np.rint((a - lo) / span * qmax).astype(dt)
    return {
        "n": int(a.shape[1]),
        "lo": [float(x) for x in lo[:, 0]],
        "hi": [float(x) for x in hi[:, 0]],
        "bits": dt.itemsize * 8,
        "data": base64.b64encode(q.tobytes()).decode("ascii"),
    }


def decode_rows(packed: dict[str, Any]) -> np.ndarray:
    """The inverse of :func:`encode_rows` (as the page computes it): (R, n) float64."""
    dt = PRECISIONS["uint8" if packed["bits"] == 8 else "uint16"]
    q = np.frombuffer(base64.b64decode(packed["data"]), dtype=dt).astype(np.float64)
    R = len(packed["lo"])
    q = q.reshape(R, packed["n"]) if R else q.reshape(0, packed["n"])
    lo, hi = np.asarray(packed["lo"])[:, None], np.asarray(packed["hi"])[:, None]
    return lo + (hi - lo) * q / float(np.iinfo(dt).max)


def max_error(packed: dict[str, Any]) -> float:
    """The largest quantisation error of any value in ``packed`` (half a step of its widest row)."""
    qmax = 255.0 if packed["bits"] == 8 else 65535.0
    spans = [h - lo for lo, h in zip(packed["lo"], packed["hi"])] or [0.0]
    return max(spans) / (2 * qmax)
