"""Rows of values packed for the page: square-root-companded unsigned integers (or float32), base64 text.

A row r of n values is stored as ``a`` = max |v| and, per value, an integer u in [0, Q] (Q = 255 or 65535):

- a row without negative values: u = round(Q · sqrt(v / a)), read back as v ≈ a · (u / Q)²;
- a row with negative values: x = sign(v) · sqrt(|v| / a) in [-1, 1], u = round((Q − 1) · (x + 1) / 2), read
  back as v ≈ a · sign(x) · x² with x = 2u / (Q − 1) − 1 (an even number of steps, so that 0 has a code).

Companding by the square root keeps small values readable next to a dominant one (a decoder's own last token
often holds most of its row): the error of a value v is at most sqrt(a·|v|)/Q + a/(4Q²) (twice that for rows
with negative values), i.e. about 1/u relative, instead of the a/(2Q) of a linear code that would round every
value below a/Q to zero. 0 and ±a are exact. ``float32`` stores the values themselves (exact, twice the size
of uint16). The integers of all rows are concatenated, little-endian, and base64-encoded once, so that the
browser decodes them with one ``atob`` into a typed array.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

PRECISIONS = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2"), "float32": np.dtype("<f4")}


def encode_rows(rows: Any, precision: str = "uint16") -> dict[str, Any]:
    """(R, n) or (n,) finite values -> {"n", "a": [R], "s": [R] (1 = the row has negatives), "bits", "data"}.

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
    top = np.abs(a).max(axis=1, keepdims=True) if a.size else np.zeros((a.shape[0], 1))
    signed = (a < 0).any(axis=1, keepdims=True) if a.size else np.zeros((a.shape[0], 1), bool)
    if dt.kind == "f":
        q = a.astype(dt)
    else:
        Q = float(np.iinfo(dt).max)
        x = np.sign(a) * np.sqrt(np.abs(a) / np.where(top > 0, top, 1.0))
        q = np.rint(np.where(signed, (x + 1) / 2 * (Q - 1), x * Q)).astype(dt)
    return {
        "n": int(a.shape[1]),
        "a": [float(t) for t in top[:, 0]],
        "s": [int(s) for s in signed[:, 0]],
        "bits": dt.itemsize * 8 if dt.kind != "f" else 32,
        "float": dt.kind == "f",
        "data": base64.b64encode(q.tobytes()).decode("ascii"),
    }


def decode_rows(packed: dict[str, Any]) -> np.ndarray:
    """The inverse of :func:`encode_rows`, as the page computes it: (R, n) float64."""
    R, n = len(packed["a"]), packed["n"]
    raw = base64.b64decode(packed["data"])
    if packed["float"]:
        return np.frombuffer(raw, dtype="<f4").astype(np.float64).reshape(R, n)
    dt = PRECISIONS["uint8" if packed["bits"] == 8 else "uint16"]
    Q = float(np.iinfo(dt).max)
    u = np.frombuffer(raw, dtype=dt).astype(np.float64).reshape(R, n)
    a, s = np.asarray(packed["a"])[:, None], np.asarray(packed["s"], bool)[:, None]
    x = np.where(s, 2 * u / (Q - 1) - 1, u / Q)
    return a * np.sign(x) * x * x


def error_bound(packed: dict[str, Any], values: Any) -> np.ndarray:
    """The most that :func:`decode_rows` can be off for each of ``values`` (R, n), the rows that were packed."""
    v = np.abs(np.asarray(values, dtype=np.float64).reshape(len(packed["a"]), packed["n"]))
    if packed["float"]:
        return v * 2.0 ** -24 + 1e-45
    Q = 255.0 if packed["bits"] == 8 else 65535.0
    a, s = np.asarray(packed["a"])[:, None], np.asarray(packed["s"], bool)[:, None]
    step = np.where(s, 2.0 / (Q - 1), 1.0 / Q)  # a signed row spends half its codes on each side of 0
    return (step * np.sqrt(a * v) + step * step * a / 4) * (1 + 1e-9) + 1e-300


def max_error(packed: dict[str, Any]) -> float:
    """The largest error of any value in ``packed`` (at |v| = a)."""
    if not packed["a"]:
        return 0.0
    a = np.asarray(packed["a"])
    return float(error_bound(packed, np.tile(a[:, None], (1, packed["n"]))).max()) if packed["n"] else 0.0
