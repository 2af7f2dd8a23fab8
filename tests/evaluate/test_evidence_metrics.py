"""The rationale metrics on text (evidence mass, pointing, top-k F1) against hand-worked examples, and their
registration: units exclude special tokens and padding, chance = m / N, and evaluate_methods computes them
only for text with evidence masks."""

import math

import numpy as np
import pytest
import torch

from attnroll.evaluate import evaluate_methods, metric_info, metric_names
from attnroll.evaluate.evidence_f1 import evidence_f1
from attnroll.evaluate.evidence_mass import evidence_mass
from attnroll.evaluate.evidence_pointing import evidence_pointing

from ..zoo import sharp

inputs_for, model = sharp.inputs_for, sharp.model

# Two rows of 6 tokens: [CLS] w1 w2 w3 w4 [SEP] and [CLS] w1 w2 w3 [SEP] [PAD].
UNITS = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
EVIDENCE = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 1, 0, 1, 0, 0]], dtype=torch.bool)


def test_mass_by_hand():
    s = torch.tensor([[5.0, 2, -1, 3, 1, 9], [7.0, 0.5, 2, 0.5, 8, 8]])
    # row 0: positive relevance on the units 2 + 0 + 3 + 1 = 6, on the evidence 3 -> 0.5 ([CLS] 5, [SEP] 9 ignored)
    # row 1: units 0.5 + 2 + 0.5 = 3, evidence 0.5 + 0.5 = 1 -> 1/3
    np.testing.assert_allclose(evidence_mass(s, EVIDENCE, UNITS), [0.5, 1 / 3])
    # with every token a unit, row 0 becomes 3 / (5 + 2 + 3 + 1 + 9) = 0.15
    assert evidence_mass(s, EVIDENCE)[0] == pytest.approx(3 / 20)
    # no positive relevance on any unit: undefined (NaN), even though [CLS] is positive
    out = evidence_mass(torch.tensor([[4.0, -1, 0, -2, -3, 1], [1.0, 1, 1, 1, 1, 1]]), EVIDENCE, UNITS)
    assert math.isnan(out[0]) and out[1] == pytest.approx(2 / 3)


def test_pointing_by_hand():
    s = torch.tensor([[9.0, 2, 1, 3, 0, 9], [9.0, 1, 4, 2, 9, 9]])
    # row 0: best unit is w3 (3) = evidence -> hit ([CLS] / [SEP] at 9 do not count); row 1: w2 (4) is not
    np.testing.assert_array_equal(evidence_pointing(s, EVIDENCE, UNITS), [True, False])
    # a tie at the maximum between an evidence unit and another: a miss; between two evidence units: a hit
    tie = torch.tensor([[0.0, 3, 0, 3, 0, 0], [0.0, 3, 0, 3, 0, 0]])
    np.testing.assert_array_equal(evidence_pointing(tie, EVIDENCE, UNITS), [False, True])
    # a flat map over the units never hits unless every unit is evidence
    assert not evidence_pointing(torch.zeros(2, 6), EVIDENCE, UNITS).any()


def test_top_k_f1_by_hand():
    s = torch.tensor([[9.0, 4, 1, 3, 0, 9], [9.0, 2, 5, 1, 9, 0]])
    # row 0: m = 1, top-1 unit is w1 (4), not evidence -> F1 0
    # row 1: m = 2, top-2 units w2 (5), w1 (2): overlap {w1} -> precision 1/2, recall 1/2, F1 1/2
    np.testing.assert_allclose(evidence_f1(s, EVIDENCE, UNITS), [0.0, 0.5])
    # ties broken by position: a flat map takes the first m units: row 0 -> w1 (miss), row 1 -> w1, w2 (1 of 2)
    np.testing.assert_allclose(evidence_f1(torch.zeros(2, 6), EVIDENCE, UNITS), [0.0, 0.5])
    # the evidence itself scores 1
    np.testing.assert_allclose(evidence_f1(EVIDENCE.double(), EVIDENCE, UNITS), [1.0, 1.0])


def test_f1_equals_a_naive_set_computation():
    rng = np.random.default_rng(0)
    s = torch.from_numpy(rng.normal(size=(40, 9)))
    units = torch.from_numpy(rng.random((40, 9)) < 0.8)
    units[:, 0] = True
    ev = units & torch.from_numpy(rng.random((40, 9)) < 0.4)
    ev[:, 0] = True
    for b, got in enumerate(evidence_f1(s, ev, units)):
        idx = [i for i in range(9) if units[b, i]]
        m = int(ev[b].sum())
        top = set(sorted(idx, key=lambda i: -float(s[b, i]))[:m])
        gold = {i for i in idx if ev[b, i]}
        p, r = len(top & gold) / len(top), len(top & gold) / len(gold)
        assert got == pytest.approx(0 if p + r == 0 else 2 * p * r / (p + r))


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="evidence: examples \\[0\\] have an empty mask"):
        evidence_mass(torch.ones(1, 3), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="examples \\[1\\] mark tokens that are not units"):
        evidence_f1(torch.ones(2, 6), EVIDENCE, torch.tensor([[1] * 6, [0] * 6]))
    with pytest.raises(ValueError, match="units must be \\(B, n\\)"):
        evidence_pointing(torch.ones(2, 6), EVIDENCE, torch.ones(2, 5))


def test_registered_for_text_with_masks_only():
    text, image = metric_names("text", masks=True), metric_names("image", masks=True)
    assert text == ["evidence_mass", "evidence_pointing", "evidence_f1"]
    assert image == ["pointing", "mass", "iou"]
    assert all(metric_info(k).higher_is_better for k in text)


def test_evaluate_methods_scores_text_against_evidence():
    enc = inputs_for("bert", batch=3)
    n = enc["input_ids"].shape[1]
    special = torch.zeros(3, n, dtype=torch.long)
    special[:, 0] = special[:, -1] = 1
    enc = {**enc, "special_tokens_mask": special}
    ev = torch.zeros(3, n, dtype=torch.bool)
    ev[0, 1], ev[1, 2:4], ev[2, 1] = True, True, True
    res = evaluate_methods(model("bert"), enc, ["raw", "random"], masks=ev, bins=(0.2, 0.5))
    assert res.metrics == ["comprehensiveness", "sufficiency", "evidence_mass", "evidence_pointing", "evidence_f1"]
    units = (enc["attention_mask"].bool() & ~special.bool())
    assert res.chance["evidence_f1"] == pytest.approx(float((ev.sum(1) / units.sum(1)).double().mean()))
    from attnroll.evaluate.suite import explain_scores

    scores, _ = explain_scores(model("bert"), {k: v for k, v in enc.items() if k != "special_tokens_mask"}, "raw")
    np.testing.assert_allclose(res.per_example["raw"]["evidence_f1"], evidence_f1(scores, ev, units))
    with pytest.raises(ValueError, match="do not apply to a text classifier's tokens"):
        evaluate_methods(model("bert"), enc, ["raw"], masks=ev, metrics=["pointing"])
