"""Token-mixer matrices (core/mixers.py) against the real transformers layers: each matrix, built from the gates the
layer's own forward pass computed, equals the Jacobian of the layer's own scan / convolution / recurrence with
respect to its value-like input (the gates are arguments of that code, held at their values), in float64 to
1e-5 on tiny random configs; the fused rows-only form equals the dense fusion."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.functional import jacobian

from attnroll.core import mixers

from ..zoo import decoder

# Tiny multi-part models (VLMs, hybrids, token mixers, mixtures of experts): left out of `make test-fast`.
pytestmark = pytest.mark.slow

ATOL = 1e-5


def _record(monkeypatch, module_name: str, fn_name: str) -> list:
    """Record every call of transformers' module-level ``fn_name`` (the real function still runs)."""
    mod = importlib.import_module(module_name)
    real = getattr(mod, fn_name)
    calls: list = []

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, fn_name, wrapper)
    return calls, real


def _ids(n: int = 7) -> torch.Tensor:
    return torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(1))


def _per_channel(J: torch.Tensor, b: int, n: int, c: int) -> torch.Tensor:
    """(b, n, c, b, n, c) Jacobian -> (b, c, n, n) blocks, after checking it has no cross-example or cross-channel
    terms."""
    J = J.reshape(b, n, c, b, n, c)
    eye_b = torch.eye(b, dtype=torch.bool)[:, None, None, :, None, None]
    eye_c = torch.eye(c, dtype=torch.bool)[None, None, :, None, None, :]
    assert J.masked_fill(eye_b & eye_c, 0).abs().max() < ATOL
    return torch.stack([torch.stack([J[i, :, k, i, :, k] for k in range(c)]) for i in range(b)])


def test_ssd_matrix_is_the_mamba2_scan(monkeypatch):
    calls, real = _record(monkeypatch, "transformers.models.mamba2.modeling_mamba2", "mamba2_chunk_scan")
    model = decoder("mamba2").double()
    with torch.no_grad():
        model(input_ids=_ids())
    args, kw = calls[0]
    x, dt, A, B, C = args
    b, n, h, p = x.shape
    rep = h // B.shape[2]
    dt_eff = torch.clamp(F.softplus(dt + kw["dt_bias"]), *kw["dt_limit"])
    M = mixers.ssd_matrix(C.repeat_interleave(rep, 2), B.repeat_interleave(rep, 2), dt_eff, A, kw["D"])

    def scan(xx):
        out = real(xx, dt, A, B, C, **kw)
        return out[0] if isinstance(out, tuple) else out

    J = jacobian(scan, x)  # (b, n, h, p, b, n, h, p)
    blocks = _per_channel(J, b, n, h * p)  # channel = (head, p)
    want = M.repeat_interleave(p, 1)
    torch.testing.assert_close(blocks, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixers.mix(M, x), scan(x), atol=ATOL, rtol=0)


def test_conv_matrix_is_the_causal_convolution_with_the_silu_gate_held():
    calls_mod = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    model = decoder("mamba2").double()
    conv = model.backbone.layers[0].mixer.conv1d
    w, bias = conv.weight.squeeze(1), conv.bias
    b, n, ch = 2, 7, w.shape[0]
    u = torch.randn(b, ch, n, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def run(xx):  # the model's own causal convolution, without its activation
        return calls_mod.causal_conv1d_fn(xx, w, bias, activation=None).transpose(1, 2)

    J = jacobian(run, u).permute(0, 1, 2, 3, 5, 4)  # (b, n, ch, b, ch, n) -> inputs as (b, n, ch)
    T = mixers.conv_matrix(w.detach(), n)
    torch.testing.assert_close(_per_channel(J, b, n, ch), T.expand(b, -1, -1, -1), atol=ATOL, rtol=0)
    # the SiLU after it, its sigmoid held at its value: y = σ(a)·a is T with the gate as a diagonal on its rows
    a = run(u).detach()
    held = mixers.conv_matrix(w.detach(), n, post=torch.sigmoid(a))
    x = u.transpose(1, 2)
    got = mixers.mix(held, x) + torch.sigmoid(a) * bias.detach()
    torch.testing.assert_close(got, F.silu(a), atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_selective_matrix_is_the_mamba_scan_with_its_gate(monkeypatch, model_type):
    module = f"transformers.models.{model_type}.modeling_{model_type}"
    calls, real = _record(monkeypatch, module, "mamba_selective_scan")
    model = decoder(model_type).double()
    with torch.no_grad():
        model(input_ids=_ids())
    assert calls, f"{model_type}'s mixer did not call mamba_selective_scan"
    args, kw = calls[0]
    x, dt, A, B, C = args  # x (b, d, n), dt (b, d, n), B / C (b, N, n)
    b, d, n = x.shape
    dt_eff = F.softplus(dt + kw["delta_bias"][..., None]).transpose(1, 2)
    M = mixers.selective_matrix(C.transpose(1, 2), B.transpose(1, 2), dt_eff, A, kw["D"])
    gate = F.silu(kw["z"]).transpose(1, 2)  # the output gate, a diagonal at its value
    held = mixers.conv_matrix(torch.ones(d, 1, dtype=x.dtype), n, post=gate) @ M

    def scan(xx):
        out = real(xx.transpose(1, 2), dt, A, B, C, **kw)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    J = jacobian(scan, x.transpose(1, 2))
    torch.testing.assert_close(_per_channel(J, b, n, d), held, atol=ATOL, rtol=0)


def test_delta_matrix_is_the_gated_delta_rule():
    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    g_ = torch.Generator().manual_seed(3)
    b, n, h, dk, dv = 2, 6, 2, 4, 3
    q = F.normalize(torch.randn(b, n, h, dk, dtype=torch.float64, generator=g_), dim=-1)
    k = F.normalize(torch.randn(b, n, h, dk, dtype=torch.float64, generator=g_), dim=-1)
    v = torch.randn(b, n, h, dv, dtype=torch.float64, generator=g_)
    beta = torch.rand(b, n, h, dtype=torch.float64, generator=g_)
    g = -torch.rand(b, n, h, dtype=torch.float64, generator=g_)

    def rule(vv):
        out, _ = mod.torch_recurrent_gated_delta_rule(q, k, vv, g, beta, initial_state=None,
                                                      output_final_state=False, use_qk_l2norm_in_kernel=False)
        return out  # (b, n, h, dv)

    W = mixers.delta_matrix(q * dk ** -0.5, k, beta, g)  # the rule scales q by 1/sqrt(dk) itself
    J = jacobian(rule, v)  # (b, n, h, dv, b, n, h, dv)
    for i in range(b):
        for hh in range(h):
            torch.testing.assert_close(J[i, :, hh, 0, i, :, hh, 0], W[i, hh], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixers.mix(W, v), rule(v), atol=ATOL, rtol=0)


def test_delta_matrix_with_a_per_channel_decay_is_kimi_delta_attention():
    mod = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    g_ = torch.Generator().manual_seed(4)
    b, n, h, dk, dv = 2, 6, 2, 4, 3
    q, k = (F.normalize(torch.randn(b, n, h, dk, dtype=torch.float64, generator=g_), dim=-1) for _ in range(2))
    v = torch.randn(b, n, h, dv, dtype=torch.float64, generator=g_)
    beta = torch.rand(b, n, h, dtype=torch.float64, generator=g_)
    g = -2 * torch.rand(b, n, h, dk, dtype=torch.float64, generator=g_)  # a decay per key channel

    def rule(vv):  # KDA's own recurrence (it computes in float32)
        return mod.recurrent_kimi_delta_attention(q, k, vv, g, beta, None, False)[0].double()

    W = mixers.delta_matrix(q * dk ** -0.5, k, beta, g)
    J = jacobian(rule, v)
    for i in range(b):
        for hh in range(h):
            torch.testing.assert_close(J[i, :, hh, 0, i, :, hh, 0], W[i, hh], atol=ATOL, rtol=0)
    # a per-channel decay that is the same on every channel is the per-head gated DeltaNet
    same = mixers.delta_matrix(q, k, beta, g[..., :1].expand(-1, -1, -1, dk))
    torch.testing.assert_close(same, mixers.delta_matrix(q, k, beta, g[..., 0]), atol=1e-12, rtol=0)


def test_lru_matrix_is_the_diagonal_recurrence():
    g_ = torch.Generator().manual_seed(4)
    b, n, d = 2, 6, 3
    a = torch.rand(b, n, d, dtype=torch.float64, generator=g_) * 0.9 + 0.05
    scale = torch.randn(b, n, d, dtype=torch.float64, generator=g_)
    x = torch.randn(b, n, d, dtype=torch.float64, generator=g_)
    h, ys = torch.zeros(b, d, dtype=torch.float64), []
    for t in range(n):
        h = a[:, t] * h + scale[:, t] * x[:, t]
        ys.append(h)
    torch.testing.assert_close(mixers.mix(mixers.lru_matrix(a.log(), scale), x), torch.stack(ys, 1), atol=ATOL, rtol=0)


def test_fused_rows_equal_the_dense_fusion():
    g_ = torch.Generator().manual_seed(5)
    b, n, h, N = 2, 11, 3, 4
    C, B = (torch.randn(b, n, h, N, dtype=torch.float64, generator=g_) for _ in range(2))
    dt = F.softplus(torch.randn(b, n, h, dtype=torch.float64, generator=g_))
    A, D = -torch.rand(h, dtype=torch.float64, generator=g_), torch.randn(h, dtype=torch.float64, generator=g_)
    Fd = mixers.fuse_channels(mixers.ssd_matrix(C, B, dt, A, D))
    torch.testing.assert_close(Fd.sum(-1), torch.ones(b, n, dtype=torch.float64))
    r = torch.rand(b, 2, n, dtype=torch.float64, generator=g_)
    want = r @ (0.5 * Fd + 0.5 * torch.eye(n, dtype=torch.float64))
    for causal in (False, True):
        got = mixers.fused_rows(r, lambda t0, t1: mixers.ssd_block(C, B, dt, A, D, t0, t1, causal_cols=causal), n,
                                a=0.5, c=0.5, rows=4)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="how"):
        mixers.fuse_channels(Fd[:, None], how="max")


@pytest.mark.parametrize("scale", [0.3, 40.0])
def test_ssd_block_rows_equal_the_matrix_rows(scale):
    """The blocks after the first take the columns before them as a rank-N product (decays factored at the block's
    start); with strong decays (scale 40: most entries underflow) and with a positive rate (no factoring)."""
    g_ = torch.Generator().manual_seed(6)
    b, n, h, N = 2, 13, 3, 4
    C, B = (torch.randn(b, n, h, N, dtype=torch.float64, generator=g_) for _ in range(2))
    dt = F.softplus(torch.randn(b, n, h, dtype=torch.float64, generator=g_))
    D = torch.randn(h, dtype=torch.float64, generator=g_)
    for A in (-scale * torch.rand(h, dtype=torch.float64, generator=g_), torch.tensor([0.2, -0.1, -0.3]).double()):
        M = mixers.ssd_matrix(C, B, dt, A, D)
        for t0, t1 in ((0, 5), (5, 9), (9, 13), (12, 13)):
            torch.testing.assert_close(mixers.ssd_block(C, B, dt, A, D, t0, t1), M[:, :, t0:t1], atol=1e-12,
                                       rtol=1e-12)
            torch.testing.assert_close(mixers.ssd_block(C, B, dt, A, D, t0, t1, causal_cols=True),
                                       M[:, :, t0:t1, :t1], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("scale", [0.3, 40.0])
def test_ssd_rows_forms_equal_the_dense_fusions(scale):
    """``ssd_rows`` (|·| fusion, per-head factored blocks) and ``ssd_signed_rows`` (signed mean, a reverse scan in
    linear time) against the dense fusions of ``ssd_matrix``; a positive rate takes their fallbacks."""
    g_ = torch.Generator().manual_seed(7)
    b, n, h, N = 2, 23, 3, 4
    C, B = (torch.randn(b, n, h, N, dtype=torch.float64, generator=g_) for _ in range(2))
    dt = F.softplus(torch.randn(b, n, h, dtype=torch.float64, generator=g_))
    D = torch.randn(h, dtype=torch.float64, generator=g_)
    r = torch.rand(b, 2, n, dtype=torch.float64, generator=g_)
    I = torch.eye(n, dtype=torch.float64)
    for A in (-scale * torch.rand(h, dtype=torch.float64, generator=g_), torch.tensor([0.2, -0.1, -0.3]).double()):
        M = mixers.ssd_matrix(C, B, dt, A, D)
        want_abs = r @ (0.5 * mixers.fuse_channels(M) + 0.5 * I)
        want_signed = r @ (0.7 * mixers.fuse_channels(M, "mean") + 0.3 * I)
        for rows in (4, 7, 64):
            got = mixers.ssd_rows(r, C, B, dt, A, D, a=0.5, c=0.5, rows=rows)
            torch.testing.assert_close(got, want_abs, atol=1e-12, rtol=0)
            got = mixers.ssd_signed_rows(r, C, B, dt, A, D, a=0.7, c=0.3, chunk=rows)
            torch.testing.assert_close(got, want_signed, atol=1e-10, rtol=0)


def test_ssd_rows_equals_the_generic_block_sweep_in_float32():
    """``ssd_rows`` (rank-N products per head, contiguous right operands) against ``fused_rows`` over ``ssd_block``
    (the generic route), float32, several blocks long, mild decays as a trained mixer's."""
    g_ = torch.Generator().manual_seed(9)
    b, n, h, N = 1, 700, 4, 16
    C, B = (torch.randn(b, n, 1, N, generator=g_).expand(-1, -1, h, -1) for _ in range(2))  # one group
    dt = F.softplus(torch.randn(b, n, h, generator=g_) - 3)
    A, D = -torch.rand(h, generator=g_) * 2, torch.rand(h, generator=g_)
    r = torch.rand(b, 1, n, generator=g_)
    want = mixers.fused_rows(r, lambda t0, t1: mixers.ssd_block(C, B, dt, A, D, t0, t1, causal_cols=True), n, a=0.5,
                             c=0.5, rows=128)
    got = mixers.ssd_rows(r, C, B, dt, A, D, a=0.5, c=0.5, rows=128)
    torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("convolution", ["apart", "folded"])
def test_ssd_rows_layer_equals_the_dense_fusion(convolution):
    """``SSDRows`` (the matrix-free route's Mamba-2 layer) against the dense Σ_c |S_h(c)| · |diag(g_c) · T_c|
    (the convolution apart) or Σ_c |S_h(c) · diag(g_c) · T_c| (folded), rows normalised, for blocks shorter than
    the kernel, with padding and with the renormalised residual."""
    g_ = torch.Generator().manual_seed(8)
    b, n, h, N, P, K = 2, 9, 2, 3, 2, 4
    C, B = (torch.randn(b, n, h, N, dtype=torch.float64, generator=g_) for _ in range(2))
    dt = F.softplus(torch.randn(b, n, h, dtype=torch.float64, generator=g_))
    A, D = -torch.rand(h, dtype=torch.float64, generator=g_), torch.randn(h, dtype=torch.float64, generator=g_)
    gate = torch.rand(b, n, h * P, dtype=torch.float64, generator=g_)
    w = torch.randn(h * P, K, dtype=torch.float64, generator=g_)
    S = mixers.ssd_matrix(C, B, dt, A, D)[:, torch.arange(h * P) // P]  # (b, C, n, n)
    GT = gate.transpose(1, 2)[..., None] * mixers.conv_matrix(w, n)[0]  # (b, C, n, n): diag(g_c) · T_c
    total = (S.abs() @ GT.abs()).sum(1) if convolution == "apart" else (S @ GT).abs().sum(1)
    Fd = total / total.sum(-1, keepdim=True)
    r = torch.rand(b, 2, n, dtype=torch.float64, generator=g_)
    I = torch.eye(n, dtype=torch.float64)
    for rows in (2, 4, 16):
        lay = mixers.SSDRows(C, B, dt, A, D, gate, w, heads=3, rows=rows)
        lay.convolution = convolution
        assert lay.shape == (b, 3, n, n)
        torch.testing.assert_close(lay.apply_rows(r, a=0.5, c=0.5), r @ (0.5 * Fd + 0.5 * I), atol=1e-12, rtol=0)
        want = r @ ((0.3 * Fd + 0.2 * I) / 0.5)  # renorm: rows of a·F + c·I divided by a + c
        torch.testing.assert_close(lay.apply_rows(r, a=0.3, c=0.2, renorm=True), want, atol=1e-12, rtol=0)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, -3:] = False
    Fm = total * mask[:, None, :]
    Fm = Fm / Fm.sum(-1, keepdim=True)
    lay = mixers.SSDRows(C, B, dt, A, D, gate, w, rows=4)
    lay.convolution = convolution
    got = lay.apply_rows(r * mask[:, None], a=0.5, c=0.5, mask=mask)
    want = (r * mask[:, None]) @ (0.5 * Fm + 0.5 * I * mask[:, None, :])
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
