"""fuse_heads, add_residual and sparsify on their own, against hand-worked values and loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnroll import add_residual, fuse_heads, sparsify

from . import reference as ref


def test_fuse_heads_by_hand():
    A = np.array([[[0.2, 0.8], [1.0, 0.0]], [[0.6, 0.4], [0.0, 1.0]]])  # (H=2, 2, 2)
    np.testing.assert_allclose(fuse_heads(A), [[0.4, 0.6], [0.5, 0.5]])
    np.testing.assert_allclose(fuse_heads(A, "max"), [[0.6, 0.8], [1.0, 1.0]])
    np.testing.assert_allclose(fuse_heads(A, "min"), [[0.2, 0.4], [0.0, 0.0]])
    # Weights are normalised to sum 1: [1, 3] -> [.25, .75].
    np.testing.assert_allclose(fuse_heads(A, [1, 3]), [[0.5, 0.5], [0.25, 0.75]])
    t = fuse_heads(torch.as_tensor(A, dtype=torch.float32), torch.tensor([1.0, 3.0]))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    np.testing.assert_allclose(t.numpy(), [[0.5, 0.5], [0.25, 0.75]], atol=1e-7)


def test_fuse_heads_keeps_leading_axes():
    A = np.random.default_rng(0).random((3, 2, 4, 5, 5))
    np.testing.assert_allclose(fuse_heads(A, "max"), A.max(axis=-3))


def test_add_residual_modes_by_hand():
    A = np.array([[1.0, 1.0], [0.0, 0.5]])  # not stochastic on purpose
    np.testing.assert_allclose(add_residual(A), [[1.0, 0.5], [0.0, 0.75]])
    np.testing.assert_allclose(add_residual(A, alpha=0.2), [[1.0, 0.8], [0.0, 0.6]])
    np.testing.assert_allclose(add_residual(A, mode="renorm"), [[2 / 3, 1 / 3], [0.0, 1.0]])
    np.testing.assert_allclose(add_residual(A, mode="add"), [[2.0, 1.0], [0.0, 1.5]])
    np.testing.assert_allclose(add_residual(A, alpha=0.25, mode="add"), [[1 + 1 / 3, 1.0], [0.0, 0.5 + 1 / 3]])


def test_renorm_equals_blend_on_stochastic_input():
    x = np.random.default_rng(1).random((3, 6, 6))
    x /= x.sum(-1, keepdims=True)
    for alpha in (0.0, 0.3, 0.5, 1.0):
        np.testing.assert_allclose(add_residual(x, alpha, "renorm"), add_residual(x, alpha, "blend"), atol=1e-12)


@pytest.mark.parametrize(
    "opts",
    [
        dict(discard_ratio=0.5),
        dict(discard_ratio=0.7, discard_scope="row", protect_prefix=2),
        dict(top_k=2),
        dict(top_k=1, protect_prefix=0),
        dict(threshold=0.2),
        dict(discard_ratio=0.3, top_k=3, threshold=0.05),
    ],
)
def test_sparsify_matches_reference_loop(opts):
    rng = np.random.default_rng(2)
    x = rng.random((2, 6, 6)) * (rng.random((2, 6, 6)) > 0.3)  # exact zeros: ties are broken as documented
    x[..., 0] += 0.01
    x /= x.sum(-1, keepdims=True)
    got = sparsify(x, **opts)
    for b in range(2):
        full = dict(discard_ratio=0.0, discard_scope="layer", top_k=None, threshold=None, protect_prefix=1) | opts
        np.testing.assert_allclose(got[b], ref.sparsify(x[b], np.ones(6, bool), **full), atol=1e-12)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-12)  # rows keep their sum


def test_discard_is_per_example_and_protects_prefix():
    # vit-explain discarded in batch item 0 only and protected only entry (0, 0).
    x = np.random.default_rng(3).random((2, 5, 5))
    x /= x.sum(-1, keepdims=True)
    out = sparsify(x, discard_ratio=0.5)
    for b in range(2):
        assert np.all(out[b, 0] > 0) and np.all(out[b, :, 0] > 0)  # CLS row and column untouched
        assert (out[b, 1:, 1:] == 0).sum() == int(np.floor(16 * 0.5))


def test_sparsify_count_floor_and_zero_ratio_is_identity():
    x = np.full((1, 4, 4), 0.25)
    np.testing.assert_array_equal(sparsify(x, discard_ratio=0.0), x)
    out = sparsify(x, discard_ratio=0.5, discard_scope="row", protect_prefix=0)
    assert ((out == 0).sum(-1) == 2).all()
    # Ties broken by position: the earlier entries of each row go first.
    np.testing.assert_array_equal(out[0] == 0, np.array([[1, 1, 0, 0]] * 4, bool))
