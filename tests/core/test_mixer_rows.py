"""Rows-only mixer layers (core/mixers.py ``MixerRows``: ``SSDRows``, ``SelectiveRows``, ``DeltaRows``,
``ConvRows``, ``LRURows``): every block of rows equals the same rows of the dense per-channel matrices folded and
summed (Σ_c |K_c|, built from ``ssd_matrix`` / ``selective_matrix`` / ``delta_matrix`` / ``conv_matrix`` /
``lru_matrix``), for several block sizes, blocks out of order and channel groups split; the sweep never
allocates an (n, n) tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from attnroll.core import mixers

f64 = torch.float64

# Sweeps of many row blocks through tiny mixers (and models): left out of `make test-fast`.
pytestmark = pytest.mark.slow


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


#: How the convolution enters the layer (core.mixers.CONVOLUTIONS), for the builders below; tests set it.
CONVOLUTION = {"now": "apart"}


def _dense_total(M: torch.Tensor, gate: torch.Tensor | None, w: torch.Tensor | None) -> torch.Tensor:
    """From per-channel matrices M (b, C, n, n): Σ_c |M_c| · |diag(gate_c) · T_c| (the convolution apart) or
    Σ_c |M_c · diag(gate_c) · T_c| (folded), (b, n, n), dense products; Σ_c |M_c| without w."""
    if w is None:
        return M.abs().sum(1)
    n = M.shape[-1]
    G = torch.ones(M.shape[0], n, M.shape[1], dtype=M.dtype) if gate is None else gate
    T = G.transpose(1, 2)[..., None] * mixers.conv_matrix(w, n)[0]  # (b, C, n, n): diag(gate_c) · T_c
    if CONVOLUTION["now"] == "apart":
        return (M.abs() @ T.abs()).sum(1)
    return (M @ T).abs().sum(1)


def _ssd(g, b=2, n=23, h=3, N=4, P=2, K=4):
    C, B = (torch.randn(b, n, h, N, dtype=f64, generator=g) for _ in range(2))
    dt = F.softplus(torch.randn(b, n, h, dtype=f64, generator=g))
    A, D = -torch.rand(h, dtype=f64, generator=g), torch.randn(h, dtype=f64, generator=g)
    gate, w = torch.rand(b, n, h * P, dtype=f64, generator=g), torch.randn(h * P, K, dtype=f64, generator=g)
    lay = mixers.SSDRows(C, B, dt, A, D, gate, w)
    S = mixers.ssd_matrix(C, B, dt, A, D)[:, torch.arange(h * P) // P]
    return lay, _dense_total(S, gate, w)


def _selective(g, b=2, n=23, d=5, N=3, K=4):
    C, B = (torch.randn(b, n, N, dtype=f64, generator=g) for _ in range(2))
    dt = F.softplus(torch.randn(b, n, d, dtype=f64, generator=g))
    A, D = -torch.rand(d, N, dtype=f64, generator=g) * 2, torch.randn(d, dtype=f64, generator=g)
    out, gate = torch.randn(b, n, d, dtype=f64, generator=g), torch.rand(b, n, d, dtype=f64, generator=g)
    w = torch.randn(d, K, dtype=f64, generator=g)
    lay = mixers.SelectiveRows(C, B, dt, A, D, out, gate, w)
    M = mixers.selective_matrix(C, B, dt, A, D) * out.transpose(1, 2)[..., None]
    return lay, _dense_total(M, gate, w)


def _delta(g, per_channel=False, b=2, n=23, h=2, dk=3, dv=2, K=4):
    q, k = (F.normalize(torch.randn(b, n, h, dk, dtype=f64, generator=g), dim=-1) for _ in range(2))
    beta = torch.rand(b, n, h, dtype=f64, generator=g) * 2  # up to 2: negative eigenvalues allowed
    gl = -torch.rand(b, n, h, *((dk,) if per_channel else ()), dtype=f64, generator=g)
    gate, w = torch.rand(b, n, h * dv, dtype=f64, generator=g), torch.randn(h * dv, K, dtype=f64, generator=g)
    lay = mixers.DeltaRows(q, k, beta, gl, gate, w)
    W = mixers.delta_matrix(q, k, beta, gl)[:, torch.arange(h * dv) // dv]
    return lay, _dense_total(W, gate, w)


def _conv(g, b=2, n=23, d=5, K=4):
    w = torch.randn(d, K, dtype=f64, generator=g)
    pre, post = (torch.randn(b, n, d, dtype=f64, generator=g) for _ in range(2))
    return mixers.ConvRows(w, pre, post), _dense_total(mixers.conv_matrix(w, n, pre, post), None, None)


def _lru(g, b=2, n=23, d=4, K=4):
    log_a = -torch.rand(b, n, d, dtype=f64, generator=g)
    scale, out = torch.rand(b, n, d, dtype=f64, generator=g), torch.randn(b, n, d, dtype=f64, generator=g)
    seg = torch.zeros(b, n, dtype=torch.int64)
    seg[1, 9:] = 1  # a restart at position 9 of the second example
    w = torch.randn(d, K, dtype=f64, generator=g)
    M = mixers.lru_matrix(log_a, scale) * (seg[:, None, :, None] == seg[:, None, None, :])
    M = M * out.transpose(1, 2)[..., None]
    return mixers.LRURows(log_a, scale, out, w, segment=seg), _dense_total(M, None, w)


BUILDERS = {"ssd": _ssd, "selective": _selective, "delta": _delta, "kda": lambda g, **kw: _delta(g, True, **kw), "conv": _conv,
            "lru": _lru}


@pytest.fixture(params=mixers.CONVOLUTIONS)
def convolution(request):
    CONVOLUTION["now"] = request.param
    yield request.param
    CONVOLUTION["now"] = "apart"


@pytest.mark.parametrize("kind", BUILDERS)
def test_blocks_equal_the_dense_rows(kind, convolution, monkeypatch):
    lay, dense = BUILDERS[kind](_gen(3))
    lay.convolution = convolution
    n = dense.shape[-1]
    for rows in (3, 5, 16, 64):
        lay.rows = rows
        for t0 in range(0, n, rows):
            t1 = min(n, t0 + rows)
            torch.testing.assert_close(lay.block(t0, t1), dense[:, t0:t1, :t1], atol=1e-6, rtol=0)
    for t0, t1 in ((7, 13), (2, 9), (20, 23), (0, 23), (11, 12)):  # out of order, across the state's chunks
        torch.testing.assert_close(lay.block(t0, t1), dense[:, t0:t1, :t1], atol=1e-6, rtol=0)
    monkeypatch.setattr(mixers, "ROWS_BUDGET", 1)  # one channel group at a time
    torch.testing.assert_close(lay.block(4, 19), dense[:, 4:19, :19], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", BUILDERS)
def test_apply_rows_is_the_normalised_dense_product(kind, convolution):
    lay, dense = BUILDERS[kind](_gen(4))
    lay.convolution = convolution
    b, n, _ = dense.shape
    Fd = dense / dense.sum(-1, keepdim=True)
    r = torch.rand(b, 2, n, dtype=f64, generator=_gen(5))
    for rows in (6, 64):
        lay.rows = rows
        torch.testing.assert_close(lay.apply_rows(r, a=0.5, c=0.5), r @ (0.5 * Fd + 0.5 * torch.eye(n, dtype=f64)),
                                   atol=1e-10, rtol=0)
    assert lay.shape == (b, 1, n, n)


@pytest.mark.parametrize("kind", ["ssd", "delta", "lru"])
def test_apply_rows_on_padding_and_renorm(kind):
    """Padded tokens (a mask) and the renormalised blend: the sweep equals the dense rule written out here (padded
    columns dropped, rows renormalised over the real ones, each row divided by a·[row has mass] + c·[real])."""
    lay, dense = BUILDERS[kind](_gen(10))
    b, n, _ = dense.shape
    mask = torch.ones(b, n, dtype=f64)
    mask[1, :5] = 0  # left padding in the second example
    Fm = dense * mask[:, None, :]
    sums = Fm.sum(-1, keepdim=True)
    Fd = Fm / torch.where(sums > 0, sums, torch.ones(()))
    r = torch.rand(b, 3, n, dtype=f64, generator=_gen(11)) * mask[:, None, :]
    a, c = 0.6, 0.4
    s = a * (sums[..., 0] > 0).to(f64) + c * mask
    want = (r / torch.where(s > 0, s, torch.ones(()))[:, None, :]) @ (a * Fd + c * torch.diag_embed(mask))
    lay.rows = 7
    torch.testing.assert_close(lay.apply_rows(r, a=a, c=c, renorm=True, mask=mask), want, atol=1e-10, rtol=0)


def test_ssd_selective_factored_blocks_survive_strong_decays():
    """Strong decays (most entries underflow; at 4000 a block's own decays span past what its factors hold: the
    direct form) and a positive rate (the direct form throughout): the blocks stay the rows."""
    g = _gen(6)
    for scale in (40.0, 4000.0, -0.3):
        lay, _ = _selective(g)
        lay.A = -scale * torch.rand_like(lay.A)
        M = mixers.selective_matrix(lay.C, lay.B, lay.dt, lay.A, lay.D)
        for t0, t1 in ((0, 6), (6, 13), (13, 23), (2, 23)):
            got = mixers.selective_block(lay.C, lay.B, lay.dt, lay.A, lay.D, t0, t1, sub=4)
            torch.testing.assert_close(got, M[:, :, t0:t1, :t1], atol=1e-9, rtol=1e-9)


def _old_ssd_block(lay: mixers.SSDRows, t0: int, t1: int) -> torch.Tensor:
    """SSDRows.block before its fold took all channels in one product: per head, the K taps per column."""
    M = mixers.ssd_block(lay.C, lay.B, lay.dt, lay.A, lay.D, t0, t1, causal_cols=True)
    b, H, R, _ = M.shape
    K = lay.weight.shape[-1]
    P = lay.gate_in.shape[-1] // H
    g, w = lay.gate_in[:, :t1].to(M.dtype), lay.weight.to(M.dtype).flip(-1)
    total = M.new_zeros(b, R, t1)
    for h in range(H):
        c0, c1 = h * P, (h + 1) * P
        shifted, coef = M.new_zeros(b, R, t1, K), M.new_zeros(b, t1, K, P)
        for k in range(min(K, t1)):
            shifted[:, :, : t1 - k, k] = M[:, h, :, k:]
            coef[:, : t1 - k, k] = g[:, k:, c0:c1] * w[c0:c1, k]
        total += torch.einsum("brsk,bskc->brsc", shifted, coef).abs_().sum(-1)
    return total


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ssd_rows_fold_equals_the_per_head_fold(dtype):
    lay, _ = _ssd(_gen(7), n=40, h=4, P=8)
    lay.convolution = "folded"
    for name in ("C", "B", "dt", "A", "D", "gate_in", "weight"):
        setattr(lay, name, getattr(lay, name).to(dtype))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for t0, t1 in ((0, 2), (0, 16), (16, 32), (32, 40), (37, 40)):
        torch.testing.assert_close(lay.block(t0, t1), _old_ssd_block(lay, t0, t1), atol=tol, rtol=tol)


class _Largest(TorchDispatchMode):
    """The largest tensor any torch operation returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_in_sweep(kind: str, n: int, rows: int = 8) -> tuple[int, int]:
    """(largest tensor of a rows-only sweep at length n, the dense per-channel matrices' size b·C·n²)."""
    lay, dense = BUILDERS[kind](_gen(8), n=n)
    lay.rows = rows
    r = torch.rand(lay.batch, 1, n, dtype=f64, generator=_gen(9))
    with _Largest() as seen:
        lay.apply_rows(r, a=0.5, c=0.5)
    channels = 1 if lay.weight is None else lay.weight.shape[0]
    return seen.largest, dense.shape[0] * max(channels, lay.groups) * n * n


@pytest.mark.parametrize("kind", BUILDERS)
def test_sweep_memory_is_linear_in_the_length(kind):
    """Doubling n (blocks of 8 rows) at most doubles the largest tensor the sweep creates (an (n, n) tensor would
    quadruple it), and it stays far below the dense matrices; blocks of n rows do grow as n²."""
    small, _ = _largest_in_sweep(kind, 96)
    big, dense = _largest_in_sweep(kind, 192)
    assert big <= 2.1 * small and big < dense / 4, (small, big, dense)
    whole_small, _ = _largest_in_sweep(kind, 96, rows=96)
    whole_big, _ = _largest_in_sweep(kind, 192, rows=192)
    assert whole_big >= 3.5 * whole_small  # the check sees quadratic growth where there is some


def test_ssd_sparse_rows_take_the_same_sweep():
    """Rows that carry relevance at a few positions (one-hot rows: the top layer, sink probes) take the block's
    live rows alone; the result equals the dense rule."""
    lay, dense = _ssd(_gen(12), n=40)
    b, n, _ = dense.shape
    Fd = dense / dense.sum(-1, keepdim=True)
    r = torch.zeros(b, 3, n, dtype=f64)
    r[0, 0, 39], r[1, 1, 17], r[0, 2, 3], r[1, 2, 38] = 1.0, 0.5, 2.0, 1.0
    lay.rows = 16
    torch.testing.assert_close(lay.apply_rows(r, a=0.5, c=0.5), r @ (0.5 * Fd + 0.5 * torch.eye(n, dtype=f64)),
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 40.0, 4000.0])
def test_ssd_sweep_survives_strong_decays(scale):
    """The SSD sweep's own blocks take the factored product while their decays span little, the direct form past
    a quarter of the exponent range (strong decays: most entries underflow); both equal the dense rule."""
    g = _gen(13)
    b, n, h, N, P, K = 2, 40, 3, 4, 2, 4
    C, B = (torch.randn(b, n, h, N, dtype=f64, generator=g) for _ in range(2))
    dt = F.softplus(torch.randn(b, n, h, dtype=f64, generator=g))
    A, D = -scale * torch.rand(h, dtype=f64, generator=g), torch.randn(h, dtype=f64, generator=g)
    gate, w = torch.rand(b, n, h * P, dtype=f64, generator=g), torch.randn(h * P, K, dtype=f64, generator=g)
    lay = mixers.SSDRows(C, B, dt, A, D, gate, w, rows=16)
    S = mixers.ssd_matrix(C, B, dt, A, D)[:, torch.arange(h * P) // P]
    dense = _dense_total(S, gate, w)
    Fd = dense / dense.sum(-1, keepdim=True)
    r = torch.rand(b, 2, n, dtype=f64, generator=_gen(14))
    torch.testing.assert_close(lay.apply_rows(r, a=0.5, c=0.5), r @ (0.5 * Fd + 0.5 * torch.eye(n, dtype=f64)),
                               atol=1e-12, rtol=0)


def test_ssd_few_rows_with_padding_and_renorm():
    """A handful of live rows (the direct per-row form) with padding and the renormalised blend: the dense rule."""
    lay, dense = _ssd(_gen(15), n=40)
    b, n, _ = dense.shape
    mask = torch.ones(b, n, dtype=f64)
    mask[1, :6] = 0
    Fm = dense * mask[:, None, :]
    sums = Fm.sum(-1, keepdim=True)
    Fd = Fm / torch.where(sums > 0, sums, torch.ones(()))
    r = torch.zeros(b, 2, n, dtype=f64)
    r[0, 0, 39], r[1, 1, 20], r[1, 0, 3], r[0, 1, 8] = 1.0, 0.7, 5.0, 0.3  # (1, ·, 3) is padding: dropped
    a, c = 0.6, 0.4
    s = a * (sums[..., 0] > 0).to(f64) + c * mask
    want = ((r * mask[:, None, :]) / torch.where(s > 0, s, torch.ones(()))[:, None, :]) @ (
        a * Fd + c * torch.diag_embed(mask))
    lay.rows = 16
    torch.testing.assert_close(lay.apply_rows(r, a=a, c=c, renorm=True, mask=mask), want, atol=1e-12, rtol=0)


def test_ssd_forgotten_past_is_below_eps_squared(monkeypatch):
    """Strong decays in float32: the sweep that leaves out the columns decayed below eps² equals the one that takes
    every column (core.mixers.FORGET_BELOW = 0) to float32 resolution, and both the float64 dense rule."""
    g = _gen(16)
    b, n, h, N, P, K = 1, 300, 2, 4, 2, 4
    C, B = (torch.randn(b, n, h, N, dtype=f64, generator=g) for _ in range(2))
    dt = F.softplus(torch.randn(b, n, h, dtype=f64, generator=g))
    A, D = -torch.tensor([3.0, 0.01], dtype=f64), torch.randn(h, dtype=f64, generator=g)  # forgetting, slow
    gate, w = torch.rand(b, n, h * P, dtype=f64, generator=g), torch.randn(h * P, K, dtype=f64, generator=g)
    S = mixers.ssd_matrix(C, B, dt, A, D)[:, torch.arange(h * P) // P]
    dense = _dense_total(S, gate, w)
    Fd = dense / dense.sum(-1, keepdim=True)
    r = torch.rand(b, 1, n, generator=g)
    lay = mixers.SSDRows(*(t.float() for t in (C, B, dt, A, D, gate, w)), rows=32)
    got = lay.apply_rows(r, a=1.0, c=0.0)
    monkeypatch.setattr(mixers, "FORGET_BELOW", 0.0)
    every = lay.apply_rows(r, a=1.0, c=0.0)
    torch.testing.assert_close(got, every, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.double(), r.double() @ Fd, atol=1e-6, rtol=1e-4)


def _old_delta_rows(q, k, beta, g, t0, t1):
    """Rows [t0, t1), columns [0, t1) of the DeltaRows matrices as the per-token scan gave them (the reference the
    block-at-once form replaced): the block's own columns by the delta rule token by token, the earlier ones
    x_sᵀ·U_t with x_s carried over the tokens before t0 one A_r at a time."""
    qh, kh, bh = q.transpose(1, 2), k.transpose(1, 2), beta.transpose(1, 2)
    ah = g.exp().transpose(1, 2)
    ah = ah[..., None] if g.ndim == 3 else ah
    W, U = mixers._delta_local(qh[:, :, t0:t1], kh[:, :, t0:t1], bh[:, :, t0:t1], ah[:, :, t0:t1])
    X = q.new_zeros(qh.shape[0], qh.shape[1], 0, qh.shape[-1])
    for r in range(t0):  # x_sᵀ ← x_sᵀ·A_r, then the new row β_r k_rᵀ
        Xa = X * ah[:, :, r, None, :]
        X = Xa - bh[:, :, r, None, None] * (Xa @ kh[:, :, r, :, None]) * kh[:, :, r, None, :]
        X = torch.cat([X, (bh[:, :, r, None] * kh[:, :, r])[:, :, None]], 2)
    return torch.cat([U @ X.transpose(-1, -2), W], -1)


def _delta_gates(g, per_channel, b=2, n=23, h=3, dk=4, decay=1.0):
    q, k = (F.normalize(torch.randn(b, n, h, dk, dtype=f64, generator=g), dim=-1) for _ in range(2))
    beta = torch.rand(b, n, h, dtype=f64, generator=g) * 2  # up to 2: negative eigenvalues allowed
    gl = -torch.rand(b, n, h, *((dk,) if per_channel else ()), dtype=f64, generator=g) * decay
    return q, k, beta, gl


@pytest.mark.parametrize("per_channel", [False, True])
def test_delta_blocks_at_once_equal_the_per_token_scan(per_channel, monkeypatch):
    """The chunkwise (WY) blocks equal the per-token scan and the dense delta_matrix to 1e-10 in float64: gated
    DeltaNet and KDA, β up to 2, blocks of 1 to all the tokens (sizes not dividing n), out of order (the state
    restarts), head subsets; no block falls back to the per-token scan."""
    q, k, beta, gl = _delta_gates(_gen(21), per_channel)
    n, h = q.shape[1], q.shape[2]
    dense = mixers.delta_matrix(q, k, beta, gl)
    gate, w = torch.rand(2, n, h, dtype=f64), torch.randn(h, 4, dtype=f64)
    lay = mixers.DeltaRows(q, k, beta, gl, gate, w)
    monkeypatch.setattr(mixers, "_delta_local", None)  # the per-token path is not taken
    monkeypatch.setattr(lay, "_advance_tokens", None)
    spans = [(t0, min(n, t0 + rows)) for rows in (1, 3, 7, 16, 23) for t0 in range(0, n, rows)]
    spans += [(7, 13), (2, 9), (20, 23), (0, 23), (11, 12), (5, 6)]
    for t0, t1 in spans:
        lay.rows = t1 - t0
        got = lay.group_rows(t0, t1, 0, h)
        torch.testing.assert_close(got, dense[:, :, t0:t1, :t1], atol=1e-10, rtol=0)
        torch.testing.assert_close(lay.group_rows(t0, t1, 1, h), dense[:, 1:, t0:t1, :t1], atol=1e-10, rtol=0)
    monkeypatch.undo()
    for t0, t1 in ((0, 5), (9, 17), (17, 23)):  # the per-token scan this form replaced: the same rows
        torch.testing.assert_close(lay.group_rows(t0, t1, 0, h), _old_delta_rows(q, k, beta, gl, t0, t1),
                                   atol=1e-10, rtol=0)


@pytest.mark.parametrize("per_channel", [False, True])
def test_delta_blocks_survive_strong_decays(per_channel, monkeypatch):
    """Decays up to e^{-60} per token: one decay per head stays in the block form (its decays are taken direct);
    per key channel, the blocks whose decays span past the factored range take the per-token scan, the others the
    block form, and every block equals the dense matrix to 1e-10 (float64)."""
    q, k, beta, gl = _delta_gates(_gen(22), per_channel, decay=60.0)
    n, h = q.shape[1], q.shape[2]
    dense = mixers.delta_matrix(q, k, beta, gl)
    lay = mixers.DeltaRows(q, k, beta, gl, torch.rand(2, n, h, dtype=f64), torch.randn(h, 4, dtype=f64))
    taken = []
    local = mixers._delta_local
    monkeypatch.setattr(mixers, "_delta_local", lambda *a: taken.append(a[0].shape[2]) or local(*a))
    for rows in (1, 4, 23):  # a block of 1 or 4 tokens spans < 600; 23 tokens do not (per channel)
        lay.rows = rows
        for t0 in range(0, n, rows):
            t1 = min(n, t0 + rows)
            torch.testing.assert_close(lay.group_rows(t0, t1, 0, h), dense[:, :, t0:t1, :t1], atol=1e-10, rtol=0)
    assert taken == ([23] if per_channel else [])
    assert bool(dense.abs().amax() > 0.1)  # not a matrix of zeros


def test_delta_blocks_in_float32_and_growing_decays():
    """float32 gates (as a model's forward gives them) stay within float32 rounding of the float64 rows, and
    decays above 1 (α > 1) take the same block form."""
    q, k, beta, gl = _delta_gates(_gen(23), True, decay=-0.05)  # α up to e^{0.05}: a growing state
    n, h = q.shape[1], q.shape[2]
    dense = mixers.delta_matrix(q, k, beta, gl)
    args = (torch.rand(2, n, h, dtype=f64), torch.randn(h, 4, dtype=f64))
    lay, lay32 = mixers.DeltaRows(q, k, beta, gl, *args), mixers.DeltaRows(q.float(), k.float(), beta.float(),
                                                                             gl.float(), *(a.float() for a in args))
    for rows in (5, 16):
        lay.rows = lay32.rows = rows
        for t0 in range(0, n, rows):
            t1 = min(n, t0 + rows)
            torch.testing.assert_close(lay.group_rows(t0, t1, 0, h), dense[:, :, t0:t1, :t1], atol=1e-10, rtol=0)
            torch.testing.assert_close(lay32.group_rows(t0, t1, 0, h).double(), dense[:, :, t0:t1, :t1],
                                       atol=1e-5, rtol=0)
