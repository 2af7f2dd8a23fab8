"""Small contract items that came with the VLM work: timm global_pool='avgmax' has no default readout (the
exact reason is given) and explains its mean half with readout='mean'."""

from __future__ import annotations

import pytest
import torch

import attnroll

timm = pytest.importorskip("timm")

SMALL = dict(pretrained=False, depth=2, embed_dim=32, num_heads=4, num_classes=3, img_size=32, patch_size=8)


def test_timm_avgmax_pool_is_refused_as_a_default_and_its_mean_half_equals_avg_pooling():
    torch.manual_seed(0)
    avgmax = timm.create_model("vit_tiny_patch16_224", global_pool="avgmax", **SMALL).eval()
    avg = timm.create_model("vit_tiny_patch16_224", global_pool="avg", **SMALL).eval()
    avg.load_state_dict(avgmax.state_dict())  # same weights: only the pooling after the blocks differs
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"avgmax.*½\(mean \+ max\).*readout='mean'"):
        attnroll.explain(avgmax, x)
    half = attnroll.explain(avgmax, x, readout="mean")
    assert half.readout["kind"] == "mean"
    torch.testing.assert_close(half.scores, attnroll.explain(avg, x).scores)
