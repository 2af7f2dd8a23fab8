"""evaluate_methods scores many perturbed copies per forward pass (small images: up to 32 MB of pixels, at
least batch_size) with the same values as the metric functions at any batch size, and reports its progress
over the whole run: every stage (a method explained, a metric scored) once, fractionally while scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnroll import _system
from attnroll.evaluate import deletion, insertion
from attnroll.evaluate.suite import SCORING_ELEMENTS, evaluate_methods, scoring_batch_size
from attnroll.models import shapes


@pytest.fixture(scope="module")
def data():
    model = shapes.load_shapes_model().eval()
    images, labels, _ = shapes.make_dataset(6, 3)
    return model, shapes.preprocess(images)


@pytest.mark.slow  # over a second
def test_scoring_takes_many_copies_per_pass_with_the_same_values(data):
    model, x = data
    seen = []
    def count(m, a, k):
        seen.append(int((k["pixel_values"] if "pixel_values" in k else a[0]).shape[0]))

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        res = evaluate_methods(model, x, ["random"], metrics=["deletion", "insertion"], batch_size=4)
    finally:
        handle.remove()
    units = 64
    assert max(seen) == x.shape[0] * (units + 1)  # all 390 copies of a metric in one pass (< 682)
    from attnroll.methods import explain

    scores = explain(model, x, "random").scores
    for name, fn in (("deletion", deletion), ("insertion", insertion)):
        want = fn(model, x, scores, batch_size=4)  # four copies per pass: the unbatched reference
        np.testing.assert_allclose(res.per_example["random"][name], want.per_example, atol=1e-6)


def test_the_scoring_batch_follows_the_image_size():
    assert scoring_batch_size(64, "image", torch.zeros(1, 3, 64, 64)) == SCORING_ELEMENTS // (3 * 64 * 64)
    assert scoring_batch_size(64, "image", torch.zeros(1, 3, 224, 224)) == 64  # never below batch_size
    assert scoring_batch_size(500, "image", torch.zeros(1, 3, 64, 64)) == 682
    assert scoring_batch_size(8, "text", None) == 8


class Recorder:
    made: list = []

    def __init__(self, total, enabled, desc="", unit=""):
        self.total, self.steps, self.texts, self.closed = total, [], [], False
        Recorder.made.append(self)

    def __call__(self, k):
        self.steps.append(k)

    def describe(self, text):
        self.texts.append(text)

    def close(self):
        self.closed = True


@pytest.mark.slow  # over a second
def test_progress_bar_covers_the_whole_run(data, monkeypatch):
    model, x = data
    monkeypatch.setattr(_system, "ProgressBar", Recorder)
    Recorder.made = []
    evaluate_methods(model, x, ["rollout", "random"], metrics=["deletion", "positive"], batch_size=2, progress=True)
    (bar,) = Recorder.made
    assert bar.total == 2 * (1 + 2) and bar.closed
    assert sum(bar.steps) == pytest.approx(bar.total) and min(bar.steps) >= 0
    assert len(bar.steps) > bar.total  # fractional advances while scoring
    assert bar.texts == ["rollout: explaining 6 inputs", "rollout: scoring deletion", "rollout: scoring positive",
                         "random: explaining 6 inputs", "random: scoring deletion", "random: scoring positive"]
    said = []
    evaluate_methods(model, x, ["random"], metrics=["deletion"], progress=said.append)
    assert said == ["random: explaining 6 inputs"]  # a callable still gets one message per method
