"""core.operators: blockwise recomputed probabilities against a naive full softmax written here, and the row
operator against ``rollout`` on the materialised matrices."""

from __future__ import annotations

import math

import pytest
import torch

from attnroll.core import operators as op
from attnroll.core.rollout import rollout

#: float32 paths against float32 or float64 references: torch's own float32 tolerance. The rounding depends on
#: the CPU's kernels (an AVX-512 machine lands up to ~1.3e-6 away where an AVX2 one stayed within 1e-6); a real
#: error (a wrong row, head, mask or shift) is orders of magnitude larger.
F32 = dict(atol=1e-5, rtol=1.3e-6)

B, H, HKV, N, D = 2, 4, 2, 19, 8


def naive_probs(q, k, scaling, *, mask=None, causal=False, window=None, softcap=None, sinks=None, bias=None):
    """Eager attention written out in full: (B, H, n, n), as transformers' eager kernels do it (sinks as
    gpt-oss: an extra logit column dropped after the softmax)."""
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    n = q.shape[-2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= j > i - window
    s = s.masked_fill(~allowed, -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    return p[..., :n] if sinks is not None else p


def layer(**kw):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, H, N, D, generator=g) * 2, torch.randn(B, HKV, N, D, generator=g) * 2
    return op.KernelInputs(q=q, k=k, scaling=D ** -0.5, **kw)


def alibi(n):
    slopes = torch.tensor([2.0 ** (-(h + 1)) for h in range(H)])
    dist = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()
    return (slopes[:, None, None] * dist)[None]  # (1, H, n, n)


def padding_mask():
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :4] = False
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    return (j <= i)[None, None] & keep[:, None, None, :] | (i == j)  # (B, 1, n, n), no empty row


CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window=5),
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), causal=True),
    "bool_mask": dict(mask=padding_mask()),
    "alibi_additive_mask": dict(mask=alibi(N) + torch.where(padding_mask(), 0.0, torch.finfo(torch.float32).min)),
    "bias_and_window": dict(bias=alibi(N), causal=True, window=7),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block", [1, 16, 64])
def test_blockwise_probabilities_equal_naive(case, block):
    lay = layer(**CASES[case])
    ref = naive_probs(lay.q, lay.k, lay.scaling, **CASES[case])
    got = torch.zeros_like(ref)
    for q0 in range(0, N, block):
        q1 = min(N, q0 + block)
        k0, k1 = op.key_range(lay, q0, q1)
        outside = torch.cat([ref[:, :, q0:q1, :k0], ref[:, :, q0:q1, k1:]], dim=-1)
        assert float(outside.abs().sum()) == 0  # the key range drops only exact zeros
        got[:, :, q0:q1, k0:k1] = op.probs_block(lay, q0, q1, k0, k1)
    torch.testing.assert_close(got, ref, **F32)


@pytest.mark.parametrize("mode", ["blend", "renorm", "add"])
@pytest.mark.parametrize("fusion", ["mean", "max"])
@pytest.mark.parametrize("padded", [False, True])
def test_row_operator_equals_rollout_of_matrices(mode, fusion, padded):
    layers = [layer(causal=True), layer(window=6), layer(softcap=2.0)]
    mats = [naive_probs(lay.q, lay.k, lay.scaling, causal=lay.causal, window=lay.window, softcap=lay.softcap)
            for lay in layers]
    mask = None
    if padded:
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[0, -3:] = False
    rows = [N - 4, 2]
    ref = rollout(mats, head_fusion=fusion, residual_mode=mode, alpha=0.3, rows=rows, attention_mask=mask,
                  check_stochastic=fusion == "mean")
    E = torch.zeros(B, 2, N)
    E[:, 0, rows[0]], E[:, 1, rows[1]] = 1.0, 1.0
    from attnroll.core.residual import residual_coefficients

    a, c = residual_coefficients(0.3, mode)
    for blk in (None, 5):
        got = op.rollout_rows(layers, E, op.fused_probs(fusion), a=a, c=c, renorm=mode == "renorm", mask=mask) \
            if blk is None else _with_block(layers, E, fusion, a, c, mode, mask, blk)
        torch.testing.assert_close(got, ref, **F32)


def _with_block(layers, E, fusion, a, c, mode, mask, blk):
    v = E * (1 if mask is None else mask[:, None, :])
    for lay in reversed(layers):
        v = op.apply_layer(v, lay, op.fused_probs(fusion), a=a, c=c, renorm=mode == "renorm", mask=mask, block=blk)
    return v


def test_gradient_rule_is_grad_times_attention():
    """weighted_probs: mean_h((dO·Vᵀ ⊙ A)^+), checked against autograd through a naive attention."""
    lay = layer(causal=True)
    g = torch.Generator().manual_seed(2)
    v = torch.randn(B, HKV, N, 5, generator=g)
    A = naive_probs(lay.q, lay.k, lay.scaling, causal=True).requires_grad_(True)
    out = A @ v.repeat_interleave(H // HKV, dim=1)
    w = torch.randn(out.shape, generator=g)
    (grad_a,) = torch.autograd.grad((out * w).sum(), A)
    lay.v, lay.grad_out = v, w  # d(sum(out * w)) / d out = w
    ref = (grad_a * A).clamp(min=0).mean(dim=1).detach()
    got = op.weighted_probs("per_head")(lay, 0, N, 0, N)
    torch.testing.assert_close(got, ref, **F32)
    ref_after = (grad_a * A).mean(dim=1).clamp(min=0).detach()
    torch.testing.assert_close(op.weighted_probs("after_mean")(lay, 0, N, 0, N), ref_after, **F32)


def test_attention_rows_pick_the_given_queries():
    lay = layer(causal=True)
    ref = naive_probs(lay.q, lay.k, lay.scaling, causal=True)
    got = op.attention_rows(lay, [3, 11])
    torch.testing.assert_close(got, ref[:, :, [3, 11]], **F32)


def test_rows_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="relevance rows have 5 entries"):
        op.apply_layer(torch.ones(B, 1, 5), layer(), op.fused_probs("mean"), a=0.5, c=0.5)


# ------------------------------------------------------------------- the tiled path and the row log-sum-exp
TILED = {k: CASES[k] for k in ("plain", "causal", "window", "sinks")}


def naive_lse(lay, **kw):
    """log Σ_j exp(logit_ij) (+ the sink), from the naive probabilities: log(p_ij) = logit_ij − lse_i."""
    k = lay.k.repeat_interleave(H // lay.k.shape[1], dim=1)
    s = lay.q @ k.transpose(-1, -2) * lay.scaling
    p = naive_probs(lay.q, lay.k, lay.scaling, **kw)
    j = p.argmax(dim=-1, keepdim=True)  # an allowed key with p > 0 in every row
    return (s.gather(-1, j) - p.gather(-1, j).log())[..., 0]


@pytest.mark.parametrize("case", list(TILED))
def test_row_lse_equals_naive(case):
    lay = layer(**TILED[case])
    torch.testing.assert_close(op.row_lse(lay), naive_lse(lay, **TILED[case]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(TILED))
@pytest.mark.parametrize("tiles", [(None, None), (3, 5), (7, 2), (64, 64)])
@pytest.mark.parametrize("lse", ["none", "kernel", "wrong"])
def test_tiled_path_equals_rollout_of_matrices(case, tiles, lse):
    """The fast path (no normalisation of any block: exp2 of the augmented product) against one layer of
    ``rollout`` on the naive matrices; relevance on a few rows only (the others skipped). A kernel's
    log-sum-exp that disagrees with the logits (here shifted by 0.5) must be rejected, not used."""
    lay = layer(**TILED[case])
    if lse != "none":
        lay.lse = naive_lse(lay, **TILED[case]) + (0.5 if lse == "wrong" else 0.0)
    A = naive_probs(lay.q, lay.k, lay.scaling, **TILED[case]).mean(dim=1)  # (B, n, n)
    g = torch.Generator().manual_seed(3)
    r = torch.rand(B, 2, N, generator=g)
    r[..., 5:9] = 0.0
    ref = 0.6 * (r @ A) + 0.4 * r
    assert op.tiled_applies(lay, op.fused_probs("mean"), r, None, False)
    got = op.apply_layer_tiled(r, lay, a=0.6, c=0.4, rows=tiles[0], keys=tiles[1])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_tiled_path_is_taken_only_where_it_is_exact():
    """Masks, softcapping, position bias, renorm, padding and non-mean fusions need the normalised blocks."""
    r = torch.rand(B, 1, N)
    mean = op.fused_probs("mean")
    assert op.tiled_applies(layer(causal=True, window=3), mean, r, None, False)
    assert not op.tiled_applies(layer(softcap=1.0), mean, r, None, False)
    assert not op.tiled_applies(layer(mask=padding_mask()), mean, r, None, False)
    assert not op.tiled_applies(layer(bias=alibi(N)), mean, r, None, False)
    assert not op.tiled_applies(layer(), op.fused_probs("max"), r, None, False)
    assert not op.tiled_applies(layer(), mean, r, torch.ones(B, N, dtype=torch.bool), False)
    assert not op.tiled_applies(layer(), mean, r, None, True)
    assert not op.tiled_applies(layer(), mean, r.double(), None, False)


# ------------------------------------------------------------------------------------- the small-n path
WHOLE = {k: CASES[k] for k in ("plain", "causal", "window")}


@pytest.mark.parametrize("case", list(WHOLE))
@pytest.mark.parametrize("live", ["all", "some", "one"])
@pytest.mark.parametrize("chunk", [None, 1])
def test_whole_layer_equals_rollout_of_matrices(case, live, chunk, monkeypatch):
    """The small-n path (every live row at once, the softmax's division moved onto the rows) against one
    layer of ``rollout`` on the naive matrices, grouped KV heads included; relevance on every row, on some
    rows or on one (the top layer of a sweep); chunk=1: one example per chunk."""
    if chunk is not None:
        monkeypatch.setattr(op, "CHUNK_ELEMENTS", chunk)
    lay = layer(**WHOLE[case])
    A = naive_probs(lay.q, lay.k, lay.scaling, **WHOLE[case]).mean(dim=1)  # (B, n, n)
    g = torch.Generator().manual_seed(4)
    r = torch.rand(B, 2, N, generator=g)
    if live == "some":
        r[..., 5:12] = 0.0
        r[0, :, 15:] = 0.0  # live in one example only
    elif live == "one":
        r = torch.zeros(B, 1, N)
        r[:, 0, 3] = 1.0
    ref = 0.6 * (r @ A) + 0.4 * r
    assert op.whole_applies(lay, op.fused_probs("mean"), r, None, False)
    torch.testing.assert_close(op.apply_layer_whole(r, lay, a=0.6, c=0.4), ref, **F32)
    torch.testing.assert_close(op.apply_layer(r, lay, op.fused_probs("mean"), a=0.6, c=0.4), ref, **F32)


def test_whole_layer_with_large_logits_and_no_relevance():
    """Logits in the hundreds (an overflow for exp without the row max) still give the exact softmax; rows
    without relevance give only the identity share; a = 0 leaves c·r."""
    lay = layer(causal=True)
    lay.q = lay.q * 40.0
    A = naive_probs(lay.q, lay.k, lay.scaling, causal=True).mean(dim=1)
    assert float((lay.q @ lay.k.repeat_interleave(2, dim=1).transpose(-1, -2)).abs().max() * lay.scaling) > 200
    r = torch.rand(B, 1, N, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(op.apply_layer_whole(r, lay, a=0.5, c=0.5), 0.5 * (r @ A) + 0.5 * r, **F32)
    zero = torch.zeros(B, 1, N)
    assert torch.equal(op.apply_layer_whole(zero, lay, a=0.5, c=0.5), zero)
    torch.testing.assert_close(op.apply_layer_whole(r, lay, a=0.0, c=0.7), 0.7 * r)


def test_whole_path_is_taken_only_where_it_is_exact(monkeypatch):
    """Sinks, masks, softcapping, bias, renorm, padding, non-mean fusions, float64 rows and cross-attention go
    to the general paths, and so do layers above the size budget."""
    r = torch.rand(B, 1, N)
    mean = op.fused_probs("mean")
    assert op.whole_applies(layer(causal=True, window=3), mean, r, None, False)
    for kw in (dict(sinks=torch.zeros(H)), dict(softcap=1.0), dict(mask=padding_mask()), dict(bias=alibi(N))):
        assert not op.whole_applies(layer(**kw), mean, r, None, False)
    assert not op.whole_applies(layer(), op.fused_probs("max"), r, None, False)
    assert not op.whole_applies(layer(), mean, r, torch.ones(B, N, dtype=torch.bool), False)
    assert not op.whole_applies(layer(), mean, r, None, True)
    assert not op.whole_applies(layer(), mean, r.double(), None, False)
    cross = layer()
    cross.k = cross.k[:, :, :7]
    assert not op.whole_applies(cross, mean, r, None, False)
    monkeypatch.setattr(op, "WHOLE_ELEMENTS", H * N * N - 1)
    assert not op.whole_applies(layer(), mean, r, None, False) and not op.whole_size(layer())


# ------------------------------------------------------------------- small layers fused during the forward
@pytest.mark.parametrize("case", list(WHOLE))
@pytest.mark.parametrize("split", ["none", "chunks", "examples"])
def test_mean_probs_equal_naive_head_mean(case, split, monkeypatch):
    """``mean_probs`` (the capture's fusion of a small layer) against the head mean of the naive softmax in
    float64, grouped KV heads included; "chunks": one example per chunk; "examples": the logits multiplied
    example by example (``PER_EXAMPLE_MACS``), on q and k laid out as the kernels get them ((B, n, H, d)
    buffers seen as (B, H, n, d))."""
    if split == "chunks":
        monkeypatch.setattr(op, "CHUNK_ELEMENTS", 1)
    lay = layer(**WHOLE[case])
    if split == "examples":
        monkeypatch.setattr(op, "PER_EXAMPLE_MACS", 1)
        lay.q = lay.q.transpose(1, 2).contiguous().transpose(1, 2)
        lay.k = lay.k.transpose(1, 2).contiguous().transpose(1, 2)
    assert op.fusable(lay)
    fused = op.mean_probs(lay)
    ref = naive_probs(lay.q.double(), lay.k.double(), lay.scaling, **WHOLE[case]).mean(dim=1)
    assert fused.shape == lay.shape and fused.probs.dtype == torch.float32 and fused.heads == H
    torch.testing.assert_close(fused.probs.double(), ref, **F32)


@pytest.mark.parametrize("case", list(WHOLE))
@pytest.mark.parametrize("split", ["none", "chunks"])
def test_attend_mean_gives_the_attention_output_and_the_head_mean(case, split, monkeypatch):
    """``attend_mean`` (the capture computing a fused layer's attention itself) against a naive float64
    eager attention: its output softmax·v in transformers' (B, n, H, d_v) layout, contiguous, and the head
    mean of the same probabilities, grouped KV heads included, on q, k, v laid out as the kernels get them;
    "chunks": one example per chunk. The output also equals torch's own SDPA kernel (the one it replaces)."""
    if split == "chunks":
        monkeypatch.setattr(op, "CHUNK_ELEMENTS", 1)
    lay = layer(**WHOLE[case])
    lay.q = lay.q.transpose(1, 2).contiguous().transpose(1, 2)
    lay.k = lay.k.transpose(1, 2).contiguous().transpose(1, 2)
    v = torch.randn(B, N, HKV, 5, generator=torch.Generator().manual_seed(3)).transpose(1, 2)
    out, fused = op.attend_mean(lay, v)
    p = naive_probs(lay.q.double(), lay.k.double(), lay.scaling, **WHOLE[case])  # (B, H, n, n)
    want = (p @ v.double().repeat_interleave(H // HKV, dim=1)).transpose(1, 2)
    assert out.shape == (B, N, H, 5) and out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, **F32)
    torch.testing.assert_close(fused.probs.double(), p.mean(dim=1), **F32)
    assert fused.heads == H and fused.shape == lay.shape
    if case == "plain":
        sdpa = torch.nn.functional.scaled_dot_product_attention(lay.q, lay.k, v, scale=lay.scaling, enable_gqa=True)
        torch.testing.assert_close(out, sdpa.transpose(1, 2), atol=1e-5, rtol=0)


def _scaled_layer(seed):
    """A plain layer whose logits differ from ``layer()``'s (q scaled by a seed-dependent factor)."""
    lay = layer()
    lay.q = lay.q * (0.5 + 0.25 * seed)
    return lay


def test_kept_buffers_reuse_one_buffer_per_matrix_across_calls():
    """Inside ``kept_buffers`` the k-th fused matrix of a call lands in the thread's k-th buffer, the same
    storage from one call to the next (that is the point: no fresh pages), and every value is the naive
    float64 head mean of its own layer, in both calls; outside, fresh tensors as before."""
    v = torch.randn(B, HKV, N, 3, generator=torch.Generator().manual_seed(5))
    ptrs = []
    for call in range(2):
        with op.kept_buffers():
            lays = [_scaled_layer(call * 3 + i) for i in range(3)]
            fused = [op.mean_probs(lays[0]), op.attend_mean(lays[1], v)[1], op.mean_probs(lays[2])]
            for lay, f in zip(lays, fused):
                ref = naive_probs(lay.q.double(), lay.k.double(), lay.scaling).mean(dim=1)
                torch.testing.assert_close(f.probs.double(), ref, **F32)
            ptrs.append([f.probs.data_ptr() for f in fused])
    assert ptrs[0] == ptrs[1] and len(set(ptrs[0])) == 3
    outside = [op.mean_probs(layer()).probs.data_ptr() for _ in range(2)]
    assert not set(outside) & set(ptrs[0])


def _in_new_thread(fn):
    """``fn()`` run in a fresh thread (a fresh arena); its result."""
    import threading

    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", fn()))
    t.start()
    t.join()
    return got["r"]


def test_kept_buffers_nested_over_budget_and_other_threads(monkeypatch):
    """A nested ``kept_buffers`` goes on with the outer one's buffers (no two matrices of one call share
    storage); beyond ``ARENA_ELEMENTS`` a matrix is a fresh tensor; each thread has its own buffers. Values
    are the naive head mean in every case."""
    ref = naive_probs(layer().q.double(), layer().k.double(), layer().scaling).mean(dim=1)

    def nested():
        with op.kept_buffers():
            first = op.mean_probs(layer()).probs
            with op.kept_buffers():
                second = op.mean_probs(layer()).probs
            third = op.mean_probs(layer()).probs
        return first, second, third

    def budget():
        monkeypatch.setattr(op, "ARENA_ELEMENTS", B * N * N)  # room for one matrix only
        calls = []
        for _ in range(2):
            with op.kept_buffers():
                calls.append([op.mean_probs(layer()).probs for _ in range(2)])
        return calls

    mats = _in_new_thread(nested)
    assert len({m.data_ptr() for m in mats}) == 3
    (a0, a1), (b0, b1) = _in_new_thread(budget)
    assert a0.data_ptr() == b0.data_ptr() and len({a0.data_ptr(), a1.data_ptr(), b1.data_ptr()}) == 3
    with op.kept_buffers():
        mine = op.mean_probs(layer()).probs
    assert mine.data_ptr() not in {m.data_ptr() for m in (*mats, a0)}
    for p in (*mats, a0, a1, b0, b1, mine):
        torch.testing.assert_close(p.double(), ref, **F32)


def test_attend_mean_with_exponentials_out_of_range():
    """Logits in the hundreds (exp overflows without the row max): ``attend_mean`` still gives the softmax."""
    lay = layer(causal=True)
    lay.q = lay.q * 40.0
    v = torch.randn(B, HKV, N, 3, generator=torch.Generator().manual_seed(4))
    out, fused = op.attend_mean(lay, v)
    p = naive_probs(lay.q.double(), lay.k.double(), lay.scaling, causal=True)
    want = (p @ v.double().repeat_interleave(H // HKV, dim=1)).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.probs.double(), p.mean(dim=1), **F32)


def _all_logits_far_below_zero():
    """A layer whose every logit is about −140: exp without the row max underflows to 0 in every row."""
    g = torch.Generator().manual_seed(8)
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    q = -40.0 * u + 0.3 * torch.randn(B, H, N, D, generator=g)
    k = 10.0 * u + 0.3 * torch.randn(B, HKV, N, D, generator=g)
    return op.KernelInputs(q=q, k=k, scaling=D ** -0.5)


@pytest.mark.parametrize("extreme", ["overflow", "underflow"])
def test_exponentials_out_of_range_still_give_the_softmax(extreme):
    """The small-n path exponentiates the logits without the row max when every row sum stays in range;
    logits in the hundreds (exp overflows) and rows whose every logit is far below zero (every exp
    underflows) must still give the exact softmax, in ``mean_probs`` and in ``apply_layer_whole``."""
    if extreme == "overflow":
        lay = layer(causal=True)
        lay.q = lay.q * 40.0
    else:
        lay = _all_logits_far_below_zero()
    kw = dict(causal=lay.causal)
    logits = (lay.q @ lay.k.repeat_interleave(H // HKV, dim=1).transpose(-1, -2)) * lay.scaling
    sums = torch.exp(logits.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), -math.inf)
                     if lay.causal else logits).sum(dim=-1)
    assert bool(torch.isinf(sums).any()) if extreme == "overflow" else float(sums.max()) < 2.0 ** -100
    ref = naive_probs(lay.q.double(), lay.k.double(), lay.scaling, **kw).mean(dim=1)
    tol = 1e-5  # float32 logits in the hundreds, or near −140, are rounded by up to ~1e-5
    torch.testing.assert_close(op.mean_probs(lay).probs.double(), ref, atol=tol, rtol=0)
    r = torch.rand(B, 2, N, generator=torch.Generator().manual_seed(9))
    want = 0.5 * (r.double() @ ref) + 0.5 * r.double()
    torch.testing.assert_close(op.apply_layer_whole(r, lay, a=0.5, c=0.5).double(), want, atol=tol, rtol=0)


@pytest.mark.parametrize("mode", ["blend", "renorm", "add"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("top", ["kept", "fused"])
def test_fused_layers_in_the_row_operator_equal_rollout_of_matrices(mode, padded, dtype, top):
    """A stack of fused layers (and a top layer kept as queries and keys, as the capture leaves it after the
    model's kernel, or fused too, as after ``attend_mean``) through ``rollout_rows`` against ``rollout`` on
    the naive matrices: residual modes, padding, float64 rows."""
    cases = [dict(causal=True), dict(), dict(causal=True, window=6)]
    layers = [layer(**kw) for kw in cases]
    mats = [naive_probs(lay.q, lay.k, lay.scaling, **kw) for lay, kw in zip(layers, cases)]
    v = torch.randn(B, HKV, N, 4)
    mixed = [op.mean_probs(lay) for lay in layers[:-1]]
    mixed.append(layers[-1] if top == "kept" else op.attend_mean(layers[-1], v)[1])
    assert [type(x).__name__ for x in mixed] == ["FusedLayer", "FusedLayer", "KernelInputs" if top == "kept" else "FusedLayer"]
    mask = None
    if padded:
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[1, -4:] = False
    rows = [N - 5, 0]
    ref = rollout(mats, head_fusion="mean", residual_mode=mode, alpha=0.3, rows=rows, attention_mask=mask)
    E = torch.zeros(B, 2, N, dtype=dtype)
    E[:, 0, rows[0]], E[:, 1, rows[1]] = 1.0, 1.0
    from attnroll.core.residual import residual_coefficients

    a, c = residual_coefficients(0.3, mode)
    got = op.rollout_rows(mixed, E, op.fused_probs("mean"), a=a, c=c, renorm=mode == "renorm", mask=mask)
    assert got.dtype == dtype
    torch.testing.assert_close(got.to(torch.float32), ref, **F32)


def test_only_small_plain_layers_are_fusable():
    """Masks, biases, softcapping, sinks, cross-attention, layers above the whole-layer budget and a matrix
    larger than the queries and keys it would replace (n > d·(H + H_kv)) keep their queries and keys."""
    assert op.fusable(layer(causal=True, window=3))
    for kw in (dict(sinks=torch.zeros(H)), dict(softcap=1.0), dict(mask=padding_mask()), dict(bias=alibi(N))):
        assert not op.fusable(layer(**kw))
    cross = layer()
    cross.k = cross.k[:, :, :7]
    assert not op.fusable(cross)
    narrow = layer()
    narrow.q, narrow.k = narrow.q[..., :3], narrow.k[..., :3]  # 19 > 3·(4 + 2)
    assert not op.fusable(narrow)


def test_scratch_reuse_across_layers_of_other_sizes():
    """The small-n path's per-thread scratch is shared by layers of every size: interleaving two shapes
    gives the same results as computing each alone."""
    small, big = layer(causal=True), op.KernelInputs(q=torch.randn(3, 2, 30, 8), k=torch.randn(3, 2, 30, 8),
                                                     scaling=0.4)
    first = op.mean_probs(small).probs.clone()
    big_probs = op.mean_probs(big).probs
    again = op.mean_probs(small).probs
    assert torch.equal(first, again)
    want = torch.softmax(big.q @ big.k.transpose(-1, -2) * big.scaling, dim=-1).mean(dim=1)
    torch.testing.assert_close(big_probs, want, **F32)
