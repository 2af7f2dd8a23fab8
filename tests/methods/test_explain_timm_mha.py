"""explain() on the two non-transformers families: a timm ViT (distilled: 2 prefix tokens) and a classifier
built on nn.TransformerEncoder. The capture of each is verified against a manual softmax in tests/capture;
here the methods' composition is checked against the core functions and against autograd on the captured
per-head tensors."""

from __future__ import annotations

import pytest
import torch

import attnroll

from ..zoo import TIMM_SMALL, EncoderClassifier
from .test_explain import gae_reference


def check_model(model, x, prefix, target, rows=(0,)):
    """``rows``: the output rows the model's prediction reads (their mean is the expected map)."""
    rec = attnroll.capture(model, x)
    e = attnroll.explain(model, x, "rollout")
    R = attnroll.rollout(rec.attentions, rows=list(rows), protect_prefix=max(prefix, 1)).mean(dim=1)
    torch.testing.assert_close(torch.as_tensor(e.full_row), R, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.as_tensor(e.scores), R[:, prefix:], atol=1e-6, rtol=0)
    assert e.prefix == prefix

    g = attnroll.explain(model, x, "gae", target=target)
    with attnroll.capture(model, keep_grad=True) as rec2:  # keep_grad: the per-head tensors are in the graph
        logits = model(x)
    y = logits[torch.arange(len(target)), torch.as_tensor(target)]
    grads = torch.autograd.grad(y.sum(), rec2.attentions)
    expected = sum(gae_reference([a.detach() for a in rec2.attentions], grads, r) for r in rows) / len(rows)
    torch.testing.assert_close(torch.as_tensor(g.full_row), expected, atol=1e-5, rtol=1e-4)
    other = attnroll.explain(model, x, "gae", target=[(t + 1) % logits.shape[-1] for t in target])
    assert not torch.allclose(torch.as_tensor(other.full_row), torch.as_tensor(g.full_row))


def test_timm_distilled_deit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_distilled_patch16_224", **TIMM_SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    # Its logits average the class and distillation tokens' heads: the readout is the mean of rows 0 and 1.
    check_model(model, x, prefix=2, target=[0, 2], rows=(0, 1))
    assert attnroll.explain(model, x, "rollout").as_grid().shape == (2, 4, 4)


def test_torch_transformer_encoder_classifier():
    torch.manual_seed(0)
    model = EncoderClassifier().eval()
    ids = torch.randint(0, 20, (2, 7))
    check_model(model, ids, prefix=0, target=[1, 0])
