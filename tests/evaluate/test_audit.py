"""Checkpoint audits: the marker copy of the shapes model is flagged, an identical copy is not; the statistics
against naive computations; regions; saving; errors."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from scipy.stats import spearmanr

import attnroll
from attnroll.evaluate.audit import AuditReport, audit, grid_regions, js_divergence, shapes_regions
from attnroll.models import shapes, spurious


@pytest.fixture(scope="module")
def setup():
    x, y, obj = shapes.make_dataset(48, 2024)
    marked, mk = spurious.add_marker(x, y, agree=1.0, seed=0)
    return {
        "a": shapes.load_shapes_model(),
        "b": spurious.load_marker_model(),
        "images": marked,
        "x": shapes.preprocess(marked),
        "regions": shapes_regions(obj, mk),
    }


@pytest.fixture(scope="module")
def marker_report(setup):
    return audit(setup["a"], setup["b"], setup["x"], regions=setup["regions"], n_boot=300)


# ------------------------------------------------------------------------------------------- the verdicts
def test_marker_copy_is_flagged_toward_the_marker(marker_report):
    r = marker_report
    print(r.summary())
    assert r.flagged
    lo, hi = r.shift_ci["marker"]
    assert r.shift["marker"] > 0.05 and lo > 0 and lo <= r.shift["marker"] <= hi
    assert any(reason.startswith("mass moved toward 'marker': +") for reason in r.reasons)
    assert r.shift["object"] < 0  # the mass comes off the object
    # region masses are shares of one distribution: they sum to 1 and the shifts to 0
    total = sum(r.mass_b[k] for k in r.regions)
    assert np.allclose(total, 1.0) and abs(sum(r.shift.values())) < 1e-12


def test_identical_copy_is_not_flagged(setup):
    r = audit(setup["a"], copy.deepcopy(setup["a"]), setup["x"], regions=setup["regions"], n_boot=200)
    assert not r.flagged and r.reasons == []
    assert np.array_equal(r.maps_a, r.maps_b)
    assert np.all(r.js == 0.0)
    assert all(v == 0.0 for v in r.shift.values())
    assert all(ci == (0.0, 0.0) for ci in r.shift_ci.values())
    assert np.all(r.topk == 1.0) and np.array_equal(r.pred_a, r.pred_b)
    assert "not flagged" in r.summary()


def test_default_regions_flag_the_corner(setup):
    r = audit(setup["a"], setup["b"], setup["x"][:24], n_boot=200)
    assert set(r.regions) == {"centre", "border", "corners"}
    assert r.shift["corners"] > 0 and r.shift_ci["corners"][0] > 0  # the marker sits in a corner patch


# ------------------------------------------------------------------------------ statistics, naive versions
def test_statistics_against_naive_computations(setup, marker_report):
    r = marker_report
    # maps: the positive part of explain()'s scores, normalised to sum 1
    e = attnroll.explain(setup["b"], setup["x"][:8], method="rollout")
    s = np.clip(e.scores.double().numpy(), 0, None)
    assert np.allclose(r.maps_b[:8], s / s.sum(1, keepdims=True), atol=1e-12)
    assert np.array_equal(r.pred_b[:8], np.asarray(e.target))
    for b in range(r.n):
        p, q = r.maps_a[b], r.maps_b[b]
        assert r.js[b] == pytest.approx(jensenshannon(p, q, base=2) ** 2, abs=1e-10)
        assert r.spearman[b] == pytest.approx(spearmanr(p, q).statistic, abs=1e-10)
        top = lambda m: set(sorted(range(m.size), key=lambda i: (-m[i], i))[: r.k])  # noqa: E731
        assert r.topk[b] == len(top(p) & top(q)) / r.k
        for name, mask in r.regions.items():
            assert r.mass_a[name][b] == pytest.approx(p[mask[b]].sum(), abs=1e-12)
    assert np.all(r.js[r.order][:-1] >= r.js[r.order][1:])
    assert r.shift["marker"] == pytest.approx(np.mean(r.mass_b["marker"] - r.mass_a["marker"]))


def test_js_divergence_hand_cases():
    p = np.array([[1.0, 0.0], [0.5, 0.5], [0.25, 0.75]])
    q = np.array([[0.0, 1.0], [0.5, 0.5], [0.75, 0.25]])
    js = js_divergence(p, q)
    assert js[0] == 1.0 and js[1] == 0.0  # disjoint supports: 1 bit; identical: 0
    # by hand: m = (0.5, 0.5); KL(p||m) = 0.25 log2(0.5) + 0.75 log2(1.5)
    kl = 0.25 * np.log2(0.5) + 0.75 * np.log2(1.5)
    assert js[2] == pytest.approx(kl)


def test_bootstrap_ci_is_seeded(setup):
    kw = dict(regions={k: v[:16] for k, v in setup["regions"].items()}, n_boot=200)
    x = setup["x"][:16]
    r1 = audit(setup["a"], setup["b"], x, seed=1, **kw)
    r2 = audit(setup["a"], setup["b"], x, seed=1, **kw)
    r3 = audit(setup["a"], setup["b"], x, seed=2, **kw)
    assert r1.shift_ci == r2.shift_ci
    assert r1.shift_ci != r3.shift_ci and r1.shift == r3.shift
    # a percentile interval of resampled means lies within the range of the per-example differences
    d = r1.mass_b["marker"] - r1.mass_a["marker"]
    lo, hi = r1.shift_ci["marker"]
    assert d.min() <= lo <= r1.shift["marker"] <= hi <= d.max()


def test_target_and_gradient_methods(setup):
    x = setup["x"][:6]
    r = audit(setup["a"], setup["b"], x, target=2, regions=None, n_boot=50)
    e = attnroll.explain(setup["a"], x, target=2)
    s = e.scores.double().numpy()
    assert np.allclose(r.maps_a, s / s.sum(1, keepdims=True))
    with torch.no_grad():  # gradient methods get their autograd back inside audit
        g = audit(setup["a"], setup["b"], x, method="grad_rollout", target=[0, 1, 2, 3, 0, 1], n_boot=50)
    assert g.method == "grad_rollout" and g.maps_a.shape == (6, 64)
    assert np.allclose(g.maps_a.sum(1), 1.0)
    # predictions are the models' own even when another target is explained
    with torch.no_grad():
        assert np.array_equal(g.pred_b, setup["b"](pixel_values=x).logits.argmax(-1).numpy())


def test_models_keep_their_state(setup):
    a = copy.deepcopy(setup["a"]).train()
    before = {k: v.clone() for k, v in a.state_dict().items()}
    audit(a, setup["b"], setup["x"][:4], n_boot=20)
    assert a.training and all(m.training for m in a.modules())
    assert all(torch.equal(before[k], v) for k, v in a.state_dict().items())


# ----------------------------------------------------------------------------------------------- regions
def test_grid_regions_hand_counts():
    g = grid_regions((8, 8), 3)
    assert {k: int(v[0].sum()) for k, v in g.items()} == {"centre": 36, "border": 24, "corners": 4}
    assert all(v.shape == (3, 64) for v in g.values())
    stacked = np.stack(list(g.values())).astype(int)
    assert np.all(stacked.sum(0) == 1)  # disjoint and covering
    assert g["corners"][0, [0, 7, 56, 63]].all()
    g16 = grid_regions((16, 16), 1)  # ring 2 patches wide
    assert {k: int(v[0].sum()) for k, v in g16.items()} == {"centre": 144, "border": 96, "corners": 16}
    assert grid_regions((2, 2), 1)["corners"].all()


def test_shapes_regions_marker_beats_object():
    obj = torch.zeros(1, 64, 64, dtype=torch.bool)
    obj[0, 5:10, 5:10] = True  # patches (0,0), (0,1), (1,0), (1,1)
    mk = torch.zeros(1, 64, 64, dtype=torch.bool)
    mk[0, 1:7, 1:7] = True  # patch (0,0)
    r = shapes_regions(obj, mk)
    assert np.flatnonzero(r["marker"][0]).tolist() == [0]
    assert np.flatnonzero(r["object"][0]).tolist() == [1, 8, 9]
    assert r["background"][0].sum() == 60
    assert np.all(sum(v.astype(int) for v in r.values()) == 1)
    r2 = shapes_regions(obj)
    assert set(r2) == {"object", "background"} and np.flatnonzero(r2["object"][0]).tolist() == [0, 1, 8, 9]


# -------------------------------------------------------------------------------------------- saving
def test_save_html_png_and_refuse_other_suffixes(tmp_path, marker_report, setup):
    r = marker_report
    h = r.save(tmp_path / "audit.html", images=setup["images"], n=3, class_names=shapes.CLASSES)
    text = open(h).read()
    assert "FLAGGED" in text and "data:image/png;base64," in text and "marker" in text
    p = r.save(tmp_path / "audit.png", images=setup["images"], n=2)
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"\.html or \.png"):
        r.save(tmp_path / "audit.pdf")
    assert sorted(os.listdir(tmp_path)) == ["audit.html", "audit.png"]  # no temporary or refused file left
    fig = r.figure(None, n=2, class_names=shapes.CLASSES)  # bare maps
    assert len(fig.axes) == 4
    d = r.as_dict()
    assert json.loads(json.dumps(d))["flagged"] is True and d["shift_ci"]["marker"][0] > 0


# -------------------------------------------------------------------------------------------- errors
def test_errors(setup):
    from transformers import ViTConfig, ViTForImageClassification

    a, x = setup["a"], setup["x"][:4]
    coarse = ViTForImageClassification(
        ViTConfig(image_size=64, patch_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=16, num_labels=4)
    ).eval()
    with pytest.raises(ValueError, match=r"models A and B .*patch grid \(8, 8\) vs \(4, 4\)"):
        audit(a, coarse, x)
    with pytest.raises(ValueError, match=r"B = 0"):
        audit(a, a, x[:0])
    with pytest.raises(ValueError, match=r"regions\['object'\] must be \(B, units\) = \(4, 64\)"):
        audit(a, a, x, regions={"object": np.ones((4, 63), bool)})
    with pytest.raises(ValueError, match="0/1"):
        audit(a, a, x, regions={"object": np.full((4, 64), 2)})
    with pytest.raises(TypeError, match="regions must be a dict"):
        audit(a, a, x, regions=[np.ones((4, 64), bool)])
    with pytest.raises(ValueError, match="js_threshold"):
        audit(a, a, x, js_threshold=1.5)
    with pytest.raises(ValueError, match="shift_threshold"):
        audit(a, a, x, shift_threshold=-0.1)
    with pytest.raises(ValueError, match="top_k"):
        audit(a, a, x, top_k=65)
    with pytest.raises(ValueError, match="target has 3 entries"):
        audit(a, a, x, target=[0, 1, 2])
    with pytest.raises(ValueError, match="pixel_values"):
        audit(a, a, x[0])
    with pytest.raises(ValueError, match="method"):
        audit(a, a, x, method="nope")
    with pytest.raises(ValueError, match="marker_masks"):
        shapes_regions(torch.zeros(2, 64, 64, dtype=torch.bool), torch.zeros(3, 64, 64, dtype=torch.bool))


def test_report_type(marker_report):
    assert isinstance(marker_report, AuditReport)
    assert marker_report.maps_a.shape == (48, 64) and marker_report.grid == (8, 8) and marker_report.k == 5
