"""Prefix, suffix and grid from the model's embeddings (never from counting tokens): YOLOS's detection
tokens at the end, AST's two prefix tokens and spectrogram grid, ViTMAE's shuffled patches put back in
order, VisionEncoderDecoder's encoder. References: the model's own eager attentions and hand-worked grids."""

from __future__ import annotations

import copy

import pytest
import torch

import attnroll

from .helpers import snapshot

T = pytest.importorskip("transformers")

C = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37)
V = dict(image_size=32, patch_size=8, num_channels=3)


def eager(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref.eval()


def test_yolos_detection_tokens_are_a_suffix_not_a_prefix():
    torch.manual_seed(0)
    model = T.YolosForObjectDetection(T.YolosConfig(**C, image_size=[32, 32], patch_size=8,
                                                    num_detection_tokens=3)).eval()
    x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    before = snapshot(model)
    e = attnroll.explain(model, x, "rollout")
    assert snapshot(model) == before
    assert (e.prefix, e.suffix, e.grid, e.scores.shape) == (1, 3, (4, 4), (2, 16))  # 1 + 16 + 3 = 20 tokens
    with torch.no_grad():
        atts = eager(model)(**x, output_attentions=True).attentions
    full = attnroll.rollout(atts)  # (B, 20, 20)
    expect = full[:, 17:].mean(dim=1)  # default: the detection tokens' rows
    torch.testing.assert_close(e.full_row, expect, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(e.scores, expect[:, 1:17], atol=1e-5, rtol=1e-4)
    one = attnroll.explain(model, x, "rollout", position=18)  # one object's token
    torch.testing.assert_close(one.full_row, full[:, 18], atol=1e-5, rtol=1e-4)


def test_ast_prefix_and_spectrogram_grid():
    torch.manual_seed(0)
    cfg = T.ASTConfig(**C, patch_size=8, num_mel_bins=32, max_length=48, frequency_stride=8, time_stride=8)
    model = T.ASTForAudioClassification(cfg).eval()
    x = {"input_values": torch.randn(2, 48, 32)}
    rec = attnroll.capture(model, x)
    info = rec.info["self"]
    # frequency (32 - 8) // 8 + 1 = 4 rows, time (48 - 8) // 8 + 1 = 6 columns; CLS + distillation before them.
    assert (info.prefix, info.suffix, info.grid) == (2, 0, (4, 6))
    assert info.readout.weights[0, :3].tolist() == [0.5, 0.5, 0.0]  # the pooler averages tokens 0 and 1
    with torch.no_grad():
        expect = eager(model)(**x, output_attentions=True).attentions
    for got, ref in zip(rec.attentions, expect):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    e = attnroll.explain(model, x)
    assert e.scores.shape == (2, 24) and e.as_grid().shape == (2, 4, 6)


def test_vit_mae_shuffled_patches_are_put_back_in_patch_order():
    """With mask_ratio 0 every patch is kept but shuffled by random noise; the record must equal the
    capture of a run whose noise keeps the patches in order (an identity shuffle)."""
    torch.manual_seed(0)
    model = T.ViTMAEModel(T.ViTMAEConfig(**C, **V, mask_ratio=0.0)).eval()
    px = torch.randn(2, 3, 32, 32)
    rec = attnroll.capture(model, {"pixel_values": px, "noise": torch.rand(2, 16)})
    ordered = attnroll.capture(model, {"pixel_values": px, "noise": torch.arange(16.0).expand(2, 16)})
    assert rec.grid == (4, 4) and rec.prefix == 1
    for got, ref in zip(rec.attentions, ordered.attentions):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_vit_mae_with_masking_has_no_grid_and_says_why():
    torch.manual_seed(0)
    model = T.ViTMAEModel(T.ViTMAEConfig(**C, **V, mask_ratio=0.75)).eval()
    rec = attnroll.capture(model, {"pixel_values": torch.randn(1, 3, 32, 32)})
    info = rec.info["self"]
    assert info.grid is None and "mask_ratio" in info.grid_reason and info.prefix == 1
    assert "mask_ratio" in info.units_reason
    # The kept tokens are a random subset in a random order: no map can be labelled with them.
    with pytest.raises(attnroll.UnsupportedModelError, match="mask_ratio = 0.0"):
        attnroll.explain(model, {"pixel_values": torch.randn(1, 3, 32, 32)})


def test_vision_encoder_decoder_encoder_stream_has_its_prefix_and_grid():
    torch.manual_seed(0)
    enc = T.ViTModel(T.ViTConfig(**C, **V))
    dec = T.BertLMHeadModel(T.BertConfig(**C, vocab_size=99, is_decoder=True, add_cross_attention=True))
    model = T.VisionEncoderDecoderModel(encoder=enc, decoder=dec).eval()
    rec = attnroll.capture(model, {"pixel_values": torch.randn(2, 3, 32, 32),
                                   "decoder_input_ids": torch.randint(3, 99, (2, 5))})
    e, d = rec.info["encoder"], rec.info["decoder"]
    assert (e.kind, e.prefix, e.grid) == ("image", 1, (4, 4)) and e.readout.kind == "cls"
    assert d.causal and d.readout.kind == "last" and d.grid is None


def test_vision_language_models_not_composed_are_refused_with_the_reason():
    # LLaVA, PaliGemma and the families of capture/vlm_maps.py are composed (tests/capture/test_vlm*.py);
    # LLaVA-NeXT-Video pools its video frames, so it is one of the VLMs refused with the reason.
    torch.manual_seed(0)
    cfg = T.LlavaNextVideoConfig(
        vision_config=T.CLIPVisionConfig(**C, **V),
        text_config=T.LlamaConfig(**C, vocab_size=99, max_position_embeddings=64, num_key_value_heads=2),
        image_token_index=98, video_token_index=97,
    )
    model = T.LlavaNextVideoForConditionalGeneration(cfg).eval()
    before = snapshot(model)
    with pytest.raises(attnroll.UnsupportedModelError, match="vision-language model"):
        attnroll.capture(model, {"input_ids": torch.randint(3, 90, (1, 6))})
    assert snapshot(model) == before


def test_spatial_reduction_attention_is_refused_and_no_class_token_reads_the_mean():
    """SegFormer's keys are spatially reduced and its stages change the token count: refused, with the reason.
    I-JEPA has no class token: its default readout is the mean of the patch rows (what its classifier pools)."""
    torch.manual_seed(0)
    seg = T.SegformerModel(T.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                             hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                                             patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])).eval()
    before = snapshot(seg)
    with pytest.raises(attnroll.UnsupportedModelError, match="different token counts"):
        attnroll.capture(seg, {"pixel_values": torch.randn(1, 3, 32, 32)})
    assert snapshot(seg) == before
    ijepa = T.IJepaForImageClassification(T.IJepaConfig(**C, **V, num_labels=3)).eval()
    x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    e = attnroll.explain(ijepa, x, "rollout")
    assert e.prefix == 0 and e.grid == (4, 4) and e.readout["kind"] == "mean"
    with torch.no_grad():
        atts = eager(ijepa)(**x, output_attentions=True).attentions
    torch.testing.assert_close(e.full_row, attnroll.rollout(atts).mean(dim=1), atol=1e-5, rtol=1e-4)
