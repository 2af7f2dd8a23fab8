"""tools/value_aware_validation/g1_2000.py (G1 on 2,000 pre-registered images): a part equals the
``attnroll evaluate`` command on the same images, parts pool back in image order and must tile the set, the
mean / paired SE against scipy and numpy written out, the exact McNemar p against a binomial sum by hand, and
the pre-registered rule on hand-made cases. No test scores the 2,000-image set."""
import csv
import importlib.util
import io
import math
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "g1_2000.py"
_spec = importlib.util.spec_from_file_location("g1_2000", _PATH)
g1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(g1)


def _write_part(out, seed, group, a, b, per, labels):
    arrays = {"labels": labels[a:b], "range": np.array([a, b])}
    for key, v in per.items():
        arrays[key] = v[a:b]
    arrays["rollout__seconds"] = np.array(0.1)
    np.savez(out / f"g1_{seed}_{group}_{a}-{b}.npz", **arrays)


def _synthetic(n, seed=0):
    rng = np.random.default_rng(seed)
    per = {f"{m}__{k}": rng.random(n) for m in ("rollout", "x") for k in g1.KEYS}
    return per, rng.integers(0, 4, n)


def test_pool_concatenates_the_parts_in_image_order(tmp_path):
    n = 23
    per, labels = _synthetic(n)
    for a, b in [(15, 23), (0, 7), (7, 15)]:  # written out of order
        _write_part(tmp_path, 5, "primary", a, b, per, labels)
    _write_part(tmp_path, 6, "primary", 0, 23, _synthetic(n, 1)[0], labels)  # another seed: ignored
    _write_part(tmp_path, 5, "secondary", 0, 23, _synthetic(n, 2)[0], labels)  # another group: ignored
    got = g1.pool(tmp_path, "primary", seed=5, n=n)
    assert set(got) == set(per) | {"labels"}
    for key, v in per.items():
        np.testing.assert_array_equal(got[key], v)
    np.testing.assert_array_equal(got["labels"], labels)


@pytest.mark.parametrize("parts, what", [([(0, 7), (8, 23)], "gap at image 7"),
                                         ([(0, 8), (7, 23)], "overlap at image 7"),
                                         ([(0, 7), (7, 20)], "end at image 20"),
                                         ([(3, 23)], "gap at image 0")])
def test_pool_refuses_parts_that_do_not_tile_the_set(tmp_path, parts, what):
    per, labels = _synthetic(23)
    for a, b in parts:
        _write_part(tmp_path, 5, "primary", a, b, per, labels)
    with pytest.raises(ValueError, match=what):
        g1.pool(tmp_path, "primary", seed=5, n=23)
    with pytest.raises(ValueError, match="no parts"):
        g1.pool(tmp_path, "secondary", seed=5, n=23)


def test_mean_se_and_paired_against_scipy_and_numpy():
    from scipy.stats import sem

    rng = np.random.default_rng(3)
    c, r = rng.normal(0.3, 0.1, 50), rng.normal(0.2, 0.1, 50)
    c[4] = np.nan  # a missing score drops that image (from the mean and from the pair)
    m, se = g1.mean_se(c)
    assert m == pytest.approx(np.nanmean(c), rel=1e-12)
    assert se == pytest.approx(sem(c, nan_policy="omit"), rel=1e-12)
    d, dse, npair = g1.paired(c, r)
    keep = np.arange(50) != 4
    diffs = [c[i] - r[i] for i in range(50) if keep[i]]
    mu = sum(diffs) / len(diffs)
    want_se = math.sqrt(sum((x - mu) ** 2 for x in diffs) / (len(diffs) - 1) / len(diffs))
    assert (d, npair) == (pytest.approx(mu, rel=1e-12), 49)
    assert dse == pytest.approx(want_se, rel=1e-12)


def test_mcnemar_against_a_binomial_sum_by_hand():
    def by_hand(b, c):  # two-sided exact: twice the smaller tail of Bin(b + c, 1/2), capped at 1
        n = b + c
        return 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n)

    rng = np.random.default_rng(1)
    for gained, lost, both in [(3, 3, 194), (6, 0, 10), (10, 2, 100), (0, 7, 5), (0, 0, 20), (25, 12, 900)]:
        hr = np.r_[np.zeros(gained), np.ones(lost), np.ones(both), np.zeros(4)]
        hc = np.r_[np.ones(gained), np.zeros(lost), np.ones(both), np.zeros(4)]
        perm = rng.permutation(hr.size)
        b, c, p = g1.mcnemar(hc[perm], hr[perm])
        assert (b, c) == (gained, lost)
        assert p == pytest.approx(by_hand(gained, lost), rel=1e-10)
    with pytest.raises(ValueError, match="0 or 1"):
        g1.mcnemar(np.array([0.5, 1.0]), np.array([1.0, 1.0]))


def _case(**shift):
    """Reference scores and a candidate shifted by `shift` (metric -> added to every image), 4 images."""
    base = {k: np.array([0.2, 0.4, 0.6, 0.8]) for k in g1.KEYS}
    base["pointing"] = np.array([1.0, 1.0, 0.0, 1.0])
    cand = {k: v + shift.get(k, 0.0) for k, v in base.items()}
    return cand, base


def test_verdict_is_met_only_when_every_mean_is_strictly_better():
    better = {"deletion": -0.01, "insertion": 0.01, "positive": -1.0, "negative": 1.0, "pointing": 0.25,
              "mass": 0.01, "iou": 0.01}
    met, rows = g1.verdict(*_case(**better))
    assert met and all(r["better"] for r in rows.values())
    assert rows["deletion"]["diff"][0] == pytest.approx(-0.01)
    for k in g1.KEYS:  # one metric tied, or one metric the wrong way: not met, and that metric says why
        for wrong in (0.0, -better[k]):
            met, rows = g1.verdict(*_case(**{**better, k: wrong}))
            assert not met and not rows[k]["better"]
            assert all(rows[j]["better"] for j in g1.KEYS if j != k)


def test_verdict_signs_the_margin_in_se_so_that_better_is_positive():
    cand, ref = _case()
    cand["deletion"] = ref["deletion"] - np.array([0.01, 0.03, 0.02, 0.02])  # lower deletion: better
    cand["iou"] = ref["iou"] - np.array([0.01, 0.03, 0.02, 0.02])  # lower IoU: worse
    _, rows = g1.verdict(cand, ref)
    d = np.array([0.01, 0.03, 0.02, 0.02])
    z = d.mean() / (d.std(ddof=1) / 2)
    assert rows["deletion"]["z"] == pytest.approx(z) and rows["deletion"]["beyond_2se"]
    assert rows["iou"]["z"] == pytest.approx(-z) and not rows["iou"]["beyond_2se"]


def test_a_part_is_the_evaluate_command_on_those_images(tmp_path):
    pytest.importorskip("click")
    pytest.importorskip("transformers")
    from tests.commands.test_cli import run

    res = run("evaluate", "--n", 4, "--seed", 777, "--methods", "rollout,measured_rollout", "-o",
              "measured_rollout.class_blocks=1", "--out", tmp_path / "cli")
    assert res.exit_code == 0, res.output
    rows = {r["method"]: r for r in csv.DictReader(io.StringIO((tmp_path / "cli" / "evaluation.csv").read_text()))}
    whole = np.load(g1.run_part("primary", 0, 4, seed=777, n=4, out=tmp_path))
    for label, method in ((g1.REF, "rollout"), (g1.CAND, "measured_rollout")):
        for k in g1.KEYS:
            assert whole[f"{label}__{k}"].mean() == pytest.approx(float(rows[method][k]), rel=1e-5, abs=1e-9), (label, k)
    # a later part of the set scores its images as they score in the whole (the set is sliced, not re-drawn)
    tail = np.load(g1.run_part("primary", 2, 4, seed=777, n=4, out=tmp_path))
    np.testing.assert_array_equal(tail["labels"], whole["labels"][2:])
    for k in g1.KEYS:
        np.testing.assert_allclose(tail[f"{g1.CAND}__{k}"], whole[f"{g1.CAND}__{k}"][2:], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="0 <= a < b <= n"):
        g1.run_part("primary", 3, 9, seed=777, n=4, out=tmp_path)
