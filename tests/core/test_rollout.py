"""Rollout: a hand-worked example, properties on random input, and a naive reference on drawn options."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import attnroll
from attnroll import per_head_rollout, rollout

from . import reference as ref


def softmax_layers(L, B, H, n, seed=0, sharp=1.0, zeros=0.0, dtype=np.float64):
    """L random per-head attention layers (B, H, n, n), rows summing to 1; ``zeros`` = fraction of exact
    zeros (so that ties occur)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(L):
        x = np.exp(sharp * rng.normal(size=(B, H, n, n)))
        if zeros:
            x = x * (rng.random((B, H, n, n)) >= zeros)
            x[..., 0] += 1e-3  # keep every row non-empty
        out.append((x / x.sum(-1, keepdims=True)).astype(dtype))
    return out


# ----------------------------------------------------------------------------------------------- by hand
def test_hand_worked_three_tokens_two_layers():
    A1 = np.array([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    A2 = np.array([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    # Ã1 = [[.75,.25,0],[0,1,0],[0,0,1]], Ã2 = [[.5,0,.5],[0,1,0],[.25,0,.75]]; R = Ã2·Ã1 (newest left).
    expected = np.array([[0.375, 0.125, 0.5], [0.0, 1.0, 0.0], [0.1875, 0.0625, 0.75]])
    R = rollout([A1, A2], head_fusion=None)
    np.testing.assert_allclose(R, expected, atol=1e-12)
    assert isinstance(R, np.ndarray) and R.dtype == np.float64
    # The wrong multiplication order (oldest left) gives a different first row: [.375, .25, .375].
    assert not np.allclose(R[0], [0.375, 0.25, 0.375])
    np.testing.assert_allclose(rollout([A1, A2], head_fusion=None, rows=[2]), expected[[2]], atol=1e-12)


def test_hand_worked_heads_and_renorm():
    # Two heads fused by max: rows sum to more than 1, so blend and renorm differ.
    A = np.array([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]])  # (H=2, 2, 2)
    # max fusion -> [[1, 1], [.5, .5]]; blend: .5*[[1,1],[.5,.5]] + .5*I = [[1, .5], [.25, .75]]
    np.testing.assert_allclose(rollout([A], head_fusion="max"), [[1.0, 0.5], [0.25, 0.75]])
    # renorm divides each row by its sum: [[2/3, 1/3], [.25, .75]]
    np.testing.assert_allclose(rollout([A], head_fusion="max", residual_mode="renorm"), [[2 / 3, 1 / 3], [0.25, 0.75]])
    # add: A + I = [[2, 1], [.5, 1.5]]
    np.testing.assert_allclose(rollout([A], head_fusion="max", residual_mode="add", check_stochastic=False), [[2.0, 1.0], [0.5, 1.5]])


# ----------------------------------------------------------------------------------------------- properties
@pytest.mark.parametrize("mode", ["blend", "renorm"])
@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_rows_sum_to_one(mode, fusion):
    layers = softmax_layers(4, 2, 3, 7, seed=1)
    R = rollout(layers, residual_mode=mode, head_fusion=fusion, dtype="float64")
    if mode == "renorm" or fusion == "mean":
        np.testing.assert_allclose(R.sum(-1), 1.0, atol=1e-10)
    else:  # blend after max/min fusion is not stochastic: the property is specific to the modes above
        assert np.abs(R.sum(-1) - 1).max() > 1e-3


def test_identity_attention_gives_identity():
    eye = np.broadcast_to(np.eye(6), (2, 3, 6, 6)).copy()
    for mode in ("blend", "renorm"):
        np.testing.assert_allclose(rollout([eye] * 5, residual_mode=mode), np.broadcast_to(np.eye(6), (2, 6, 6)))


def test_alpha_one_gives_identity_and_alpha_zero_one_layer_gives_attention():
    layers = softmax_layers(3, 2, 4, 5, seed=2)
    np.testing.assert_allclose(rollout(layers, alpha=1.0), np.broadcast_to(np.eye(5), (2, 5, 5)), atol=1e-12)
    np.testing.assert_allclose(rollout(layers[:1], alpha=0.0), layers[0].mean(1), atol=1e-12)


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"head_fusion": "max", "residual_mode": "renorm"},
        {"head_fusion": [1.0, 0.0, 2.0, 1.0]},
        {"discard_ratio": 0.5, "discard_scope": "row"},
        {"top_k": 3, "residual_mode": "add"},
        {"threshold": 0.1, "start_layer": 1, "end_layer": -1},
    ],
)
def test_rows_path_equals_rows_of_full_product(opts):
    layers = [torch.as_tensor(a, dtype=torch.float32) for a in softmax_layers(5, 3, 4, 9, seed=3)]
    full = rollout(layers, **opts)
    rows = [0, 4, -1, 4]
    fast = rollout(layers, rows=rows, **opts)
    assert fast.shape == (3, 4, 9)
    torch.testing.assert_close(fast, full[:, [0, 4, 8, 4]], atol=1e-6, rtol=0)


def test_batched_equals_per_example_and_numpy_equals_torch():
    layers = softmax_layers(4, 3, 2, 6, seed=4, dtype=np.float32)
    opts = dict(head_fusion="max", discard_ratio=0.4, residual_mode="renorm")
    batched = rollout(layers, **opts)
    assert isinstance(batched, np.ndarray) and batched.dtype == np.float32
    for b in range(3):
        single = rollout([a[b] for a in layers], **opts)
        assert single.shape == (6, 6)
        np.testing.assert_allclose(batched[b], single, atol=1e-6)
    as_torch = rollout([torch.from_numpy(a) for a in layers], **opts)
    assert isinstance(as_torch, torch.Tensor) and as_torch.dtype == torch.float32
    np.testing.assert_allclose(as_torch.numpy(), batched, atol=1e-7)
    stacked = rollout(np.stack(layers), **opts)
    np.testing.assert_array_equal(stacked, batched)


def test_permuting_tokens_permutes_result():
    layers = softmax_layers(3, 2, 3, 7, seed=5)
    perm = np.random.default_rng(0).permutation(7)
    P = np.eye(7)[perm]
    permuted = [P @ a @ P.T for a in layers]
    for opts in ({}, {"head_fusion": "max", "residual_mode": "renorm"}, {"top_k": 7}):
        R = rollout(layers, protect_prefix=0, **opts)
        Rp = rollout(permuted, protect_prefix=0, **opts)
        np.testing.assert_allclose(Rp, P @ R @ P.T, atol=1e-12)


def test_return_layers_partials():
    layers = softmax_layers(5, 2, 3, 6, seed=6)
    parts = rollout(layers, return_layers=True, start_layer=1)
    assert parts.shape == (4, 2, 6, 6)
    np.testing.assert_allclose(parts[-1], rollout(layers, start_layer=1), atol=1e-12)
    for k in range(4):
        np.testing.assert_allclose(parts[k], rollout(layers, start_layer=1, end_layer=2 + k), atol=1e-12)
    rows = rollout(layers, return_layers=True, start_layer=1, rows=[0, 3])
    np.testing.assert_allclose(rows, parts[:, :, [0, 3]], atol=1e-12)
    unbatched = rollout([a[1] for a in layers], return_layers=True, rows=[2])
    assert unbatched.shape == (5, 1, 6)


def test_blend_equals_renorm_under_mean_and_differs_under_max():
    layers = softmax_layers(4, 2, 4, 8, seed=7)
    np.testing.assert_allclose(rollout(layers), rollout(layers, residual_mode="renorm"), atol=1e-12)
    assert np.abs(rollout(layers, head_fusion="max") - rollout(layers, head_fusion="max", residual_mode="renorm")).max() > 1e-3


def test_top_k_n_equals_no_sparsification_and_sparsification_changes_result():
    layers = softmax_layers(3, 2, 3, 6, seed=8)
    np.testing.assert_allclose(rollout(layers, top_k=6), rollout(layers), atol=1e-12)
    assert np.abs(rollout(layers, top_k=2) - rollout(layers)).max() > 1e-3


def test_padded_batch_equals_cropped_sequences():
    rng = np.random.default_rng(9)
    n, lengths, L, H = 8, [8, 5, 3], 4, 2
    B = len(lengths)
    layers = [np.zeros((B, H, n, n)) for _ in range(L)]
    mask = np.zeros((B, n), dtype=np.int64)
    for b, m in enumerate(lengths):
        mask[b, :m] = 1
        for layer in layers:
            x = np.exp(rng.normal(size=(H, m, m)))
            layer[b, :, :m, :m] = x / x.sum(-1, keepdims=True)
            layer[b, :, m:, :] = 1.0 / n  # padded queries attend uniformly: must be ignored
    for opts in ({}, {"head_fusion": "max", "residual_mode": "renorm"}, {"discard_ratio": 0.3}, {"top_k": 2, "protect_prefix": 0}):
        R = rollout(layers, attention_mask=mask, **opts)
        rows = rollout(layers, attention_mask=mask, rows=[0, 2], **opts)
        for b, m in enumerate(lengths):
            cropped = rollout([a[b, :, :m, :m] for a in layers], **opts)
            np.testing.assert_allclose(R[b, :m, :m], cropped, atol=1e-12)
            assert np.all(R[b, m:, :] == 0) and np.all(R[b, :, m:] == 0)
            for r_i, r in enumerate([0, 2]):
                np.testing.assert_allclose(rows[b, r_i], R[b, r], atol=1e-12)


def test_float64_on_request_and_float32_default():
    layers = [torch.as_tensor(a, dtype=torch.float32) for a in softmax_layers(2, 1, 2, 4)]
    assert rollout(layers).dtype == torch.float32
    assert rollout(layers, dtype="float64").dtype == torch.float64
    assert rollout([a.half() for a in layers]).dtype == torch.float32
    assert rollout(softmax_layers(2, 1, 2, 4, dtype=np.float64)).dtype == np.float64
    assert rollout(softmax_layers(2, 1, 2, 4, dtype=np.float64), dtype=np.float32).dtype == np.float32


def test_check_stochastic_false_accepts_nonnegative_matrices():
    rng = np.random.default_rng(10)
    mats = [rng.random((4, 4)) * 3 for _ in range(3)]
    with pytest.raises(ValueError, match="check_stochastic=False"):
        rollout(mats, head_fusion=None)
    R = rollout(mats, head_fusion=None, check_stochastic=False, residual_mode="add")
    expected = np.eye(4)
    for m in mats:
        expected = (m + np.eye(4)) @ expected
    np.testing.assert_allclose(R, expected, rtol=1e-10)


# ----------------------------------------------------------------------------------------------- per head
def test_per_head_rollout_matches_a_loop_over_heads():
    layers = softmax_layers(4, 2, 3, 6, seed=11)
    opts = dict(discard_ratio=0.3, residual_mode="renorm", start_layer=1)
    R = per_head_rollout(layers, **opts)
    assert R.shape == (2, 3, 6, 6)
    for b in range(2):
        for h in range(3):
            expected = rollout([a[b, h] for a in layers], head_fusion=None, **opts)
            np.testing.assert_allclose(R[b, h], expected, atol=1e-12)
    np.testing.assert_allclose(per_head_rollout(layers, rows=[5, 0], **opts), R[:, :, [5, 0]], atol=1e-12)
    assert per_head_rollout([a[0] for a in layers]).shape == (3, 6, 6)
    # One head: per-head rollout equals plain rollout.
    one = [a[:, :1] for a in layers]
    np.testing.assert_allclose(per_head_rollout(one)[:, 0], rollout(one), atol=1e-12)


def test_per_head_rollout_padding():
    layers = softmax_layers(3, 1, 2, 5, seed=12)
    for a in layers:
        a[..., 3:] = 0
        a /= a.sum(-1, keepdims=True)
    mask = np.array([[1, 1, 1, 0, 0]])
    R = per_head_rollout(layers, attention_mask=mask)
    cropped = per_head_rollout([a[:, :, :3, :3] for a in layers])
    np.testing.assert_allclose(R[:, :, :3, :3], cropped, atol=1e-12)
    assert np.all(R[:, :, 3:] == 0) and np.all(R[:, :, :, 3:] == 0)


# ----------------------------------------------------------------------------------------------- reference
@st.composite
def cases(draw):
    L, B, H, n = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**16))
    zeros = draw(st.sampled_from([0.0, 0.5]))
    fusion = draw(st.sampled_from(["mean", "max", "min", "weights"]))
    if fusion == "weights":
        fusion = draw(st.lists(st.floats(0.0, 3.0), min_size=H, max_size=H).filter(lambda w: sum(w) > 0.1))
    mode = draw(st.sampled_from(["blend", "renorm", "add"]))
    alpha = draw(st.floats(0.0, 0.95 if mode == "add" else 1.0))
    opts = dict(head_fusion=fusion, alpha=alpha, residual_mode=mode)
    if draw(st.booleans()):
        opts["discard_ratio"] = draw(st.floats(0.0, 0.95))
        opts["discard_scope"] = draw(st.sampled_from(["layer", "row"]))
    if draw(st.booleans()):
        opts["top_k"] = draw(st.integers(1, n))
    if draw(st.booleans()):
        opts["threshold"] = draw(st.floats(0.0, 0.4))
    opts["protect_prefix"] = draw(st.integers(0, n))
    opts["start_layer"] = draw(st.integers(0, L - 1))
    if draw(st.booleans()):
        opts["end_layer"] = draw(st.integers(opts["start_layer"] + 1, L))
    mask = None
    if draw(st.booleans()):
        mask = np.array([[1] * (m := draw(st.integers(1, n))) + [0] * (n - m) for _ in range(B)])
        if B > 1:
            mask[1] = np.roll(mask[1], draw(st.integers(0, n - 1)))  # padding anywhere, not only at the end
    rows = draw(st.one_of(st.none(), st.lists(st.integers(-n, n - 1), min_size=1, max_size=3)))
    return L, B, H, n, seed, zeros, opts, mask, rows


@given(cases())
def test_matches_naive_reference(case):
    L, B, H, n, seed, zeros, opts, mask, rows = case
    layers = softmax_layers(L, B, H, n, seed=seed, zeros=zeros)
    got = rollout(layers, attention_mask=mask, rows=rows, **opts)
    got_parts = rollout(layers, attention_mask=mask, return_layers=True, **opts)
    for b in range(B):
        valid = np.ones(n, bool) if mask is None else mask[b].astype(bool)
        expected = ref.rollout_one([a[b] for a in layers], valid, opts)
        if rows is not None:
            expected = expected[[r % n for r in rows]]
        np.testing.assert_allclose(got[b], expected, atol=1e-9, rtol=1e-9)
        for k, part in enumerate(ref.rollout_partials_one([a[b] for a in layers], valid, opts)):
            np.testing.assert_allclose(got_parts[k, b], part, atol=1e-9, rtol=1e-9)


def test_public_names():
    for name in ("rollout", "per_head_rollout", "fuse_heads", "add_residual", "sparsify"):
        assert callable(getattr(attnroll, name))


@pytest.mark.parametrize("block", [1 << 20, 2 * 6 * 6, 2 * 6 * 4, 1])
def test_streamed_rows_path_in_blocks_equals_full_product(monkeypatch, block):
    """The rows fast path walks each layer in blocks (groups of heads, or row ranges of one head); every
    block size must give the rows of the full product and still see every entry for the value checks."""
    from attnroll.core import rollout as mod

    monkeypatch.setattr(mod, "BLOCK_ELEMENTS", block)
    layers = softmax_layers(4, 2, 5, 6, seed=13)
    full = rollout(layers)
    for opts in ({}, {"head_fusion": [0.5, 1.0, 0.0, 2.0, 1.0]}):
        np.testing.assert_allclose(rollout(layers, rows=[0, 5], **opts), rollout(layers, **opts)[:, [0, 5]], atol=1e-12)
    np.testing.assert_allclose(rollout(layers, rows=[3]), full[:, [3]], atol=1e-12)
    fused = [a.max(1) / a.max(1).sum(-1, keepdims=True) for a in layers]  # already-fused input streams too
    np.testing.assert_allclose(
        rollout(fused, head_fusion=None, rows=[1, 4]), rollout(fused, head_fusion=None)[:, [1, 4]], atol=1e-12
    )
    with pytest.raises(ValueError, match=r"attentions\[1\] contains negative"):
        rollout([fused[0], fused[1] - 0.2], head_fusion=None, rows=[0])
    bad = [a.copy() for a in layers]
    bad[2][1, 4, 5, 3] = np.nan  # last head, last row, second example: the last block to be read
    with pytest.raises(ValueError, match=r"attentions\[2\] contains NaN"):
        rollout(bad, rows=[0])
    bad[2][1, 4, 5, 3] = -0.5
    with pytest.raises(ValueError, match=r"attentions\[2\] contains negative entries"):
        rollout(bad, rows=[0])
    bad[2][1, 4, 5, 3] = 0.9
    with pytest.raises(ValueError, match=r"attentions\[2\]: rows must sum to 1"):
        rollout(bad, rows=[0])
    assert rollout(bad, rows=[0], check_stochastic=False).shape == (2, 1, 6)


def test_validate_false_skips_value_checks_only():
    layers = softmax_layers(3, 2, 3, 5, seed=14)
    for rows in (None, [0]):
        np.testing.assert_array_equal(rollout(layers, rows=rows, validate=False), rollout(layers, rows=rows))
    bad = [a * 1.5 for a in layers]
    with pytest.raises(ValueError, match="rows must sum to 1"):
        rollout(bad, rows=[0])
    # Trusted-input mode: no value check, the arithmetic runs as written (1.5x per layer, 3 layers).
    got = rollout(bad, rows=[0], validate=False, alpha=0.0)
    np.testing.assert_allclose(got.sum(-1), 1.5**3, rtol=1e-12)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, n\]"):  # options are still checked
        rollout(layers, validate=False, top_k=9)
