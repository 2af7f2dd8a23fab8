"""explain(rollout) with the fused matrices in the thread's reused buffers (``operators.kept_buffers``):
each call against a naive float64 rollout written here from the model's own eager attention
(``output_attentions``), calls one after the other on different inputs (an earlier Explanation must not
change when a later call reuses the buffers), and the cases that keep no fused matrix at all."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.core import operators

from ..zoo import eager, sharp

inputs_for, model = sharp.inputs_for, sharp.model


def naive_rollout(m: torch.nn.Module, x: dict, weights: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """full_row[b] = w[b] · Π_l ((1 − α)·mean_h A_l + α·I), top layer first, in float64, from the eager
    copy's attention."""
    with torch.no_grad():
        atts = eager(m)(**x, output_attentions=True).attentions
    A = [a.double().mean(dim=1) for a in atts]
    eye = torch.eye(A[0].shape[-1], dtype=torch.float64)
    row = weights.double()[:, None, :]
    for a in reversed(A):
        row = row @ ((1 - alpha) * a + alpha * eye)
    return row[:, 0]


def shapes_vit() -> tuple[torch.nn.Module, callable]:
    from attnroll.models import load_model

    m = load_model(None, None, want="image").model
    return m, lambda seed: {"pixel_values": torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(seed))}


def tiny(name: str) -> tuple[torch.nn.Module, callable]:
    return model(name), lambda seed: inputs_for(name, batch=3, n=9, seed=seed, pad=False)


MODELS = {"shapes": shapes_vit, "vit": lambda: tiny("vit"), "bert": lambda: tiny("bert"), "llama": lambda: tiny("llama")}


@pytest.mark.parametrize("name", list(MODELS))
def test_calls_in_a_row_each_equal_the_naive_rollout(name):
    """Three calls on different inputs: each Explanation equals the naive rollout of its own inputs, also
    after the later calls have reused the buffers; the fused matrices did go through the buffers."""
    m, make = MODELS[name]()
    m.eval()
    got = [(attnroll.explain(m, make(seed), "rollout"), seed) for seed in range(3)]
    assert all(e.options["attention"] == "recompute" for e, _ in got)
    assert operators._ARENA.bufs  # the main thread's buffers hold this model's matrices
    for e, seed in got:
        want = naive_rollout(m, make(seed), e.readout_weights)
        torch.testing.assert_close(e.full_row.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("opts", [dict(return_layers=True), dict(alpha=0.3), dict(start_layer=1),
                                  dict(residual_mode="renorm"), dict(head_fusion="max")])
def test_other_options_agree_with_the_dense_route(opts):
    """Options that take the same route with other products (return_layers, another α, a start layer,
    renorm) or keep no fused matrix (max fusion) give what the dense route gives, before and after a
    call that filled the buffers with other values."""
    m, make = shapes_vit()
    for seed in (0, 1):
        attnroll.explain(m, make(seed + 10), "rollout")
        d = attnroll.explain(m, make(seed), "rollout", attention="dense", **opts)
        r = attnroll.explain(m, make(seed), "rollout", **opts)
        torch.testing.assert_close(r.full_row, d.full_row, atol=1e-5, rtol=0)
        if opts.get("return_layers"):
            torch.testing.assert_close(r.layers, d.layers, atol=1e-5, rtol=0)


def test_padding_keeps_its_own_path():
    """Padded BERT inputs (a mask tensor: no layer fused) equal the naive rollout restricted to real tokens
    through the dense route, with and without a call that filled the buffers in between."""
    m = model("bert")
    x = inputs_for("bert", batch=3, n=9, seed=4, pad=True)
    d = attnroll.explain(m, x, "rollout", attention="dense")
    attnroll.explain(m, inputs_for("bert", batch=3, n=9, seed=5, pad=False), "rollout")
    torch.testing.assert_close(attnroll.explain(m, x, "rollout").full_row, d.full_row, atol=1e-5, rtol=0)
