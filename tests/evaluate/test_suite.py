"""evaluate_methods: the table equals the metric functions called one by one on the same maps; options reach
the methods; the random control gets distinct maps across chunks; errors are clear."""

import csv
import io
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from attnroll import explain  # noqa: E402
from attnroll.evaluate import (  # noqa: E402
    deletion,
    evaluate_methods,
    insertion,
    localisation,
    negative_perturbation,
    positive_perturbation,
)
from attnroll.models import shapes  # noqa: E402


@pytest.fixture(scope="module")
def data():
    images, labels, masks = shapes.make_dataset(6, 21)
    return shapes.load_shapes_model(), shapes.preprocess(images), labels, shapes.patch_masks(masks)


@pytest.mark.slow
def test_table_equals_the_metrics_one_by_one(data):
    model, x, labels, masks = data
    r = evaluate_methods(model, x, ["rollout", "gae"], labels=labels, masks=masks, steps=5, fill=-1.0,
                         batch_size=4)
    with torch.no_grad():
        pred = model(pixel_values=x).logits.argmax(-1)
    assert r.accuracy == pytest.approx(float((pred == labels).float().mean()))
    for m in ("rollout", "gae"):
        with torch.enable_grad():
            s = explain(model, x, m, target=pred.tolist()).scores
        kw = dict(target=pred.tolist(), grid=(8, 8))
        want = {
            "deletion": deletion(model, x, s, steps=5, fill=-1.0, **kw).value,
            "insertion": insertion(model, x, s, steps=5, **kw).value,
            "positive": positive_perturbation(model, x, s, fill=-1.0, **kw).value,
            "negative": negative_perturbation(model, x, s, fill=-1.0, **kw).value,
        }
        loc = localisation(s, masks).means()
        want.update(pointing=loc["pointing"], mass=loc["mass"], iou=loc["iou"])
        for k, v in want.items():
            assert r.values[m][k] == pytest.approx(v, rel=1e-6, abs=1e-9), (m, k)
        # the standard error is the sample std / sqrt(n) of the per-example values
        pe = r.per_example[m]["deletion"]
        assert r.stderr[m]["deletion"] == pytest.approx(pe.std(ddof=1) / math.sqrt(len(pe)))
    assert r.best("deletion") == min(("rollout", "gae"), key=lambda m: r.values[m]["deletion"])
    assert r.best("insertion") == max(("rollout", "gae"), key=lambda m: r.values[m]["insertion"])
    assert set(r.chance) == {"pointing", "mass", "iou"}


def test_csv_round_trip_and_curves(data):
    model, x, labels, masks = data
    r = evaluate_methods(model, x[:3], "rollout,random", metrics=["deletion", "positive"], steps=3)
    rows = list(csv.DictReader(io.StringIO(r.to_csv())))
    assert [row["method"] for row in rows] == ["rollout", "random"]
    assert set(rows[0]) == {"method", "deletion", "deletion_se", "positive", "positive_se", "seconds"}
    assert float(rows[1]["deletion"]) == pytest.approx(r.values["random"]["deletion"], rel=1e-5)
    f, c = r.curves["rollout"]["positive"]
    assert np.allclose(f, np.arange(10) / 10) and c[0] == 1.0  # target = prediction, so 0% removed is all correct
    fig = r.plot()
    assert len(fig.axes) == 2
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_random_control_differs_across_chunks(data):
    model, x, _, masks = data
    r = evaluate_methods(model, x, ["random"], masks=masks, metrics=["iou"], batch_size=2)
    from attnroll.evaluate.suite import explain_scores

    s, grid = explain_scores(model, x, "random", batch_size=2)
    assert grid == (8, 8)
    assert not torch.equal(s[0], s[2]) and not torch.equal(s[1], s[3])
    # chunking does not change the maps: one batch gives the same seeds (seed + index)
    s1, _ = explain_scores(model, x, "random", batch_size=64)
    assert torch.equal(s, s1)
    assert r.values["random"]["iou"] == pytest.approx(localisation(s, masks).means()["iou"])


def test_method_options_are_passed(data):
    model, x, _, masks = data
    a = evaluate_methods(model, x, ["rollout"], masks=masks, metrics=["mass"])
    b = evaluate_methods(model, x, ["rollout"], masks=masks, metrics=["mass"],
                         method_options={"rollout": {"alpha": 0.9}})
    s = explain(model, x, "rollout", alpha=0.9).scores
    assert b.values["rollout"]["mass"] == pytest.approx(localisation(s, masks).means()["mass"])
    assert a.values["rollout"]["mass"] != pytest.approx(b.values["rollout"]["mass"])


@pytest.mark.parametrize("kwargs, err, words", [
    (dict(methods=[]), ValueError, "methods is empty"),
    (dict(methods=["nope"]), ValueError, "nope"),
    (dict(methods=["rollout"], metrics=["pointing"]), ValueError, "need masks"),
    (dict(methods=["rollout"], metrics=["speed"]), ValueError, "metrics must be one of"),
    (dict(methods=["rollout"], method_options={"gae": {}}), ValueError, "not evaluated"),
    (dict(methods=["rollout"], labels=[0, 1]), ValueError, "labels has 2 entries"),
    (dict(methods=["rollout", "encdec_rollout"]), ValueError, "'encdec_rollout' cannot explain this model"),
    (dict(methods=["decompx"], method_options={"decompx": {"start_layer": 9}}), ValueError,
     r"'decompx' with start_layer=9 cannot explain this model: .*start_layer must be in \[0, \d+\], got 9"),
])
def test_errors(data, kwargs, err, words):
    model, x, _, _ = data
    with pytest.raises(err, match=words):
        evaluate_methods(model, x, **kwargs)


def test_bad_pixel_values(data):
    model = data[0]
    with pytest.raises(ValueError, match="B = 0"):
        evaluate_methods(model, torch.zeros(0, 3, 64, 64), ["rollout"])
    with pytest.raises(ValueError, match="float"):
        evaluate_methods(model, torch.zeros(2, 64, 64), ["rollout"])


def test_text_inputs_get_the_aopc_metrics():
    T = pytest.importorskip("transformers")
    from attnroll.evaluate import comprehensiveness, sufficiency

    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=37, max_position_embeddings=32, num_labels=3, initializer_range=0.3)
    model = T.BertForSequenceClassification(cfg).eval()
    ids = torch.tensor([[2, 7, 8, 9, 10, 3], [2, 11, 12, 3, 0, 0], [2, 13, 14, 15, 3, 0]])
    am = (ids != 0).long()
    keep = (ids == 2) | (ids == 3)
    enc = {"input_ids": ids, "attention_mask": am}
    r = evaluate_methods(model, enc, ["rollout", "random"], keep=keep, bins=(0.25, 0.5), batch_size=2)
    assert r.metrics == ["comprehensiveness", "sufficiency"]
    for m in ("rollout", "random"):
        s = explain(model, enc, m).scores
        c = comprehensiveness(model, enc, s, keep=keep, bins=(0.25, 0.5))
        assert r.values[m]["comprehensiveness"] == pytest.approx(c.value, abs=1e-6)
        assert r.values[m]["sufficiency"] == pytest.approx(
            sufficiency(model, enc, s, keep=keep, bins=(0.25, 0.5)).value, abs=1e-6)
        assert np.allclose(r.curves[m]["comprehensiveness"][0], [0.25, 0.5])
    with pytest.raises(ValueError, match="do not apply to a text classifier"):
        evaluate_methods(model, enc, ["rollout"], metrics=["deletion"])
