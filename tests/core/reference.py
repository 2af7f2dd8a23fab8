"""A naive, independent reference for rollout, written for readability, not speed.

One example, one layer at a time, plain numpy float64 and Python loops for sparsification. It shares no
code with attnroll; the tests compare the library against it.
"""

from __future__ import annotations

import numpy as np


def fuse(A: np.ndarray, how) -> np.ndarray:
    """A: (H, n, n)."""
    if isinstance(how, str):
        return {"mean": A.mean(0), "max": A.max(0), "min": A.min(0)}[how]
    w = np.asarray(how, dtype=np.float64)
    w = w / w.sum()
    return sum(w[h] * A[h] for h in range(A.shape[0]))


def rescale_rows(P: np.ndarray, target: np.ndarray) -> np.ndarray:
    out = P.copy()
    for i in range(P.shape[0]):
        s = P[i].sum()
        out[i] = P[i] * (target[i] / s) if s > 0 else 0.0
    return out


def sparsify(P, valid, *, discard_ratio, discard_scope, top_k, threshold, protect_prefix):
    """Zero entries by the documented rules (stable tie-breaking by row-major position)."""
    n = P.shape[0]
    before = P.sum(1)
    elig = [(i, j) for i in range(n) for j in range(n) if i >= protect_prefix and j >= protect_prefix and valid[i] and valid[j]]
    drop = set()
    if discard_ratio:
        if discard_scope == "layer":
            k = int(np.floor(len(elig) * discard_ratio))
            ranked = sorted(elig, key=lambda ij: (P[ij], ij[0] * n + ij[1]))
            drop |= set(ranked[:k])
        else:
            for i in range(n):
                row = [ij for ij in elig if ij[0] == i]
                k = int(np.floor(len(row) * discard_ratio))
                drop |= set(sorted(row, key=lambda ij: (P[ij], ij[1]))[:k])
    if top_k is not None:
        for i in range(n):
            row = [ij for ij in elig if ij[0] == i]
            drop |= set(sorted(row, key=lambda ij: (-P[ij], ij[1]))[top_k:])
    if threshold is not None:
        drop |= {ij for ij in elig if P[ij] < threshold}
    out = P.copy()
    for ij in drop:
        out[ij] = 0.0
    return rescale_rows(out, before)


def residual(P, valid, alpha, mode):
    n = P.shape[0]
    I = np.diag(valid.astype(np.float64))
    if mode == "blend":
        return (1 - alpha) * P + alpha * I
    if mode == "add":
        return P + alpha / (1 - alpha) * I
    M = (1 - alpha) * P + alpha * I
    for i in range(n):
        s = M[i].sum()
        M[i] = M[i] / s if s > 0 else 0.0
    return M


def augmented(A_h, valid, opts):
    """One layer of one example: A_h (H, n, n) or (n, n) when head_fusion is None."""
    P = A_h if opts.get("head_fusion", "mean") is None else fuse(A_h, opts.get("head_fusion", "mean"))
    P = np.array(P, dtype=np.float64)
    n = P.shape[0]
    if not valid.all():
        full = P.sum(1)
        for i in range(n):
            for j in range(n):
                if not (valid[i] and valid[j]):
                    P[i, j] = 0.0
        P = rescale_rows(P, np.where(valid, full, 0.0))
    P = sparsify(
        P,
        valid,
        discard_ratio=opts.get("discard_ratio", 0.0),
        discard_scope=opts.get("discard_scope", "layer"),
        top_k=opts.get("top_k"),
        threshold=opts.get("threshold"),
        protect_prefix=opts.get("protect_prefix", 1),
    )
    return residual(P, valid, opts.get("alpha", 0.5), opts.get("residual_mode", "blend"))


def rollout_partials_one(layers, valid, opts):
    """Every partial product for one example, oldest layer first."""
    L = len(layers)
    start = opts.get("start_layer", 0) % L
    end = opts.get("end_layer")
    end = L if end is None else (end if end >= 0 else end + L)
    n = layers[0].shape[-1]
    R, out = np.eye(n), []
    for l in range(start, end):
        R = augmented(layers[l], valid, opts) @ R
        out.append(R)
    return out


def rollout_one(layers, valid, opts):
    """layers: list of per-layer arrays of ONE example. Returns the full (n, n) R for [start, end)."""
    return rollout_partials_one(layers, valid, opts)[-1]
