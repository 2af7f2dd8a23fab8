"""core.stages: merge maps and rollout along a stage chain, against hand-worked numbers and naive products."""

import pytest
import torch

import attnroll
from attnroll.core.stages import (carry_rows, chain_rollout, check_merges, compose_chain, merge_2x2, pull_back,
                                  stage_row)


def test_merge_2x2_hand_worked_even_and_odd_grids():
    # 2x4 grid -> 1x2: merged token 0 = tokens 0, 1, 4, 5; merged token 1 = tokens 2, 3, 6, 7.
    q = 0.25
    want = torch.tensor([[q, q, 0, 0, q, q, 0, 0], [0, 0, q, q, 0, 0, q, q]])
    assert torch.equal(merge_2x2(2, 4), want)
    # 3x3 -> 2x2: the odd border has fewer real sources (the merge pads zeros that carry no token).
    M = merge_2x2(3, 3)
    assert M.shape == (4, 9)
    assert torch.equal(M[0], torch.tensor([q, q, 0, q, q, 0, 0, 0, 0]))
    assert torch.equal(M[1], torch.tensor([0, 0, 0.5, 0, 0, 0.5, 0, 0, 0]))
    assert torch.equal(M[2], torch.tensor([0, 0, 0, 0, 0, 0, 0.5, 0.5, 0]))
    assert torch.equal(M[3], torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1.0]))


# A two-stage chain worked by hand: stage 1 is a 1x4 grid (one layer A), merged pairwise into a 1x2 grid
# (M: each merged token ½ + ½ of its two sources), stage 2 is one layer B.
A = torch.tensor([[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 1, 0], [0, 0.25, 0.25, 0.5]])
M = torch.tensor([[0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5]])
B = torch.tensor([[0.5, 0.5], [0, 1.0]])
# M·A: row 0 = ½(A0 + A1) = [3/4, 1/4, 0, 0]; row 1 = ½(A2 + A3) = [0, 1/8, 5/8, 1/4].
# B·M·A: row 0 = ½(row 0 + row 1) = [3/8, 3/16, 5/16, 1/8]; row 1 = [0, 1/8, 5/8, 1/4].
HAND = torch.tensor([[3 / 8, 3 / 16, 5 / 16, 1 / 8], [0, 1 / 8, 5 / 8, 1 / 4]])


def test_merge_map_of_a_1x4_grid_is_the_hand_worked_one():
    assert torch.equal(merge_2x2(1, 4), M)


def test_compose_chain_hand_worked_two_stages():
    R = compose_chain([A, B], {1: M})
    assert torch.allclose(R, HAND)
    assert torch.allclose(R.sum(-1), torch.ones(2))  # row-stochastic factors, row-stochastic product


def test_chain_rollout_without_residual_is_the_hand_worked_rows():
    # alpha=0: Ã = A, so the chain is exactly B·M·A; weights pick rows (one-hot, then the mean).
    kw = dict(head_fusion=None, alpha=0.0)
    row0 = chain_rollout([A[None], B[None]], {1: M}, torch.tensor([[1.0, 0.0]]), **kw)
    mean = chain_rollout([A[None], B[None]], {1: M}, torch.tensor([[0.5, 0.5]]), **kw)
    assert torch.allclose(row0[0], HAND[0])
    assert torch.allclose(mean[0], HAND.mean(0))


def test_chain_rollout_with_residual_matches_a_naive_product():
    # alpha=½ blends each layer with I: Ã = ½(A + I); the merge map is structure, untouched.
    At, Bt = 0.5 * (A + torch.eye(4)), 0.5 * (B + torch.eye(2))
    naive = Bt @ M @ At
    two = [A.expand(2, 4, 4), B.expand(2, 2, 2)]  # a batch of 2, one readout row each
    got = chain_rollout(two, {1: M}, torch.eye(2), head_fusion=None)
    assert torch.allclose(got, naive)


def test_chain_rollout_fuses_heads_and_validates_like_rollout():
    torch.manual_seed(0)
    a = torch.rand(2, 3, 4, 4).softmax(-1)
    b = torch.rand(2, 5, 2, 2).softmax(-1)  # another head count in the second stage
    got = chain_rollout([a, b], {1: M}, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    At = 0.5 * (a.mean(1) + torch.eye(4))
    Bt = 0.5 * (b.mean(1) + torch.eye(2))
    naive = Bt @ M @ At  # (2, 2, 4)
    assert torch.allclose(got[0], naive[0, 0], atol=1e-6) and torch.allclose(got[1], naive[1, 1], atol=1e-6)
    with pytest.raises(ValueError, match="sum to 1"):
        chain_rollout([a * 2, b], {1: M}, torch.ones(2, 2) / 2)


def test_composed_random_chains_are_row_stochastic():
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        layers = [torch.rand(16, 16, generator=g).softmax(-1), torch.rand(16, 16, generator=g).softmax(-1),
                  torch.rand(4, 4, generator=g).softmax(-1), torch.rand(1, 1, generator=g).softmax(-1)]
        R = compose_chain(layers, {2: merge_2x2(4, 4), 3: merge_2x2(2, 2)})
        assert R.shape == (1, 16)
        assert torch.allclose(R.sum(-1), torch.ones(1), atol=1e-6) and bool((R >= 0).all())


def test_one_stage_chain_equals_plain_rollout():
    torch.manual_seed(1)
    layers = [torch.rand(2, 2, 6, 6).softmax(-1) for _ in range(3)]
    w = torch.rand(2, 6)
    w = w / w.sum(-1, keepdim=True)
    plain = attnroll.rollout(layers)  # (2, 6, 6)
    got = chain_rollout(layers, {}, w)
    assert torch.allclose(got, torch.einsum("bi,bij->bj", w, plain), atol=1e-6)
    # and the layer range: layers outside [start, end) are the identity
    part = chain_rollout(layers, {}, w, start_layer=1)
    assert torch.allclose(part, torch.einsum("bi,bij->bj", w, attnroll.rollout(layers, start_layer=1)), atol=1e-6)


def test_merges_outside_the_layer_range_still_apply():
    v = carry_rows(torch.tensor([[[1.0, 0.0]]]), {1: M}, 2, lambda i, r: r @ (A if i == 0 else B), start=1, end=2)
    assert torch.allclose(v[0, 0], (torch.tensor([1.0, 0.0]) @ B) @ M)


def test_stage_row_and_pull_back_carry_rows_through_the_merges_only():
    w = torch.tensor([[1.0, 0.0]])
    # layer 1 (stage 2): w·B, then down through M to the input tokens
    assert torch.allclose(stage_row(w, B[None], {1: M}, 1, 2)[0], (w @ B @ M)[0])
    # layer 0 (stage 1): w carried down through M first, then ·A
    assert torch.allclose(stage_row(w, A[None], {1: M}, 0, 2)[0], (w @ M @ A)[0])
    assert torch.allclose(pull_back(w, {1: M}, 2, 0), w @ M)


def test_check_merges_names_what_is_wrong():
    with pytest.raises(ValueError, match="no merge map between them"):
        check_merges({}, [4, 2])
    with pytest.raises(ValueError, match=r"merges\[1\] must have shape \(2, 4\)"):
        check_merges({1: M.T}, [4, 2])
    with pytest.raises(ValueError, match="rows summing to 1"):
        check_merges({1: M * 2}, [4, 2])
    with pytest.raises(ValueError, match="layer index"):
        check_merges({0: M}, [4, 2])
    with pytest.raises(ValueError, match=r"weights must have shape \(1, 2\)"):
        chain_rollout([A[None], B[None]], {1: M}, torch.ones(1, 4), head_fusion=None)
    with pytest.raises(ValueError, match=r"weights must have shape \(1, 2\)"):
        chain_rollout([A[None], B[None]], {1: M}, torch.ones(2, 2), head_fusion=None)
