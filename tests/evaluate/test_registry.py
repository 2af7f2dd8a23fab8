"""The metric registry: a metric registered in one place is computed by evaluate_methods, ordered, formatted
and judged by its declared direction; wrong registrations raise."""

import numpy as np
import pytest
import torch

import attnroll
from attnroll.evaluate import METRICS, MetricValues, evaluate_methods, metric_info, metric_names, register_metric
from attnroll.evaluate import registry

from ..zoo import sharp

inputs_for, model = sharp.inputs_for, sharp.model


@pytest.fixture
def top_share():
    """A throw-away metric: the largest score's share of the positive mass, lower is better, image-only."""

    @register_metric("test_top_share", kind="image", higher_is_better=False, fmt=".2f",
                     description="share of the positive mass in the top unit")
    def _top(inp, scores, grid):
        s = torch.as_tensor(scores, dtype=torch.float64).clamp(min=0)
        return MetricValues((s.amax(1) / s.sum(1)).numpy())

    yield "test_top_share"
    registry._REGISTRY.pop("test_top_share")


def test_a_registered_metric_is_computed_formatted_and_judged(top_share):
    m = model("vit")
    x = inputs_for("vit", batch=4)["pixel_values"]
    assert metric_names()[-1] == top_share and METRICS[top_share] == (metric_info(top_share).description, False)
    res = evaluate_methods(m, x, ["rollout", "raw"], metrics=[top_share], batch_size=3)
    for name in ("rollout", "raw"):
        s = attnroll.explain(m, x, name).scores.double().clamp(min=0)
        want = (s.amax(1) / s.sum(1)).numpy()
        assert np.allclose(res.per_example[name][top_share], want)
        assert res.values[name][top_share] == pytest.approx(want.mean())
    assert res.best(top_share) == min(("rollout", "raw"), key=lambda k: res.values[k][top_share])
    assert res.cell("raw", top_share) == f"{res.values['raw'][top_share]:.2f}±{res.stderr['raw'][top_share]:.2f}"
    assert res.heading(top_share) == f"{top_share} ↓"
    assert res.curves["raw"] == {} and res.chance == {}


def test_kinds_decide_where_a_metric_applies(top_share):
    assert top_share in metric_names("image") and top_share not in metric_names("text")
    assert all(metric_info(k).needs_masks for k in metric_names(masks=True))
    enc = inputs_for("bert", batch=2)
    with pytest.raises(ValueError, match=r"\['test_top_share'\] do not apply to a text classifier's tokens"):
        evaluate_methods(model("bert"), enc, ["raw"], metrics=[top_share])


def test_wrong_registrations():
    with pytest.raises(ValueError, match="'deletion' is already registered"):
        register_metric("deletion", kind="image", higher_is_better=False, description="x")
    with pytest.raises(ValueError, match="kind must be one of image, text, both, got 'video'"):
        register_metric("test_video", kind="video", higher_is_better=True, description="x")
    assert "test_video" not in METRICS
    with pytest.raises(ValueError, match="metrics must be among"):
        metric_info("nope")


def test_the_cli_help_lists_the_registry():
    """The --metrics help is written out (so that `attnroll evaluate --help` starts without torch); every
    metric of the registry must be in it."""
    pytest.importorskip("click")
    from attnroll.commands.evaluate import _metrics_help

    missing = [name for name in METRICS if name not in _metrics_help()]
    assert not missing and "comprehensiveness" in _metrics_help()
