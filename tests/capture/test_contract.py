"""The contract downstream code reads: ModelFacts (no forward pass) and StreamInfo (per stream), checked
against what the models themselves say (their configs, modules and outputs)."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.capture import model_facts

from ..zoo import plain as M

timm = pytest.importorskip("timm")


def test_model_facts_of_a_text_model_an_image_model_timm_and_clip():
    bert = M.model("bert")
    f = model_facts(bert)
    assert (f.input_key, f.keyword_call) == ("input_ids", True)
    assert f.embedding is bert.get_input_embeddings() and f.pad_token_id == bert.config.pad_token_id
    assert bert.config.pad_token_id in f.special_token_ids
    vit = M.model("vit")
    assert model_facts(vit).input_key == "pixel_values"
    tm = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                           embed_dim=32, num_heads=4, num_classes=3)
    assert (model_facts(tm).input_key, model_facts(tm).keyword_call) == ("x", False)
    clip = M.model("clip").eval()
    x = M.inputs_for("clip")
    with torch.no_grad():
        out = clip(**x)
    assert torch.equal(model_facts(clip).similarity(out), out.logits_per_image)
    assert model_facts(bert).similarity is None


def test_stream_info_of_every_stream_kind():
    t5 = M.model("t5")
    x = M.inputs_for("t5")
    rec = attnroll.capture(t5, x)
    enc, dec, cross = rec.info["encoder"], rec.info["decoder"], rec.info["cross"]
    assert torch.equal(enc.mask, x["attention_mask"]) and enc.kind == "text" and not enc.causal
    assert dec.causal and dec.readout.kind == "last" and dec.mask is None
    assert cross.readout is None and rec.streams["cross"][0].shape[-2:] == (5, 7)
    vit = M.model("vit")
    info = attnroll.capture(vit, M.inputs_for("vit")).info["self"]
    assert (info.kind, info.prefix, info.suffix, info.grid, info.input_key) == ("image", 1, 0, (4, 4), "pixel_values")
    assert info.readout.kind == "cls" and info.units == slice(1, None)
