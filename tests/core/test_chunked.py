"""Chunked layers (attnroll.core.chunked) against dense block-diagonal products written here."""

from __future__ import annotations

import pytest
import torch

from attnroll.core.chunked import Chunk, ChunkedLayer, apply_chunked, chunked_probs, chunked_rows, split_call, spread
from attnroll.core.operators import KernelInputs, fused_probs


def layer(sizes, H=3, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    chunks, at = [], 0
    for m in sizes:
        q, k = torch.randn(1, H, m, d, generator=g) * 2, torch.randn(1, H, m, d, generator=g) * 2
        chunks.append(Chunk(at, at + m, KernelInputs(q=q, k=k, scaling=d ** -0.5)))
        at += m
    return ChunkedLayer(at, chunks)


def dense(lay):
    """(n, n) head-mean block-diagonal softmax, written out chunk by chunk."""
    P = torch.zeros(lay.n, lay.n, dtype=torch.float64)
    for c in lay.chunks:
        q, k = c.layer.q[0].double(), c.layer.k[0].double()
        P[c.start:c.stop, c.start:c.stop] = torch.softmax(q @ k.transpose(-1, -2) * c.layer.scaling, -1).mean(0)
    return P


def test_rows_through_chunked_layers_equal_the_dense_block_diagonal_product():
    layers = [layer([5, 7, 4], seed=s) for s in range(3)]
    r = torch.rand(1, 2, 16)
    want = r[0].double()
    for lay in reversed(layers):
        want = want @ (0.5 * dense(lay) + 0.5 * torch.eye(16, dtype=torch.float64))
    got = chunked_rows(layers, r, fused_probs("mean"), a=0.5, c=0.5)
    assert torch.allclose(got[0].double(), want, atol=1e-6)
    assert torch.allclose(chunked_probs(layers[0]).mean(0).double(), dense(layers[0]), atol=1e-6)


def test_injected_rows_enter_at_their_layer():
    layers = [layer([6, 6], seed=s) for s in range(3)]
    top, mid = torch.rand(1, 1, 12), torch.rand(1, 1, 12)
    A = [0.5 * dense(lay) + 0.5 * torch.eye(12, dtype=torch.float64) for lay in layers]
    want = top[0].double() @ A[2] @ A[1] @ A[0] + mid[0].double() @ A[1] @ A[0]
    got = chunked_rows(layers, top, fused_probs("mean"), a=0.5, c=0.5, inject={1: mid})
    assert torch.allclose(got[0].double(), want, atol=1e-6)


def test_a_varlen_call_is_cut_into_its_chunks():
    whole = layer([10], seed=1).chunks[0].layer
    parts = split_call(whole, [0, 4, 10], offset=3)
    assert [(c.start, c.stop) for c in parts] == [(3, 7), (7, 13)]
    assert torch.equal(parts[1].layer.q, whole.q[:, :, 4:10])


def test_spread_gives_each_source_its_share():
    out = spread(torch.tensor([[1.0, 2.0]]), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), 9)
    assert out.tolist() == [[0.25] * 4 + [0.5] * 4 + [0.0]]
    with pytest.raises(ValueError, match="summing to 1"):
        spread(torch.ones(1, 1), torch.tensor([[0, 1]]), 2, torch.tensor([0.5, 0.6]))


def test_bad_chunks_and_rows_are_refused():
    lay = layer([3, 3])
    with pytest.raises(ValueError, match="cover"):
        ChunkedLayer(7, lay.chunks)
    with pytest.raises(ValueError, match="in order"):
        ChunkedLayer(6, lay.chunks[::-1])
    with pytest.raises(ValueError, match=r"\(1, R, 6\)"):
        apply_chunked(torch.ones(1, 5), lay, fused_probs("mean"), a=0.5, c=0.5)
