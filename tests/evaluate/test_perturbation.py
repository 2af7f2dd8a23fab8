"""Image perturbation metrics: deletion / insertion (RISE) and Chefer's positive / negative perturbation.

Most checks use a constructed model that looks at ONE patch only, so every curve is known in closed form;
the rest compare the batched engine with a naive per-example, per-step loop on the embedded shapes ViT."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from attnroll.evaluate import perturbation as P
from attnroll.explain.explanation import Explanation


H = W = 8
GRID = (4, 4)
U = 16
UNIT = 5  # patch (1, 1) of the 4x4 grid: pixels [2, 4) x [2, 4)
HI = float(1 / (1 + np.exp(-2.0)))  # p(class 1) while the patch is bright (logit 2)
LO = float(1 / (1 + np.exp(2.0)))  # ... once it is filled with 0 (logit -2)


class OnePatch(nn.Module):
    """Logits [0, 4·mean(patch) − 2] over one patch of a (h, w) grid: class 1 (p = HI) while the patch is 1.0,
    class 0 (p(class 1) = LO) once it is 0."""

    def __init__(self, unit: int = UNIT, grid: tuple[int, int] = GRID, size: tuple[int, int] = (H, W)):
        super().__init__()
        i, j = divmod(unit, grid[1])
        ph, pw = size[0] // grid[0], size[1] // grid[1]
        self.rows, self.cols = slice(i * ph, (i + 1) * ph), slice(j * pw, (j + 1) * pw)

    def forward(self, x):
        m = x[:, :, self.rows, self.cols].mean(dim=(1, 2, 3))
        return torch.stack([torch.zeros_like(m), 4 * m - 2], dim=1)


def images(b: int, unit: int = UNIT, grid=GRID, size=(H, W), seed: int = 0) -> torch.Tensor:
    """Random pixels in [0.2, 0.8] everywhere, 1.0 on the model's patch."""
    g = torch.Generator().manual_seed(seed)
    x = 0.2 + 0.6 * torch.rand(b, 3, *size, generator=g)
    x[:, :, OnePatch(unit, grid, size).rows, OnePatch(unit, grid, size).cols] = 1.0
    return x


def maps_with_rank(ranks, unit: int = UNIT, units: int = U, seed: int = 0) -> torch.Tensor:
    """One map per rank r: ``unit`` is the r-th most relevant, the others in a random order; no ties."""
    rng = np.random.default_rng(seed)
    out = np.zeros((len(ranks), units))
    for b, r in enumerate(ranks):
        others = [u for u in rng.permutation(units) if u != unit]
        order = others[:r] + [unit] + others[r:]
        out[b, order] = np.arange(units, 0, -1)  # first in the order gets the largest score
    return torch.from_numpy(out)


def step_auc(r: int, first: float, then: float, units: int = U) -> float:
    """Trapezoid area over k/units, k = 0..units, of a curve that is ``first`` for k <= r and ``then`` after:
    (r full-width steps of ``first``) + (one mixed step) + (units − r − 1 steps of ``then``)."""
    return (r * first + 0.5 * (first + then) + (units - r - 1) * then) / units


# ------------------------------------------------------------------------------------ one-patch model
def test_deletion_one_patch_closed_form_best_and_worst():
    ranks = list(range(U))
    r = P.deletion(OnePatch(), images(U), maps_with_rank(ranks), grid=GRID)
    expected = np.array([step_auc(k, HI, LO) for k in ranks])
    np.testing.assert_allclose(r.per_example, expected, atol=1e-6)
    # the map that ranks the patch first reaches the best possible AUC, the reversed one the worst
    assert r.per_example.argmin() == 0 and r.per_example.argmax() == U - 1
    assert r.per_example[0] == pytest.approx(expected.min(), abs=1e-6)
    best = maps_with_rank([0])
    worst = P.deletion(OnePatch(), images(1), -best, grid=GRID)
    assert worst.value == pytest.approx(expected.max(), abs=1e-6)
    assert not r.higher_is_better and r.kind == "deletion"
    np.testing.assert_allclose(r.fractions, np.arange(U + 1) / U)
    # the curve itself: HI until the patch goes, LO after
    np.testing.assert_allclose(r.curves[3], [HI] * 4 + [LO] * (U - 3), atol=1e-6)
    assert (r.target == 1).all()


def test_insertion_one_patch_closed_form_best_and_worst():
    ranks = list(range(U))
    r = P.insertion(OnePatch(), images(U), maps_with_rank(ranks), grid=GRID, baseline=0.0)
    expected = np.array([step_auc(k, LO, HI) for k in ranks])
    np.testing.assert_allclose(r.per_example, expected, atol=1e-6)
    assert r.per_example.argmax() == 0 and r.per_example.argmin() == U - 1
    assert r.higher_is_better
    np.testing.assert_allclose(r.curves[0], [LO] + [HI] * U, atol=1e-6)


def chefer_curve(r: int, units: int = U, fractions=P.CHEFER_FRACTIONS) -> np.ndarray:
    """Accuracy while the patch is still there: round(f·units) <= r patches removed before it."""
    return np.array([1.0 if round(f * units) <= r else 0.0 for f in fractions])


def test_positive_negative_one_patch():
    ranks = list(range(U))
    s = maps_with_rank(ranks)
    pos = P.positive_perturbation(OnePatch(), images(U), s, grid=GRID)
    want = np.stack([chefer_curve(k) for k in ranks])
    np.testing.assert_array_equal(pos.curves, want)
    # patch first: accuracy 1 at 0%, 0 from 10% on -> 100 * 0.1 * (1 + 0) / 2 = 5
    assert pos.per_example[0] == pytest.approx(5.0)
    assert pos.per_example.argmin() == 0 and not pos.higher_is_better
    # negative removes the least relevant first: the patch ranked first (removed last) is never removed
    neg = P.negative_perturbation(OnePatch(), images(U), s, grid=GRID)
    assert neg.per_example[0] == pytest.approx(90.0) and neg.higher_is_better
    # ranked last: in negative order it is first, gone from 10% on
    assert neg.per_example[U - 1] == pytest.approx(5.0)


def test_chefer_auc_hand_worked():
    # 10 patches (grid 2x5), so 10%..90% remove exactly 1..9 patches. Patch at rank 2 in example 0 and rank 5
    # in example 1: accuracy curves [1,1,1,0,...] and [1]*6+[0]*4; mean [1,1,1,.5,.5,.5,0,0,0,0];
    # trapezoids 0.1 * (1 + 1 + .75 + .5 + .5 + .25 + 0 + 0 + 0) = 0.4 -> 40.0 in the paper's units.
    grid, size, unit = (2, 5), (4, 10), 3
    x = images(2, unit, grid, size)
    s = maps_with_rank([2, 5], unit=unit, units=10)
    r = P.positive_perturbation(OnePatch(unit, grid, size), x, s, grid=grid)
    np.testing.assert_array_equal(r.mean_curve(), [1, 1, 1, 0.5, 0.5, 0.5, 0, 0, 0, 0])
    assert r.value == pytest.approx(40.0)
    np.testing.assert_allclose(r.per_example, [25.0, 55.0])  # 100*0.1*(2.5) and 100*0.1*(5.5)
    assert r.summary() == "positive perturbation AUC 40.00 (lower is better, B=2)"


def test_trapezoid_hand_worked():
    assert P.trapezoid([1.0, 0.0, 0.0], [0.0, 0.5, 1.0]) == pytest.approx(0.25)
    np.testing.assert_allclose(P.trapezoid([[1, 1], [0, 2]], [0.0, 0.9]), [0.9, 0.9])


def test_random_maps_land_on_the_expected_value():
    # The patch's rank is uniform over 0..U-1 for random maps, so E[deletion AUC] = mean_r step_auc(r) =
    # (HI + LO) / 2 and E[insertion AUC] likewise; the per-map spread is (HI - LO) * 0.29, so the mean of
    # 400 maps is within 4 standard errors (0.06 (HI - LO)) with overwhelming probability.
    n = 400
    s = torch.from_numpy(np.random.default_rng(3).random((n, U)))
    exp_del = np.mean([step_auc(r, HI, LO) for r in range(U)])
    exp_pos = np.mean([100 * P.trapezoid(chefer_curve(r), P.CHEFER_FRACTIONS) for r in range(U)])
    x = images(n)
    d = P.deletion(OnePatch(), x, s, grid=GRID, batch_size=2048)
    assert exp_del == pytest.approx((HI + LO) / 2)
    assert abs(d.value - exp_del) < 0.06 * (HI - LO)
    i = P.insertion(OnePatch(), x, s, grid=GRID, baseline=0.0, batch_size=2048)
    assert abs(i.value - exp_del) < 0.06 * (HI - LO)
    pos = P.positive_perturbation(OnePatch(), x, s, grid=GRID, batch_size=2048)
    assert abs(pos.value - exp_pos) < 4 * 90 * 0.3 / np.sqrt(n)


# ------------------------------------------------------------------------- properties on random models
def linear_model(classes: int = 5, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * H * W, classes)).eval()


def test_negating_scores_swaps_positive_and_negative_exactly():
    x = torch.randn(6, 3, H, W, generator=torch.Generator().manual_seed(1))
    s = torch.randn(6, U, generator=torch.Generator().manual_seed(2))  # continuous: no ties
    m = linear_model()
    pos, neg = P.positive_perturbation(m, x, s), P.negative_perturbation(m, x, -s)
    np.testing.assert_array_equal(pos.curves, neg.curves)
    np.testing.assert_array_equal(
        P.negative_perturbation(m, x, s).curves, P.positive_perturbation(m, x, -s).curves
    )
    assert pos.curves.min() == 0.0  # the test is not vacuous: some predictions do change
    assert pos.value == pytest.approx(neg.value)


def test_batch_size_and_per_example_invariance():
    x = torch.randn(5, 3, H, W, generator=torch.Generator().manual_seed(4))
    s = torch.randn(5, U, generator=torch.Generator().manual_seed(5))
    m = linear_model()
    ref = P.deletion(m, x, s, steps=5, fill=-1.0, batch_size=64)
    for bs in (1, 7, 1000):
        np.testing.assert_allclose(P.deletion(m, x, s, steps=5, fill=-1.0, batch_size=bs).curves, ref.curves, atol=1e-6)
    for b in range(5):
        one = P.deletion(m, x[b : b + 1], s[b : b + 1], steps=5, fill=-1.0)
        np.testing.assert_allclose(one.curves[0], ref.curves[b], atol=1e-6)
    ins = P.insertion(m, x, s, batch_size=3)
    np.testing.assert_allclose(P.insertion(m, x, s, batch_size=64).curves, ins.curves, atol=1e-6)


# ------------------------------------------------------------------------- naive loop on the shapes ViT
@pytest.fixture(scope="module")
def shapes():
    pytest.importorskip("transformers")
    from attnroll.models.shapes import load_shapes_model, make_dataset, preprocess

    torch.manual_seed(0)
    images_, labels, _ = make_dataset(3, seed=11)
    return load_shapes_model(), preprocess(images_), labels


def naive_curves(model, x, scores, counts, grid, *, fill=None, start=None, target):
    """Per example, per step: copy the image, paint the first k patches of the stable descending order one by
    one (with ``fill``, or from the image onto ``start``), run that single image."""
    h, w = grid
    ph, pw = x.shape[2] // h, x.shape[3] // w
    probs, preds = np.zeros((x.shape[0], len(counts))), np.zeros((x.shape[0], len(counts)), int)
    for b in range(x.shape[0]):
        order = sorted(range(h * w), key=lambda u: (-float(scores[b, u]), u))
        for t, k in enumerate(counts):
            img = x[b].clone() if start is None else start[b].clone()
            for u in order[:k]:
                i, j = divmod(u, w)
                block = (slice(None), slice(i * ph, (i + 1) * ph), slice(j * pw, (j + 1) * pw))
                img[block] = fill if start is None else x[b][block]
            with torch.no_grad():
                logits = model(pixel_values=img[None]).logits[0].double()
            probs[b, t] = torch.softmax(logits, 0)[target[b]].item()
            preds[b, t] = int(logits.argmax())
    return probs, preds


def test_deletion_insertion_positive_match_a_naive_loop(shapes):
    from scipy.ndimage import gaussian_filter

    model, x, labels = shapes
    s = torch.rand(3, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        pred = model(pixel_values=x).logits.argmax(1).tolist()
    counts = [round(k * 64 / 8) for k in range(9)]

    d = P.deletion(model, x, s, steps=8, fill=0.5, batch_size=10)
    want, _ = naive_curves(model, x, s, counts, (8, 8), fill=0.5, target=pred)
    np.testing.assert_allclose(d.curves, want, atol=2e-5)
    assert d.target.tolist() == pred

    blurred = torch.from_numpy(gaussian_filter(x.numpy(), sigma=(0, 0, 3.2, 3.2), mode="nearest", truncate=3.0))
    ins = P.insertion(model, x, s, steps=8, target=2)
    want, _ = naive_curves(model, x, s, counts, (8, 8), start=blurred, target=[2, 2, 2])
    np.testing.assert_allclose(ins.curves, want, atol=2e-5)

    pos = P.positive_perturbation(model, x, s, labels=labels)
    counts = [round(f * 64) for f in P.CHEFER_FRACTIONS]
    assert counts == [0, 6, 13, 19, 26, 32, 38, 45, 51, 58]
    _, preds = naive_curves(model, x, s, counts, (8, 8), fill=0.0, target=[0, 0, 0])
    np.testing.assert_array_equal(pos.curves, (preds == labels.numpy()[:, None]).astype(float))
    assert pos.target.tolist() == labels.tolist()


def test_gaussian_blur_matches_scipy():
    from scipy.ndimage import gaussian_filter

    x = torch.rand(2, 3, 9, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for sigma in (0.7, 1.6, 3.0):
        want = gaussian_filter(x.numpy(), sigma=(0, 0, sigma, sigma), mode="nearest", truncate=3.0)
        np.testing.assert_allclose(P.gaussian_blur(x, sigma).numpy(), want, atol=1e-12)
    assert torch.equal(P.gaussian_blur(x, 0.0), x)


# ----------------------------------------------------------------------------------- options and inputs
def test_steps_round_half_to_even_and_fractions_are_actual_shares():
    # grid 2x3 = 6 units, 4 steps: 6k/4 = 0, 1.5, 3, 4.5, 6 -> 0, 2, 3, 4, 6 removed
    grid, size = (2, 3), (6, 6)
    r = P.deletion(OnePatch(0, grid, size), images(1, 0, grid, size), torch.rand(1, 6), grid=grid, steps=4)
    np.testing.assert_allclose(r.fractions, np.array([0, 2, 3, 4, 6]) / 6)
    c = P.perturbation_curve(OnePatch(), images(2), maps_with_rank([0, 3]), [0, 1, 4, 16], grid=GRID)
    np.testing.assert_allclose(c.probs, [[HI, LO, LO, LO], [HI, HI, LO, LO]], atol=1e-6)
    assert c.units == U and c.counts.tolist() == [0, 1, 4, 16]


def test_explanation_and_grid_inputs():
    s = maps_with_rank([0, 7])
    exp = Explanation(scores=s.float(), full_row=torch.zeros(2, U + 1), grid=GRID, method="test")
    a = P.deletion(OnePatch(), images(2), exp)  # grid from the explanation
    b = P.deletion(OnePatch(), images(2), s.reshape(2, 4, 4).numpy())  # grid from a (B, h, w) map
    c = P.deletion(OnePatch(), images(2), s)  # square grid inferred from 16 units
    np.testing.assert_allclose(a.curves, b.curves)
    np.testing.assert_allclose(a.curves, c.curves)
    # a per-channel fill and a per-example baseline tensor
    x = images(2)
    d = P.deletion(OnePatch(), x, s, fill=torch.zeros(3, 1, 1))
    np.testing.assert_allclose(d.curves, a.curves)
    e = P.insertion(OnePatch(), x, s, baseline=torch.zeros(2, 3, H, W))
    f = P.insertion(OnePatch(), x, s, baseline=0.0)
    np.testing.assert_allclose(e.curves, f.curves)


def test_target_given_and_result_record():
    r = P.deletion(OnePatch(), images(2), maps_with_rank([0, 1]), target=[0, 1])
    np.testing.assert_allclose(r.curves[0, 0], 1 - HI, atol=1e-6)  # class 0's probability
    assert r.target.tolist() == [0, 1]
    d = r.as_dict()
    json.dumps(d)
    assert d["kind"] == "deletion" and d["batch_size"] == 2 and len(d["mean_curve"]) == U + 1
    assert "curves" not in d and len(r.as_dict(include_curves=True)["curves"]) == 2
    assert r.summary() == f"deletion AUC {r.value:.3f} (lower is better, B=2)"
    # the model's mode is left alone and no gradient is recorded
    m = linear_model().train()
    P.deletion(m, torch.randn(1, 3, H, W), torch.randn(1, U), steps=2)
    assert m.training and all(p.grad is None for p in m.parameters())


# ------------------------------------------------------------------------------------------ every error
def test_errors():
    m, x, s = OnePatch(), images(2), maps_with_rank([0, 1])
    with pytest.raises(ValueError, match=r"pixel_values must be \(B, C, H, W\).*got shape \(3, 8, 8\)"):
        P.deletion(m, x[0], s)
    with pytest.raises(TypeError, match="pixel_values must be floating point.*torch.int64"):
        P.deletion(m, x.long(), s)
    with pytest.raises(ValueError, match=r"pixel_values holds no images \(B=0\)"):
        P.deletion(m, x[:0], s[:0])
    with pytest.raises(ValueError, match=r"grid=\(3, 3\) has 9 patches but the scores have 16"):
        P.deletion(m, x, s, grid=(3, 3))
    with pytest.raises(ValueError, match=r"grid=\(2, 8\) must divide the image size 8x12 \(pixel_values H, W\)"):
        P.deletion(m, torch.rand(2, 3, 8, 12), s, grid=(2, 8))
    with pytest.raises(ValueError, match="cannot infer the patch grid: the scores have 12 units.*grid=\\(h, w\\)"):
        P.deletion(m, x, torch.rand(2, 12))
    with pytest.raises(ValueError, match=r"grid=\(2, 8\) disagrees with the scores' own grid \(4, 4\)"):
        P.deletion(m, x, s.reshape(2, 4, 4), grid=(2, 8))
    with pytest.raises(TypeError, match=r"grid must be a pair \(h, w\)"):
        P.deletion(m, x, s, grid=16)
    with pytest.raises(ValueError, match=r"target\[1\]=7 is out of range for 2 classes"):
        P.deletion(m, x, s, target=[0, 7])
    with pytest.raises(ValueError, match=r"fill has shape \(2, 3\); expected a shape that broadcasts to one image"):
        P.deletion(m, x, s, fill=torch.zeros(2, 3))
    with pytest.raises(TypeError, match="fill must be a real number or a tensor"):
        P.deletion(m, x, s, fill="zero")
    with pytest.raises(ValueError, match="fill contains NaN"):
        P.deletion(m, x, s, fill=torch.full((3, 1, 1), float("nan")))
    with pytest.raises(ValueError, match=r"baseline has shape \(4, 3, 8, 8\)"):
        P.insertion(m, x, s, baseline=torch.zeros(4, 3, 8, 8))
    with pytest.raises(ValueError, match="baseline must be one of 'blur'; got 'mean'"):
        P.insertion(m, x, s, baseline="mean")
    with pytest.raises(ValueError, match=r"steps must be in \[1, inf\], got 0"):
        P.deletion(m, x, s, steps=0)
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, inf\], got 0"):
        P.deletion(m, x, s, batch_size=0)
    with pytest.raises(ValueError, match=r"labels must have one class index per example \(B=2\), got 3"):
        P.positive_perturbation(m, x, s, labels=[0, 1, 1])
    with pytest.raises(ValueError, match=r"labels\[1\]=5 is not a class index: the model has 2 classes"):
        P.negative_perturbation(m, x, s, labels=torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="labels must be a 1-D sequence of class indices"):
        P.positive_perturbation(m, x, s, labels=torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="labels must be a sequence of B class indices"):
        P.positive_perturbation(m, x, s, labels=1)
    with pytest.raises(ValueError, match="give either target= .* or labels= .*not both"):
        P.positive_perturbation(m, x, s, target=1, labels=[1, 1])
    with pytest.raises(ValueError, match="fractions must be strictly increasing"):
        P.positive_perturbation(m, x, s, fractions=(0.0, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"counts must be in \[0, 16\], got 17"):
        P.perturbation_curve(m, x, s, [0, 17])
    with pytest.raises(ValueError, match="counts must hold at least one step"):
        P.perturbation_curve(m, x, s, [])
    with pytest.raises(TypeError, match=r"cannot find class logits in the model's output \(dict\)"):
        P.deletion(lambda t: {"scores": t.mean()}, x, s)
