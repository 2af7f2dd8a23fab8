"""explain(rollout) on the embedded shapes ViT at the batch the batch-engine benchmark uses (B = 32, n = 65),
where the capture computes every layer's attention itself (``operators.attend_mean``), against a float64
rollout of the model's own eager attention (``output_attentions``), with the batch whole and in uneven
chunks of examples; and a Llama (causal, grouped KV heads) through the same path."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.capture import recompute
from attnroll.core import operators

from ..zoo import sharp
from .test_kept_buffers import naive_rollout, shapes_vit

inputs_for, model = sharp.inputs_for, sharp.model


def _counting_attend_mean(monkeypatch) -> list[tuple[int, ...]]:
    """Record the (B, H, n, n) shape of every layer the capture computes itself."""
    seen: list[tuple[int, ...]] = []
    inner = recompute.attend_mean

    def counted(layer, v):
        seen.append(tuple(layer.shape))
        return inner(layer, v)

    monkeypatch.setattr(recompute, "attend_mean", counted)
    return seen


@pytest.mark.parametrize("chunk", ["whole", "uneven"])
def test_shapes_vit_batch_of_32_equals_float64_eager_rollout(chunk, monkeypatch):
    """Every one of the four layers goes through ``attend_mean`` (whole: one chunk of 32; uneven: chunks of
    three, the last of two) and the rollout rows equal the float64 rollout of the eager attention."""
    m, _ = shapes_vit()
    m.eval()
    if chunk == "uneven":
        monkeypatch.setattr(operators, "CHUNK_ELEMENTS", 3 * 4 * 65 * 65)
    seen = _counting_attend_mean(monkeypatch)
    x = {"pixel_values": torch.randn(32, 3, 64, 64, generator=torch.Generator().manual_seed(7))}
    e = attnroll.explain(m, x, "rollout")
    assert seen == [(32, 4, 65, 65)] * 4
    torch.testing.assert_close(e.full_row.double(), naive_rollout(m, x, e.readout_weights), atol=1e-5, rtol=0)


def test_causal_grouped_llama_through_the_same_path(monkeypatch):
    """A tiny Llama (causal, 4 query heads on 2 KV heads), odd batch, one example per chunk: its layers go
    through ``attend_mean`` and the rollout equals the float64 rollout of its eager attention."""
    m = model("llama")
    monkeypatch.setattr(operators, "CHUNK_ELEMENTS", 1)
    seen = _counting_attend_mean(monkeypatch)
    x = inputs_for("llama", batch=3, n=9, seed=2, pad=False)
    e = attnroll.explain(m, x, "rollout")
    assert len(seen) == 2 and all(s == (3, 4, 9, 9) for s in seen)
    torch.testing.assert_close(e.full_row.double(), naive_rollout(m, x, e.readout_weights), atol=1e-5, rtol=0)
