"""Localisation metrics against hand-worked cases, brute-force enumeration and Monte-Carlo chance levels."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from attnroll.evaluate.localisation import (
    LocalisationResult,
    chance_iou,
    localisation,
    mask_mass,
    pointing_game,
    topk_iou,
)
from attnroll.explain.explanation import Explanation


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def m(rows):
    return torch.tensor(rows, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------- pointing game
def test_pointing_hand_worked_2x2():
    s = t([[0.1, 0.9, 0.3, 0.2], [0.1, 0.9, 0.3, 0.2]])
    masks = m([[0, 1, 0, 0], [1, 0, 1, 1]])
    np.testing.assert_array_equal(pointing_game(s, masks), [True, False])
    # (B, h, w) grids give the same answer as (B, units)
    np.testing.assert_array_equal(pointing_game(s.reshape(2, 2, 2), masks.reshape(2, 2, 2)), [True, False])


def test_pointing_3x3_grid_and_negative_scores():
    s = np.full((1, 3, 3), -5.0)
    s[0, 1, 2] = -0.5  # unit 5 is the (negative) maximum
    mask = np.zeros((1, 3, 3), bool)
    mask[0, 1, 2] = True
    assert pointing_game(s, mask).tolist() == [True]
    mask2 = np.zeros((1, 3, 3), bool)
    mask2[0, 0, 0] = True
    assert pointing_game(s, mask2).tolist() == [False]


def test_pointing_ties_need_every_tied_maximum_inside():
    s = t([[1, 1, 0, 0]] * 2 + [[0.5] * 4] * 2)
    masks = m([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    # tie inside -> hit; tie half outside -> miss; constant map misses unless the mask covers everything
    np.testing.assert_array_equal(pointing_game(s, masks), [True, False, False, True])


# ----------------------------------------------------------------------------------------------- mass
def test_mass_hand_worked_with_negatives_and_nan_row():
    s = t([[0.5, -1.0, 0.25, 0.25], [-1, -2, 0, -3], [2, 2, 2, 2]])
    masks = m([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]])
    out = mask_mass(s, masks)
    assert out[0] == pytest.approx(0.5)  # positive part [0.5, 0, .25, .25]: 0.5 of 1.0 inside
    assert np.isnan(out[1])  # no positive relevance at all
    assert out[2] == pytest.approx(0.25)


def test_mass_3x3():
    s = np.arange(9, dtype=np.float64).reshape(1, 3, 3) - 4  # positive part: 1, 2, 3, 4 at units 5..8
    mask = np.zeros((1, 3, 3), bool)
    mask[0, 2, :] = True  # units 6, 7, 8 -> 2 + 3 + 4 of 10
    assert mask_mass(s, mask)[0] == pytest.approx(0.9)


def test_means_skip_nan_rows():
    s = t([[1, 0, 0, 0], [-1, -1, -1, -1]])
    masks = m([[1, 0, 0, 0], [1, 0, 0, 0]])
    r = localisation(s, masks)
    assert np.isnan(r.mass[1])
    assert r.means()["mass"] == pytest.approx(1.0)
    only_nan = localisation(s[1:], masks[1:])
    assert np.isnan(only_nan.means()["mass"])
    d = only_nan.as_dict()
    assert d["means"]["mass"] is None
    json.dumps(d, allow_nan=False)


# ----------------------------------------------------------------------------------------------- top-k IoU
def test_iou_hand_worked():
    s = t([[0.9, 0.8, 0.1, 0.7]])
    mask = m([[1, 0, 0, 1]])
    assert topk_iou(s, mask)[0] == pytest.approx(1 / 3)  # k = m = 2: top {0, 1}, I = 1, union 3
    assert topk_iou(s, mask, k=1)[0] == pytest.approx(1 / 2)  # {0}: I = 1, union 2
    assert topk_iou(s, mask, k=3)[0] == pytest.approx(2 / 3)  # {0, 1, 3}: I = 2, union 3
    assert topk_iou(s, mask, k=4)[0] == pytest.approx(2 / 4)


def test_iou_ties_by_position():
    s = t([[0, 0, 0, 0], [0, 0, 0, 0], [1, 2, 2, 0]])
    masks = m([[0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 0, 1]])
    # constant rows take the first units; [1, 2, 2, 0] with k = 2 takes units 1 and 2 (tie: earlier first)
    np.testing.assert_allclose(topk_iou(s, masks), [0.0, 1.0, 1 / 3])
    np.testing.assert_allclose(topk_iou(s, masks, k=1), [0.0, 1 / 2, 1 / 2])  # {0} vs {0, 1}: 1 of 2


def test_iou_3x3_per_example_k_equals_mask_size():
    s = np.array([[9, 8, 7, 6, 5, 4, 3, 2, 1]], dtype=float).reshape(1, 3, 3)
    mask = np.zeros((1, 3, 3), bool)
    mask[0, 0, 1] = mask[0, 2, 2] = mask[0, 1, 0] = True  # units 1, 3, 8; top-3 = {0, 1, 2}: I = 1
    assert topk_iou(s, mask)[0] == pytest.approx(1 / 5)


# ----------------------------------------------------------------------------------------------- chance levels
def _brute_chance_iou(n, msize, k):
    mask = set(range(msize))
    vals = [len(mask & set(c)) / len(mask | set(c)) for c in itertools.combinations(range(n), k)]
    return float(np.mean(vals))


@pytest.mark.parametrize("n,msize,k", [(6, 2, 3), (7, 3, None), (5, 5, 2), (8, 1, 8), (9, 4, 1)])
def test_chance_iou_exact_against_enumeration(n, msize, k):
    expected = _brute_chance_iou(n, msize, msize if k is None else k)
    assert chance_iou(n, [msize], k)[0] == pytest.approx(expected, abs=1e-12)


def test_chance_levels_against_monte_carlo():
    g = torch.Generator().manual_seed(0)
    n_maps = 20000
    scores = torch.rand(n_maps, 9, generator=g, dtype=torch.float64)
    mask = torch.zeros(n_maps, 9, dtype=torch.bool)
    mask[:, [1, 4, 5]] = True
    r = localisation(scores, mask)
    mu = r.means()
    assert mu["chance_pointing"] == pytest.approx(3 / 9) and mu["chance_mass"] == pytest.approx(3 / 9)
    assert mu["pointing"] == pytest.approx(mu["chance_pointing"], abs=0.02)
    assert mu["mass"] == pytest.approx(mu["chance_mass"], abs=0.02)
    assert mu["iou"] == pytest.approx(mu["chance_iou"], abs=0.02)
    r2 = localisation(scores, mask, k=5)
    assert r2.means()["iou"] == pytest.approx(r2.means()["chance_iou"], abs=0.02)
    assert r2.means()["chance_iou"] != pytest.approx(mu["chance_iou"], abs=0.02)


# ----------------------------------------------------------------------------------------------- result object
def test_localisation_result_fields_and_explanation_input():
    scores = t([[0.1, 0.9, 0.3, 0.2], [0.4, 0.3, 0.2, 0.1]])
    masks = m([[0, 1, 1, 0], [0, 0, 0, 1]])
    e = Explanation(scores=scores, full_row=torch.cat([torch.ones(2, 1), scores], 1), grid=(2, 2), prefix=1)
    r = localisation(e, masks.reshape(2, 2, 2))
    assert isinstance(r, LocalisationResult)
    np.testing.assert_array_equal(r.pointing, [True, False])
    np.testing.assert_allclose(r.mass, [1.2 / 1.5, 0.1 / 1.0])
    np.testing.assert_allclose(r.iou, [1.0, 0.0])
    np.testing.assert_allclose(r.chance_pointing, [0.5, 0.25])
    np.testing.assert_allclose(r.chance_mass, [0.5, 0.25])
    np.testing.assert_allclose(r.chance_iou, [_brute_chance_iou(4, 2, 2), _brute_chance_iou(4, 1, 1)])
    mu = r.means()
    assert set(mu) == {"pointing", "mass", "iou", "chance_pointing", "chance_mass", "chance_iou"}
    assert mu["pointing"] == pytest.approx(0.5)
    assert "pointing 0.500" in r.summary()
    d = r.as_dict()
    json.dumps(d, allow_nan=False)
    assert d["per_example"]["pointing"] == [True, False] and d["n"] == 2


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "scores,masks,kw,exc,match",
    [
        (np.zeros((2, 4)), np.ones((2, 5), bool), {}, ValueError, "masks must be"),
        (np.zeros((2, 4)), np.ones((3, 4), bool), {}, ValueError, "masks must be"),
        (np.zeros((2, 4)), np.full((2, 4), 2), {}, ValueError, "only 0/1"),
        (np.zeros((2, 4)), np.array([[1, 0, 0, 0], [0, 0, 0, 0]]), {}, ValueError, r"examples \[1\] have an empty"),
        (np.array([[np.nan, 0, 0, 0]]), np.ones((1, 4), bool), {}, ValueError, "NaN"),
        (np.zeros(4), np.ones(4, bool), {}, ValueError, "scores must be"),
        ("abc", np.ones((1, 4), bool), {}, TypeError, "scores must be"),
        (np.zeros((1, 4)), np.ones((1, 4), bool), {"k": 0}, ValueError, r"k must be in \[1, 4\]"),
        (np.zeros((1, 4)), np.ones((1, 4), bool), {"k": 5}, ValueError, r"k must be in \[1, 4\]"),
        (np.zeros((1, 4)), np.ones((1, 4), bool), {"k": 2.0}, TypeError, "k must be an integer"),
        (np.zeros((1, 4)), np.ones((1, 4), bool), {"k": True}, TypeError, "k must be an integer"),
    ],
)
def test_errors(scores, masks, kw, exc, match):
    with pytest.raises(exc, match=match):
        localisation(scores, masks, **kw)
    fns = [pointing_game, mask_mass] if not kw else []
    for fn in fns:
        with pytest.raises(exc, match=match):
            fn(scores, masks)
    with pytest.raises(exc, match=match):
        topk_iou(scores, masks, **kw)


def test_chance_iou_errors():
    with pytest.raises(ValueError, match="mask_sizes"):
        chance_iou(4, [0])
    with pytest.raises(ValueError, match="mask_sizes"):
        chance_iou(4, [5])
    with pytest.raises(ValueError, match="k must be in"):
        chance_iou(4, [2], k=9)
