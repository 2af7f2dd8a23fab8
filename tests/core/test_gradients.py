"""core.gradients and core.encdec: the gradient weighting, Chefer's update and the encoder-decoder
compositions against naive numpy references written here, hand-worked cases and properties; no model."""

import numpy as np
import pytest
import torch

import attnroll
from attnroll.core.encdec import encdec_gae_compose, encdec_rollout_compose, handle_residual
from attnroll.core.gradients import gae_update, gradient_weighted


def _stochastic(rng, *shape):
    x = rng.random(shape)
    return x / x.sum(-1, keepdims=True)


def test_gradient_weighted_matches_a_loop_over_heads():
    rng = np.random.default_rng(0)
    A = [_stochastic(rng, 2, 3, 4, 4) for _ in range(2)]
    G = [rng.normal(size=(2, 3, 4, 4)) for _ in range(2)]
    per_head = gradient_weighted(A, G, dtype=None)
    after = gradient_weighted(A, G, "after_mean", dtype=None)
    for a, g, w1, w2 in zip(A, G, per_head, after):
        want1 = sum(np.maximum(g[:, h] * a[:, h], 0) for h in range(3)) / 3
        want2 = np.maximum(sum(g[:, h] * a[:, h] for h in range(3)) / 3, 0)
        assert isinstance(w1, np.ndarray) and np.allclose(w1, want1) and np.allclose(w2, want2)
    t = gradient_weighted([torch.from_numpy(a) for a in A], [torch.from_numpy(g) for g in G])
    assert t[0].dtype == torch.float32 and torch.allclose(t[0], torch.from_numpy(per_head[0]).float())
    with pytest.raises(ValueError, match="clamp must be one of"):
        gradient_weighted(A, G, "never")
    with pytest.raises(ValueError, match="same shape"):
        gradient_weighted(A, [g[:, :2] for g in G])


def test_gae_update_from_identity_is_the_product_and_rollout_add():
    rng = np.random.default_rng(1)
    W = [np.abs(rng.normal(size=(2, 5, 5))) for _ in range(3)]
    R = np.broadcast_to(np.eye(5), (2, 5, 5)).copy()
    for w in W:
        R = gae_update(R, w)
    want = np.broadcast_to(np.eye(5), (2, 5, 5))
    for w in W:  # (I + W_L)···(I + W_1), built left-multiplying, example by example
        want = np.stack([(np.eye(5) + w[b]) @ want[b] for b in range(2)])
    assert np.allclose(R, want)
    ref = attnroll.rollout(W, head_fusion=None, residual_mode="add", alpha=0.5, check_stochastic=False)
    assert np.allclose(R, ref)
    with pytest.raises(ValueError, match="A must be"):
        gae_update(R, np.ones((2, 4, 4)))


def test_handle_residual_rows():
    R = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[3.0, 1.0], [2.0, 2.0]]])
    out = handle_residual(R)
    assert torch.allclose(out[0], torch.eye(2))  # no excess over I: stays I
    # row 0 of example 1: R - I = [2, 1] -> [2/3, 1/3]; row 1: [2, 1] -> [2/3, 1/3]; + I
    assert torch.allclose(out[1], torch.tensor([[1 + 2 / 3, 1 / 3], [2 / 3, 1 + 1 / 3]]))


def test_encdec_rollout_one_layer_by_hand_and_conserves_mass():
    rng = np.random.default_rng(2)
    t = lambda x: torch.from_numpy(x)  # noqa: E731
    Ree, Ad, Ac = _stochastic(rng, 1, 3, 3), _stochastic(rng, 1, 2, 2), _stochastic(rng, 1, 2, 3)
    a = 0.3
    R_dd, R_de = encdec_rollout_compose(t(Ree), [t(Ad)], [t(Ac)], a)
    assert np.allclose(R_dd.numpy()[0], a * ((1 - a) * Ad[0] + a * np.eye(2)))
    assert np.allclose(R_de.numpy()[0], (1 - a) * Ac[0] @ Ree[0])
    dec = [t(_stochastic(rng, 2, 4, 4)) for _ in range(3)]
    cross = [t(_stochastic(rng, 2, 4, 5)) for _ in range(3)]
    R_dd, R_de = encdec_rollout_compose(t(_stochastic(rng, 2, 5, 5)), dec, cross, 0.5)
    assert torch.allclose(R_dd.sum(-1) + R_de.sum(-1), torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="one matrix per decoder layer"):
        encdec_rollout_compose(t(Ree), [t(Ad)], [], a)


def _bar(R):
    S = R - np.eye(R.shape[-1])
    s = S.sum(-1, keepdims=True)
    return np.where(s > 0, S / np.where(s > 0, s, 1), 0) + np.eye(R.shape[-1])


@pytest.mark.parametrize("transpose", [True, False])
def test_encdec_gae_matches_the_rules_written_out(transpose):
    rng = np.random.default_rng(3)
    E = [np.abs(rng.normal(size=(2, 5, 5))) * 0.3 for _ in range(2)]
    D = [np.abs(rng.normal(size=(2, 4, 4))) * 0.3 for _ in range(2)]
    C = [np.abs(rng.normal(size=(2, 4, 5))) * 0.3 for _ in range(2)]
    R_dd, R_de = encdec_gae_compose(*[[torch.from_numpy(x) for x in s] for s in (E, D, C)], transpose=transpose)
    for b in range(2):
        ree = np.eye(5)
        for e in E:
            ree = ree + e[b] @ ree  # rule 6
        rdd, rde = np.eye(4), np.zeros((4, 5))
        for d, c in zip(D, C):
            rdd, rde = rdd + d[b] @ rdd, rde + d[b] @ rde  # rules 6, 7
            bar = _bar(rdd)
            rde = rde + (bar.T if transpose else bar) @ c[b] @ _bar(ree)  # rule 10
        assert np.allclose(R_dd[b].numpy(), rdd) and np.allclose(R_de[b].numpy(), rde)
