"""``alti`` through ``explain`` on each of its two kernels: the fused numba kernel (what runs when numba is
installed) and the torch kernel (what runs without it, forced here by hiding numba), both against the naive
computation from the weights in ``value_aware_reference`` on tiny float64 BERT, ViT, GPT-2 and Llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll
from attnroll.core import alti_kernel

from . import value_aware_reference as R

pytest.importorskip("transformers")


def _kernel(monkeypatch, kernel):
    """Make ``explain`` run ALTI on ``kernel`` and count the fused kernel's calls."""
    if kernel == "fused" and not alti_kernel.available():
        pytest.skip("the fused kernel needs numba (the 'fast' extra)")
    if kernel == "torch":
        monkeypatch.setattr(alti_kernel, "available", lambda: False)
    calls = []
    fused = alti_kernel.contributions
    monkeypatch.setattr(alti_kernel, "contributions", lambda *a: calls.append(1) or fused(*a))
    return calls


@pytest.mark.parametrize("kernel", ["fused", "torch"])
@pytest.mark.parametrize("kind", ["bert", "vit", "gpt2", "llama"])
def test_alti_equals_the_naive_computation_on_each_kernel(kind, kernel, monkeypatch):
    calls = _kernel(monkeypatch, kernel)
    m, x = R.build(kind), R.inputs_for(kind)
    S = R.spec(m, kind)
    xs, alphas, _ = R.model_states(m, x)
    e = attnroll.explain(m, x, "alti")
    assert len(calls) == (len(S["layers"]) if kernel == "fused" else 0)
    row = 0 if S["readout"] == "first" else xs[0].shape[1] - 1
    for b in range(2):
        want = R.rolled("alti", S, xs, alphas, b, row)
        np.testing.assert_allclose(e.full_row[b].double().numpy(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_alti_padded_batch_equals_cropped_on_each_kernel(kernel, monkeypatch):
    _kernel(monkeypatch, kernel)
    m = R.build("bert")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    e = attnroll.explain(m, {"input_ids": ids, "attention_mask": mask}, "alti")
    alone = attnroll.explain(m, {"input_ids": ids[1:, :4]}, "alti")
    assert torch.isfinite(e.full_row).all()
    torch.testing.assert_close(e.full_row[1, :4], alone.full_row[0], atol=1e-5, rtol=1e-5)
    assert torch.all(e.full_row[1, 4:] == 0)
