"""Metrics run models in eval mode and give each submodule its own train/eval flag back: a model
left in train() mode with dropout on gives the same numbers on every call, and the numbers of the same model
in eval mode."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from attnroll.evaluate import perturbation as P
from attnroll.evaluate import suite
from attnroll.evaluate import text as TX

T = pytest.importorskip("transformers")


def _mixed_train(m):
    """train() with one submodule kept in eval, as a caller might (model.train() on exit would flip it)."""
    m.train()
    list(m.children())[-1].eval()  # the head: a leaf, dropout stays on elsewhere
    return [(sub, sub.training) for sub in m.modules()]


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, num_labels=3, hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5)
    return T.ViTForImageClassification(cfg)


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=37, num_labels=2, hidden_dropout_prob=0.5, max_position_embeddings=32)
    return T.BertForSequenceClassification(cfg)


IMAGE_METRICS = {
    "deletion": lambda m, x, s: P.deletion(m, x, s, steps=4).per_example,
    "insertion": lambda m, x, s: P.insertion(m, x, s, steps=4).per_example,
    "positive": lambda m, x, s: P.positive_perturbation(m, x, s).per_example,
    "negative": lambda m, x, s: P.negative_perturbation(m, x, s).per_example,
    "curve": lambda m, x, s: P.perturbation_curve(m, x, s, [0, 3, 8]).probs,
    "suite": lambda m, x, s: np.array([suite.evaluate_methods(m, x, ["raw", "random"], metrics=["deletion"],
                                                              steps=4).values[k]["deletion"] for k in ("raw", "random")]),
}


@pytest.mark.parametrize("metric", list(IMAGE_METRICS))
def test_image_metrics_run_in_eval_mode_and_restore_each_flag(vit, metric):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, 32, 32, generator=g)
    scores = torch.rand(3, 16, generator=g)
    m = copy.deepcopy(vit)
    flags = _mixed_train(m)
    first = IMAGE_METRICS[metric](m, x, scores)
    assert [(s, s.training) for s in m.modules()] == flags
    second = IMAGE_METRICS[metric](m, x, scores)
    reference = IMAGE_METRICS[metric](copy.deepcopy(vit).eval(), x, scores)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    np.testing.assert_allclose(np.asarray(first), np.asarray(reference), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fn", [TX.comprehensiveness, TX.sufficiency], ids=["comprehensiveness", "sufficiency"])
def test_text_aopc_runs_in_eval_mode_and_restores_each_flag(bert, fn):
    g = torch.Generator().manual_seed(2)
    inputs = {"input_ids": torch.randint(5, 99, (3, 8), generator=g), "attention_mask": torch.ones(3, 8, dtype=torch.long)}
    scores = torch.rand(3, 8, generator=g)
    m = copy.deepcopy(bert)
    flags = _mixed_train(m)
    first = fn(m, inputs, scores).per_example
    assert [(s, s.training) for s in m.modules()] == flags
    np.testing.assert_array_equal(first, fn(m, inputs, scores).per_example)
    np.testing.assert_allclose(first, fn(copy.deepcopy(bert).eval(), inputs, scores).per_example, rtol=1e-6)


def test_flags_are_restored_when_the_metric_raises(vit):
    m = copy.deepcopy(vit)
    flags = _mixed_train(m)
    with pytest.raises(ValueError):
        P.deletion(m, torch.randn(2, 3, 32, 32), torch.rand(3, 16))  # 3 maps for 2 images
    assert [(s, s.training) for s in m.modules()] == flags
