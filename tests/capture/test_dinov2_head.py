"""DINOv2's image classifiers read [CLS ; mean of the patch rows] (registers left out): the readout must cover
exactly the rows the classifier reads, found here by perturbing one row of the final hidden states at a time
and watching the logits."""

from __future__ import annotations

import pytest
import torch

import attnroll

T = pytest.importorskip("transformers")


def _model(registers: bool):
    Model, Cfg = ((T.Dinov2WithRegistersForImageClassification, T.Dinov2WithRegistersConfig) if registers
                  else (T.Dinov2ForImageClassification, T.Dinov2Config))
    torch.manual_seed(0)
    cfg = Cfg(image_size=16, patch_size=8, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
              num_labels=3, **({"num_register_tokens": 2} if registers else {}))
    return Model(cfg).eval()


def _rows_the_classifier_reads(model, x: torch.Tensor, n: int) -> list[bool]:
    """Row i is read when a change of row i of the final layer norm's output changes the logits."""
    with torch.no_grad():
        base = model(pixel_values=x).logits
    read = []
    for i in range(n):
        def bump(mod, args, out, i=i):
            out = out.clone()
            out[:, i] += 1.0
            return out
        h = model.base_model.layernorm.register_forward_hook(bump)
        try:
            with torch.no_grad():
                read.append(not torch.allclose(model(pixel_values=x).logits, base))
        finally:
            h.remove()
    return read


@pytest.mark.parametrize("registers", [False, True])
@pytest.mark.parametrize("attention", [None, "dense"])
def test_the_readout_covers_exactly_the_rows_the_classifier_reads(registers, attention):
    model = _model(registers)
    x = torch.randn(2, 3, 16, 16)
    e = attnroll.explain(model, {"pixel_values": x}, "rollout", **({"attention": attention} if attention else {}))
    n = e.full_row.shape[-1]
    assert "[CLS ; mean of the patch rows]" in e.readout["source"]
    read = _rows_the_classifier_reads(model, x, n)
    rec = attnroll.capture(model, {"pixel_values": x})
    weights = rec.info["self"].readout.weights
    assert [bool(v > 0) for v in weights[0]] == read
    # half on CLS, half over the patches: the classifier's two halves
    assert float(weights[0, 0]) == pytest.approx(0.5) and float(weights[0, 1:].sum()) == pytest.approx(0.5)
