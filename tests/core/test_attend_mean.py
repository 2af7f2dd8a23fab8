"""``operators.attend_mean`` (the capture computing a fused layer's attention itself, for the model's output
and rollout's head mean at once) against a float64 eager softmax attention written here, over batch sizes
(odd ones included), sequence lengths, grouped KV heads, the causal / window rules and chunkings of the
batch (whole, uneven chunks, one example per chunk), on q, k, v laid out as transformers' kernels get them
((B, n, H, d) buffers seen as (B, H, n, d))."""

from __future__ import annotations

import pytest
import torch

from attnroll.core import operators as op


def eager_attention(q, k, v, scaling, causal=False, window=None):
    """(softmax(scaling·q·kᵀ) · v as (B, n, H, d_v), the probabilities (B, H, n, n)) in float64, each query
    head h reading key / value head h // (H / H_kv), masked entries −inf before the softmax."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = (q @ k.transpose(-1, -2)) * scaling
    allowed = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)
    if causal:  # key j <= query i: the lower triangle
        allowed = allowed.tril()
    if window is not None:  # j > i - window: the diagonals from -(window - 1) up
        allowed = allowed.triu(-(window - 1))
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return (p @ v).transpose(1, 2), p


def kernel_layout(B, n, heads, d, seed, scale=1.0):
    """(B, heads, n, d) float32 seen from a (B, n, heads, d) buffer, as the kernels receive q, k and v."""
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(B, n, heads, d, generator=g)).transpose(1, 2)


SHAPES = {  # B, n, H, H_kv, d, d_v
    "one_token": (3, 1, 2, 2, 4, 3),
    "odd_batch_grouped": (5, 7, 4, 2, 8, 5),
    "grouped_by_three": (3, 33, 6, 2, 8, 8),
    "shapes_vit_like": (4, 65, 4, 4, 16, 16),
}
RULES = {"none": {}, "causal": dict(causal=True), "causal_window": dict(causal=True, window=3),
         "window_only": dict(window=4)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("chunk", ["whole", "uneven", "per_example"])
def test_attend_mean_equals_float64_eager_attention(shape, rule, chunk, monkeypatch):
    """The output (contiguous (B, n, H, d_v) float32) and the head mean of the probabilities against the
    float64 eager attention; "uneven": chunks of two examples (an odd batch leaves one of one),
    "per_example": one example per chunk."""
    B, n, H, Hkv, d, dv = SHAPES[shape]
    if chunk == "uneven":
        monkeypatch.setattr(op, "CHUNK_ELEMENTS", 2 * H * n * n)
        assert len({b1 - b0 for b0, b1, _ in op._example_chunks(op.KernelInputs(
            q=torch.zeros(B, H, n, d), k=torch.zeros(B, Hkv, n, d), scaling=1.0))}) == (1 if B % 2 == 0 else 2)
    elif chunk == "per_example":
        monkeypatch.setattr(op, "CHUNK_ELEMENTS", 1)
    q, k, v = kernel_layout(B, n, H, d, 1, 1.5), kernel_layout(B, n, Hkv, d, 2, 1.5), kernel_layout(B, n, Hkv, dv, 3)
    lay = op.KernelInputs(q=q, k=k, scaling=d ** -0.5, **RULES[rule])
    assert op.fusable(lay)
    out, fused = op.attend_mean(lay, v)
    want, p = eager_attention(q, k, v, lay.scaling, **RULES[rule])
    assert out.shape == (B, n, H, dv) and out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)
    assert fused.probs.shape == (B, n, n) and fused.heads == H and fused.shape == (B, H, n, n)
    torch.testing.assert_close(fused.probs.double(), p.mean(dim=1), atol=1e-6, rtol=0)
    if "window" not in rule:  # torch's own kernel, the one attend_mean replaces in the capture
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=lay.scaling, enable_gqa=True,
                                                                is_causal=bool(RULES[rule]))
        torch.testing.assert_close(out, sdpa.transpose(1, 2), atol=1e-5, rtol=0)


def test_one_chunk_out_of_range_takes_the_shifted_route_alone(monkeypatch):
    """One example's logits in the hundreds (its exponentials overflow without the row max) in a batch of
    five chunked by two: that chunk is recomputed with the row max, the others are not, and every output and
    head-mean row still equals the float64 eager attention."""
    monkeypatch.setattr(op, "CHUNK_ELEMENTS", 2 * 4 * 9 * 9)
    q, k, v = kernel_layout(5, 9, 4, 8, 4), kernel_layout(5, 9, 2, 8, 5), kernel_layout(5, 9, 2, 6, 6)
    q = q.clone()
    q[2] *= 80.0
    lay = op.KernelInputs(q=q, k=k, scaling=8 ** -0.5, causal=True)
    assert float((q[2] @ k[2].repeat_interleave(2, dim=0).transpose(-1, -2)).abs().max()) * lay.scaling > 200
    calls = []
    logits2 = op._logits2
    monkeypatch.setattr(op, "_logits2", lambda *a: calls.append(a[0].shape[0]) or logits2(*a))
    out, fused = op.attend_mean(lay, v)
    assert calls == [2, 2, 2, 1]  # the second chunk (examples 2, 3) twice, the others once
    want, p = eager_attention(q, k, v, lay.scaling, causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.probs.double(), p.mean(dim=1), atol=1e-6, rtol=0)
