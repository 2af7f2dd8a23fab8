"""Models that were read wrongly without an error, each on a tiny random-weight config, compared with the
model's own attention and outputs: now read right, or refused with the family's obstacle."""

from __future__ import annotations

import functools

import pytest
import torch

import attnroll
from attnroll import UnsupportedModelError

from .test_layouts import _alone

T = pytest.importorskip("transformers")

C = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37)
V = dict(image_size=32, patch_size=8, num_channels=3)
TX = dict(vocab_size=99, max_position_embeddings=64)


def _build(make):
    torch.manual_seed(0)
    try:
        return make().eval()
    except (AttributeError, ImportError, OSError, TypeError, ValueError) as e:  # class absent or not offline
        pytest.skip(f"cannot build offline: {type(e).__name__}: {e}")


def _dual(config_name: str, model_name: str, **extra):
    cfg = getattr(T, config_name)
    return lambda: getattr(T, model_name)(cfg(text_config=dict(**C, **TX, bos_token_id=0, eos_token_id=2),
                                              vision_config=dict(**C, **V), **extra))


DUAL = {
    "clip": _dual("CLIPConfig", "CLIPModel", projection_dim=16),
    "siglip": lambda: T.SiglipModel(T.SiglipConfig(text_config=dict(**C, **TX), vision_config=dict(**C, **V))),
    "metaclip_2": _dual("MetaClip2Config", "MetaClip2Model", projection_dim=16),
    "owlv2": _dual("Owlv2Config", "Owlv2Model", projection_dim=16),
}


def _pair(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "input_ids": torch.randint(3, 99, (2, 7), generator=g)}


# ----------------------------------------------------------------------------------- dual towers, stream=
@pytest.mark.parametrize("name", list(DUAL))
@pytest.mark.parametrize("stream", ["vision", "text"])
def test_dual_tower_stream_on_the_matrix_free_route_equals_dense(name, stream):
    model = _build(DUAL[name])
    x = _pair()
    auto = attnroll.explain(model, x, "rollout", stream=stream)
    dense = attnroll.explain(model, x, "rollout", stream=stream, attention="dense")
    assert auto.options["attention"] == "recompute"
    torch.testing.assert_close(auto.scores, dense.scores, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(auto.readout_weights.float(), dense.readout_weights.float())
    if stream == "vision":
        assert auto.grid == (4, 4)


@pytest.mark.parametrize("name", ["metaclip_2", "owlv2"])
def test_clip_like_text_towers_read_the_token_they_pool(name):
    """The readout is the token whose hidden state the text tower returns as its pooled output."""
    model = _build(DUAL[name])
    x = _pair(1)
    x["input_ids"][0, 4] = 2  # an end-of-text token (eos id 2) in example 0
    e = attnroll.explain(model, x, "rollout", stream="text")
    pos = e.readout_weights.argmax(dim=-1)
    with torch.no_grad():
        t = model.text_model(input_ids=x["input_ids"])
    torch.testing.assert_close(t.pooler_output, t.last_hidden_state[torch.arange(2), pos])


# ------------------------------------------------------------------------------------------------ ViTMAE
def _mae(ratio: float):
    return _build(lambda: T.ViTMAEModel(T.ViTMAEConfig(**C, **V, mask_ratio=ratio, initializer_range=0.3)))


def _noise(shuffled: bool) -> torch.Tensor:
    return torch.rand(2, 16, generator=torch.Generator().manual_seed(5)) if shuffled else torch.arange(16.0).expand(2, 16)


@pytest.mark.parametrize("kw", [{}, {"attention": "dense"}, {"head_fusion": "mean", "attention": "dense"},
                                {"head_fusion": "max"}])
def test_vit_mae_map_is_in_patch_order_on_every_route(kw):
    """A shuffling forward explains as a forward that keeps the patches in order (identity noise)."""
    model = _mae(0.0)
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    got = attnroll.explain(model, {"pixel_values": px, "noise": _noise(True)}, "rollout", **kw)
    ref = attnroll.explain(model, {"pixel_values": px, "noise": _noise(False)}, "rollout", **kw)
    assert got.grid == (4, 4)
    torch.testing.assert_close(got.scores, ref.scores, atol=1e-6, rtol=1e-5)


def test_vit_mae_gradients_are_put_in_patch_order_too():
    model = _mae(0.0).double()
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = []
    for shuffled in (True, False):
        rec = attnroll.capture(model, {"pixel_values": px, "noise": _noise(shuffled).double()}, keep_grad=True)
        rec.outputs.last_hidden_state.pow(3).sum().backward()  # (order-invariant)
        grads.append(rec.gradients())
        assert rec.info["self"].grid == (4, 4) and not rec.info["self"].units_reason
    for got, ref in zip(*grads):  # (ViTMAE's position table is float32: 1e-7 differences between the orders)
        scale = ref.abs().max().item()
        assert scale > 1.0
        torch.testing.assert_close(got, ref, atol=1e-5 * scale, rtol=0)


def test_vit_mae_recompute_and_masking_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="shuffles its patches"):
        attnroll.explain(_mae(0.0), {"pixel_values": torch.randn(1, 3, 32, 32)}, "rollout", attention="recompute")
    with pytest.raises(UnsupportedModelError, match="random subset"):
        attnroll.explain(_mae(0.5), {"pixel_values": torch.randn(1, 3, 32, 32)}, "rollout")


# ------------------------------------------------------------------------------- refused transformers families
def test_vilt_is_refused_naming_its_token_layout():
    model = _build(lambda: T.ViltModel(T.ViltConfig(**C, **TX, image_size=32, patch_size=8)))
    x = {"input_ids": torch.randint(3, 99, (1, 5)), "pixel_values": torch.randn(1, 3, 32, 32)}
    for kw in ({}, {"attention": "dense"}):
        with pytest.raises(UnsupportedModelError, match="random order"):
            attnroll.explain(model, x, "rollout", **kw)


def test_diffllama_rollout_is_refused_naming_differential_attention():
    # its signed matrices are captured (tests/capture/test_diffllama.py); rollout of probabilities refuses them
    model = _build(lambda: T.DiffLlamaForCausalLM(T.DiffLlamaConfig(**C, **TX, num_key_value_heads=2)))
    for kw in ({}, {"attention": "dense"}, {"attention": "recompute"}):
        with pytest.raises(ValueError, match="differential attention"):
            attnroll.explain(model, {"input_ids": torch.randint(3, 99, (1, 6))}, "rollout", **kw)


# ----------------------------------------------------------------------------------------------- TimesFM
def _timesfm():
    cfg = dict(patch_length=4, context_length=32, horizon_length=8, hidden_size=32, intermediate_size=32, head_dim=8,
               num_attention_heads=4, num_hidden_layers=2)
    return _build(lambda: T.TimesFmModelForPrediction(T.TimesFmConfig(**cfg)))


def test_timesfm_is_causal_and_read_from_its_last_patch():
    """TimesFM predicts from its last position (causal attention; its config says nothing of a decoder, and
    its left-padded query rows attend everywhere, so the matrices alone do not show causality)."""
    model = _timesfm()
    x = {"past_values": [torch.randn(32), torch.randn(20)]}
    rec = attnroll.capture(model, x)
    info = rec.info["self"]
    n = rec.stream_shape("self")[-1]
    assert info.causal and info.readout.kind == "last"
    assert info.readout.weights.argmax(dim=-1).tolist() == [n - 1, n - 1]
    auto = attnroll.explain(model, x, "rollout")
    dense = attnroll.explain(model, x, "rollout", attention="dense")
    assert auto.options["attention"] == "recompute"
    torch.testing.assert_close(auto.scores, dense.scores, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(auto.readout_weights.float(), dense.readout_weights.float())


# ------------------------------------------------------------------------------ decorated attention kernels
def _plain_decorator(fn):
    def wrapper(*args, **kwargs):  # no functools.wraps: the signature is (*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _wraps_decorator(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("decorator", [_plain_decorator, _wraps_decorator])
@pytest.mark.parametrize("method", ["rollout", "gae"])
def test_decorated_attention_kernel_is_recorded(decorator, method):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = f"attnroll_test_{decorator.__name__}"
    AttentionInterface.register(name, decorator(sdpa_attention_forward))
    model = _build(lambda: T.LlamaForCausalLM(T.LlamaConfig(**C, **TX, num_key_value_heads=2)))
    model.set_attn_implementation(name)
    x = {"input_ids": torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))}
    got = attnroll.explain(model, x, method, attention="recompute")
    ref = attnroll.explain(model, x, method, attention="dense")
    torch.testing.assert_close(got.scores, ref.scores, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------ timm refusals
timm = pytest.importorskip("timm")


def test_timm_volo_is_refused_naming_outlook_and_class_attention():
    from timm.models.volo import VOLO

    model = _build(lambda: VOLO(layers=(1, 1, 1, 1), img_size=64, num_classes=3, embed_dims=(32, 64, 64, 64),
                                num_heads=(2, 4, 4, 4), stem_hidden_dim=16))
    with pytest.raises(UnsupportedModelError, match="outlook attention"):
        attnroll.explain(model, torch.randn(1, 3, 64, 64), "rollout")


def test_timm_maxvit_is_refused_naming_windows_and_grids():
    model = _build(lambda: timm.create_model("maxvit_nano_rw_256", pretrained=False, img_size=64, num_classes=3,
                                             embed_dim=(32, 32, 32, 32), depths=(1, 1, 1, 1), stem_width=16))
    with pytest.raises(UnsupportedModelError, match="windows"):
        attnroll.explain(model, torch.randn(1, 3, 64, 64), "rollout")


def test_windows_read_as_the_batch_are_refused():
    """A timm ViT whose attention runs on windows (each window a row of the batch axis) is refused, whatever
    the model class: here a ViT whose blocks see 4 windows of each image."""
    from timm.models.vision_transformer import VisionTransformer

    model = _build(lambda: VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                             num_classes=3, class_token=False, global_pool="avg"))

    def windows(x):  # (B, 16, C) -> (4B, 4, C): 2x2 windows of the 4x4 grid, batch-major
        B, N, D = x.shape
        return x.reshape(B, 2, 2, 2, 2, D).permute(0, 1, 3, 2, 4, 5).reshape(B * 4, 4, D)

    def unwindows(x):
        B = x.shape[0] // 4
        return x.reshape(B, 2, 2, 2, 2, -1).permute(0, 1, 3, 2, 4, 5).reshape(B, 16, -1)

    for blk in model.blocks:
        attn = blk.attn
        forward = attn.forward
        attn.forward = lambda x, *a, f=forward, **k: unwindows(f(windows(x), *a, **k))
    with pytest.raises(UnsupportedModelError, match="batch axis"):
        attnroll.explain(model, torch.randn(2, 3, 32, 32), "rollout")


# ------------------------------------------------------------------- more families: batch equals alone
MORE = {
    "vit_mae": lambda: T.ViTMAEModel(T.ViTMAEConfig(**C, **V, mask_ratio=0.0)),
    "siglip": DUAL["siglip"],
    "owlv2": DUAL["owlv2"],
    "metaclip_2": DUAL["metaclip_2"],
}


@pytest.mark.parametrize("name", list(MORE))
def test_more_families_read_each_example_as_alone(name):
    model = _build(MORE[name])
    x = _pair(4) if name != "vit_mae" else {"pixel_values": torch.randn(2, 3, 32, 32)}
    streams = ["vision", "text"] if "input_ids" in x else [None]
    for stream in streams:
        kw = {} if stream is None else {"stream": stream}
        batch = attnroll.explain(model, x, "rollout", **kw)
        for b in range(2):
            alone = attnroll.explain(model, _alone(x, b), "rollout", **kw)
            torch.testing.assert_close(batch.full_row[b], alone.full_row[0], atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------- causality and the batch axis
def test_causal_by_mask_alone_reads_the_last_token_on_both_routes():
    """Doge's attention modules carry no causal flag; only its mask is causal (as its matrices show): both
    routes read the last real token."""
    model = _build(lambda: T.DogeModel(T.DogeConfig(**C, **TX, num_key_value_heads=2)))
    x = {"input_ids": torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0)),
         "attention_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2])}
    auto = attnroll.explain(model, x, "rollout")
    dense = attnroll.explain(model, x, "rollout", attention="dense")
    assert auto.options["attention"] == "recompute"
    assert auto.readout_weights.argmax(dim=-1).tolist() == [6, 4]
    torch.testing.assert_close(auto.readout_weights.float(), dense.readout_weights.float())
    torch.testing.assert_close(auto.scores, dense.scores, atol=1e-5, rtol=1e-4)


def test_images_packed_into_one_sequence_are_refused():
    """Pixtral's vision tower packs every image of the batch into one sequence (batch axis 1)."""
    model = _build(lambda: T.PixtralVisionModel(T.PixtralVisionConfig(**C, image_size=32, patch_size=8, head_dim=8)))
    with pytest.raises(UnsupportedModelError, match="packed into one sequence"):
        attnroll.explain(model, {"pixel_values": torch.randn(2, 3, 32, 32)}, "rollout")


@pytest.mark.parametrize("method", ["gae", "grad_rollout", "raw"])
def test_clip_vision_stream_by_gradient_methods_on_the_matrix_free_route(method):
    model = _build(DUAL["clip"])
    x = _pair(2)
    target = None if method == "raw" else (lambda o: o.logits_per_image.diagonal())
    auto = attnroll.explain(model, x, method, stream="vision", target=target)
    dense = attnroll.explain(model, x, method, stream="vision", target=target, attention="dense")
    assert auto.options["attention"] == "recompute"
    torch.testing.assert_close(auto.scores, dense.scores, atol=1e-5, rtol=1e-4)


def test_channels_as_the_batch_are_refused():
    """PatchTST attends over each channel's patches separately (batch axis B x channels)."""
    cfg = dict(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=32,
               num_attention_heads=4, num_hidden_layers=2, ffn_dim=37, prediction_length=8)
    model = _build(lambda: T.PatchTSTForPrediction(T.PatchTSTConfig(**cfg)))
    for kw in ({}, {"attention": "dense"}):
        with pytest.raises(UnsupportedModelError, match="channels as rows of the batch axis"):
            attnroll.explain(model, {"past_values": torch.randn(2, 32, 3)}, "rollout", **kw)


@pytest.mark.parametrize("method", ["grad_rollout", "gae", "attn_gradcam", "saliency"])
def test_vit_mae_gradient_maps_are_in_patch_order(method):
    model = _mae(0.0)
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))

    def target(o):  # the same for any order of the tokens
        return (o.last_hidden_state[:, :, :4] * torch.arange(1.0, 5.0)).sum((1, 2))

    got = attnroll.explain(model, {"pixel_values": px, "noise": _noise(True)}, method, target=target)
    ref = attnroll.explain(model, {"pixel_values": px, "noise": _noise(False)}, method, target=target)
    scale = ref.scores.abs().max().item()
    assert scale > 1e-3
    torch.testing.assert_close(got.scores, ref.scores, atol=1e-5 * scale, rtol=0)


def test_vit_mae_value_aware_methods_are_refused_naming_the_shuffle():
    model = _mae(0.0)
    with pytest.raises(UnsupportedModelError, match="shuffled order"):
        attnroll.explain(model, {"pixel_values": torch.randn(1, 3, 32, 32)}, "norm",
                         target=lambda o: o.last_hidden_state.sum((1, 2)))


def test_kernel_causality_is_read_from_boolean_and_additive_masks():
    from attnroll.capture.recompute import kernel_causal
    from attnroll.core.operators import KernelInputs

    q = torch.randn(2, 4, 5, 8)
    causal = torch.ones(5, 5).tril().bool().expand(2, 1, 5, 5)
    padded = causal.clone()
    padded[1, :, :, 3:] = False  # padding on top of causality
    full = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~causal, torch.finfo(torch.float32).min)

    def layer(mask):
        return KernelInputs(q=q, k=q, scaling=0.35, mask=mask, causal=False)

    assert kernel_causal(layer(causal)) and kernel_causal(layer(padded)) and kernel_causal(layer(additive))
    assert not kernel_causal(layer(full)) and not kernel_causal(layer(torch.zeros(2, 1, 5, 5)))
    assert not kernel_causal(layer(None)) and kernel_causal(KernelInputs(q=q, k=q, scaling=0.35, causal=True))
