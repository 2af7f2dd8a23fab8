"""ALTI's per-layer contributions in one fused pass, compiled with numba (optional: the ``fast`` extra).

    c_ij = max(0, ‖y_i‖₁ − ‖y_i − Σ_h α^h_ij F^h_j − δ_ij x_j‖₁)      for every (b, i, j)

without forming the B·n²·d mixed vectors: for one key token j the H vectors F_j (H·d values) stay in cache
while every query row i is mixed, subtracted and summed into a small buffer. The torch kernel of
``value_aware.alti_matrix`` writes and re-reads those vectors through memory, which is what bounds it.
Same values as that kernel up to float rounding (the L1 sums accumulate in float64 here).

numba is imported on first use only; without it (or where it does not import) :func:`available` is False
and callers keep the torch kernel. The compiled code releases the GIL and runs on ``torch.get_num_threads()``
Python threads over disjoint (b, j) ranges, so it follows the caller's torch thread setting.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import torch

__all__ = ["available", "supports", "contributions"]

#: Below this many multiply-adds (B·n²·H·d) one thread does the whole layer (starting threads costs more).
_THREAD_MIN_WORK = 1 << 24


def _pairs(A, F, x, y, y1, out, lo, hi):  # pragma: no cover - runs compiled (numba), equality-tested
    """The kernel on numpy arrays: A (B, n_j, n_i, H) the attention columns, F (B, n, H, d), x / y (B, n, d),
    y1 (B, n) float64 = ‖y_i‖₁; writes out[b, i, j] for the flat key indices p = b·n + j in [lo, hi).

    Two query rows share each load of F_j and the heads go four at a time, so each buffer element is loaded
    and stored once per four heads rather than once per head (the loop is bound by memory traffic to L1)."""
    B, n, H, d = F.shape
    t0 = np.empty(d, F.dtype)
    t1 = np.empty(d, F.dtype)
    H4 = H - H % 4
    for p in range(lo, hi):
        b, j = p // n, p % n
        Fj = F[b, j]
        for i0 in range(0, n, 2):
            i1 = min(i0 + 1, n - 1)  # odd n: the last row is computed twice, same value
            for k in range(d):
                t0[k] = y[b, i0, k]
                t1[k] = y[b, i1, k]
            if i0 == j:  # the residual: z_{i←i} also holds x_i
                for k in range(d):
                    t0[k] -= x[b, j, k]
            if i1 == j:
                for k in range(d):
                    t1[k] -= x[b, j, k]
            p0, p1 = A[b, j, i0], A[b, j, i1]
            for h in range(0, H4, 4):
                a0, a1, a2, a3 = p0[h], p0[h + 1], p0[h + 2], p0[h + 3]
                c0, c1, c2, c3 = p1[h], p1[h + 1], p1[h + 2], p1[h + 3]
                f0, f1, f2, f3 = Fj[h], Fj[h + 1], Fj[h + 2], Fj[h + 3]
                for k in range(d):
                    g0, g1, g2, g3 = f0[k], f1[k], f2[k], f3[k]
                    t0[k] -= a0 * g0 + a1 * g1 + a2 * g2 + a3 * g3
                    t1[k] -= c0 * g0 + c1 * g1 + c2 * g2 + c3 * g3
            for h in range(H4, H):
                a, c, f = p0[h], p1[h], Fj[h]
                for k in range(d):
                    t0[k] -= a * f[k]
                    t1[k] -= c * f[k]
            s0 = 0.0
            s1 = 0.0
            for k in range(d):
                s0 += abs(t0[k])
                s1 += abs(t1[k])
            c0, c1 = y1[b, i0] - s0, y1[b, i1] - s1
            out[b, i0, j] = 0.0 if c0 < 0.0 else c0  # written so that a NaN stays NaN, as torch's clamp
            out[b, i1, j] = 0.0 if c1 < 0.0 else c1


@lru_cache(maxsize=1)
def _compiled():
    """The jitted kernel, or None when numba is missing or does not import beside this numpy."""
    try:
        import numba
    except ImportError:
        return None
    # reassoc lets the compiler vectorise the L1 sums; no fast-math flags that assume finite values.
    opts = dict(nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy")
    try:
        return numba.njit(cache=True, **opts)(_pairs)
    except RuntimeError:  # no writable cache location: compile per process instead
        return numba.njit(**opts)(_pairs)


def available() -> bool:
    """Whether the fused kernel can run (numba importable)."""
    return _compiled() is not None


def supports(t: torch.Tensor) -> bool:
    """Whether the kernel takes tensors like ``t`` (CPU, float32 or float64)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def contributions(alpha: torch.Tensor, F: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """c_ij (B, n_i, n_j) from alpha (B, H, n, n), F (B, n, H, d), x and y (B, n, d), all CPU tensors of one
    dtype (float32 or float64); see the module docstring. Needs :func:`available`."""
    kernel = _compiled()
    if kernel is None:
        raise RuntimeError("the fused ALTI kernel needs numba (pip install 'attnroll[fast]')")
    if not supports(F):
        raise ValueError(f"the fused ALTI kernel takes CPU float32 / float64 tensors; got {F.dtype} on {F.device}")
    B, n, H, d = F.shape
    A = alpha.detach().permute(0, 3, 2, 1).contiguous().numpy()  # a key token's weights (n_i, H) contiguous
    Fn, xn, yn = (t.detach().contiguous().numpy() for t in (F, x, y))
    y1 = np.abs(yn).sum(-1, dtype=np.float64)
    out = np.empty((B, n, n), dtype=Fn.dtype)
    threads = 1 if B * n * n * H * d < _THREAD_MIN_WORK else max(1, min(torch.get_num_threads(), B * n))
    bounds = [B * n * t // threads for t in range(threads + 1)]
    if threads == 1:
        kernel(A, Fn, xn, yn, y1, out, 0, B * n)
    else:
        with ThreadPoolExecutor(threads) as pool:
            jobs = [pool.submit(kernel, A, Fn, xn, yn, y1, out, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
            for job in jobs:
                job.result()
    return torch.from_numpy(out)
