"""Bad input to capture / explain / Explanation, by class. References: the core functions on the
model's own captured attention, the same model without the condition (fully trainable, without the padded
example), hand-built files."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from torch import nn

import attnroll
from attnroll import viz
from attnroll.methods import method_info
from attnroll.explain.explanation import Explanation

from ..zoo import sharp

inputs_for, model = sharp.inputs_for, sharp.model

T = pytest.importorskip("transformers")


def forward_calls(m: nn.Module) -> list:
    """A list that grows by one each time m's forward starts."""
    calls: list = []
    m.register_forward_pre_hook(lambda mod, args: calls.append(1))
    return calls


class Classifier(nn.Module):
    """A token classifier on nn.TransformerEncoder that takes the padding mask under its own name: the
    attention of an example that is all padding is NaN (every key masked)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask):
        return self.head(self.enc(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)[:, 0])


# ------------------------------------------------------------------ adapter input checks, before the forward
BAD_INPUTS = [
    ([1, 2, 3], TypeError, r"inputs must be a dict .* got a list of length 3 whose item 0 is int"),
    ({"pixels": None}, ValueError, r"inputs .* keys \['pixels'\]: 'pixels' is not an argument .* Expected keys"),
    ("a photo", TypeError, r"inputs must be a dict .* got str"),
    (7, TypeError, r"inputs must be a dict .* got int"),
    ((), TypeError, r"inputs must be a dict .* empty"),
]


@pytest.mark.parametrize("name, key", [("vit", "pixel_values"), ("bert", "input_ids")])
@pytest.mark.parametrize("bad, exc, pattern", BAD_INPUTS, ids=["list-of-ints", "misspelt-key", "str", "int", "empty"])
def test_hf_inputs_are_checked_before_the_forward_and_name_the_expected_keys(name, key, bad, exc, pattern):
    m = model(name)
    calls = forward_calls(m)
    with pytest.raises(exc, match=pattern) as err:
        attnroll.explain(m, bad)
    assert key in str(err.value) and calls == []


def test_untensored_tokenizer_output_is_refused_with_the_fix():
    m = model("bert")
    calls = forward_calls(m)
    with pytest.raises(TypeError, match=r"inputs\['input_ids'\] .* must be a torch.Tensor .* got list .*return_tensors='pt'"):
        attnroll.explain(m, {"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 1]]})
    assert calls == []


def test_a_wrong_modality_key_names_the_right_one():
    m = model("vit")
    with pytest.raises(ValueError, match=r"'input_ids' is not an argument .* Expected keys: 'pixel_values'"):
        attnroll.capture(m, {"input_ids": torch.ones(1, 4, dtype=torch.long)})


@pytest.mark.parametrize("bad, pattern", [
    ({"source": torch.zeros(1, 3, 16)}, r"'source' is not an argument .* 'src' missing"),
    ({"src": torch.zeros(1, 3, 16), "pad": None}, r"'pad' is not an argument"),
    ([[0.0] * 16], r"item 0 is list"),
])
def test_modules_without_kwargs_refuse_unknown_and_missing_arguments(bad, pattern):
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 24, batch_first=True), 1, enable_nested_tensor=False)
    calls = forward_calls(enc)
    with pytest.raises((TypeError, ValueError), match=pattern):
        attnroll.capture(enc, bad)
    assert calls == []


@pytest.mark.parametrize("error", [AttributeError("x has no y"), KeyError("k"), IndexError("i"), ZeroDivisionError()])
def test_every_error_of_the_forward_gets_the_explanatory_note(error):
    m = Classifier()

    def boom(mod, args):
        raise error

    m.head.register_forward_pre_hook(boom)
    with pytest.raises(type(error)) as err:
        attnroll.capture(m, {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 4)})
    assert any("the forward pass of Classifier failed" in n for n in getattr(err.value, "__notes__", []))


def test_meta_device_model_and_inputs_are_refused_before_the_forward():
    with torch.device("meta"):
        meta = T.ViTForImageClassification(T.ViTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                       intermediate_size=8, image_size=16, patch_size=8))
    with pytest.raises(ValueError, match=r"'meta' device: it was built without its weights"):
        attnroll.explain(meta, {"pixel_values": torch.zeros(1, 3, 16, 16)})
    m = model("vit")
    calls = forward_calls(m)
    with pytest.raises(ValueError, match=r"inputs\['pixel_values'\] is on the 'meta' device"):
        attnroll.explain(m, {"pixel_values": torch.zeros(1, 3, 32, 32, device="meta")})
    assert calls == []


# ------------------------------------------------------------------ option values, before the forward
@pytest.mark.parametrize("method, options, exc, pattern", [
    ("rollout", {"alpha": "abc"}, TypeError, "alpha must be a real number"),
    ("rollout", {"alpha": 1.5}, ValueError, r"alpha must be in \[0.0, 1.0\]"),
    ("rollout", {"return_layers": "False"}, TypeError, "return_layers must be True or False"),
    ("raw", {"return_layers": 1}, TypeError, "return_layers must be True or False"),
    ("gae", {"return_layers": "no"}, TypeError, "return_layers must be True or False"),
    ("rollout", {"residual_mode": "sum"}, ValueError, "residual_mode must be one of"),
    ("rollout", {"top_k": 2.0}, TypeError, "top_k must be an integer"),
    ("rollout", {"head_fusion": np.array([0.5, -0.5, 0.5, 0.5])}, ValueError, "head_fusion weights must be finite, non-negative"),
    ("rollout", {"position": 1.5}, TypeError, "position must be an integer"),
    ("flow", {"n_jobs": 0}, ValueError, "n_jobs must be a positive number"),
    ("grad_rollout", {"clamp": "before"}, ValueError, "clamp must be one of"),
    ("integrated_gradients", {"n_steps": 0}, ValueError, r"n_steps must be in \[1, inf\]"),
])
def test_option_values_are_refused_before_the_model_runs(method, options, exc, pattern):
    m = model("vit")
    calls = forward_calls(m)
    with pytest.raises(exc, match=rf"method '{method}': {pattern}"):
        attnroll.explain(m, inputs_for("vit"), method, **options)
    with pytest.raises(exc, match=pattern):
        attnroll.Explainer(m, method, **options)
    assert calls == []


def test_targets_and_positions_in_any_integer_container_agree_and_floats_are_refused():
    m, x = model("vit"), inputs_for("vit")
    ref = attnroll.explain(m, x, "gae", target=[1, 0, 2], position=[0, 0, 0])
    for t, p in ((np.array([1, 0, 2]), np.array([0, 0, 0])), (torch.tensor([1, 0, 2]), (0, 0, 0)),
                 ([np.int64(1), 0, 2], np.int64(0))):
        got = attnroll.explain(m, x, "gae", target=t, position=p)
        torch.testing.assert_close(got.scores, ref.scores, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"target\[0\] must be an integer"):
        attnroll.explain(m, x, "gae", target=[1.0, 0, 2])
    with pytest.raises(TypeError, match="target must be None"):
        attnroll.explain(m, x, "gae", target=np.array([1.0, 0.0, 2.0]))
    with pytest.raises(TypeError, match=r"position\[1\] must be an integer"):
        attnroll.explain(m, x, "gae", position=[0, 0.5, 0])


@pytest.mark.parametrize("method", ["rollout", "raw", "flow"])
def test_head_weights_as_an_array_work_in_explain(method):
    m, x = model("vit"), inputs_for("vit")
    w = [0.1, 0.2, 0.3, 0.4]
    as_list = attnroll.explain(m, x, method, head_fusion=w)
    for given in (np.array(w), torch.tensor(w), tuple(w)):
        got = attnroll.explain(m, x, method, head_fusion=given)
        torch.testing.assert_close(got.scores, as_list.scores, rtol=1e-6, atol=1e-7)
    if method == "rollout":  # the reference: core rollout of the captured per-head attention
        rec = attnroll.capture(m, x)
        ref = attnroll.rollout(rec.attentions, head_fusion=w, rows=[0], protect_prefix=1)[:, 0]
        torch.testing.assert_close(as_list.full_row, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ partially frozen models, every gradient method
def _grad_cases():
    cases = []
    for name in attnroll.methods():
        if not method_info(name).needs_grad:
            continue
        fam = {"encdec_gae": "t5", "clip": "clip"}.get(name, "vit")
        cases.append((name, fam))
    return cases


@pytest.mark.parametrize("method, family", _grad_cases())
@pytest.mark.parametrize("trainable", ["head only", "nothing", "first layer only"])
def test_gradient_methods_work_on_partly_frozen_models(method, family, trainable):
    ref_model, x = model(family), inputs_for(family)
    if family == "clip":
        x = {**inputs_for("vit", batch=2), "input_ids": inputs_for("bert", batch=2, pad=False)["input_ids"]}
    ref = attnroll.explain(ref_model, x, method)  # every parameter trainable
    m = copy.deepcopy(ref_model)
    params = dict(m.named_parameters())
    for p in params.values():
        p.requires_grad_(False)
    head = [k for k in params if k.startswith(("classifier", "lm_head", "logit_scale", "text_projection"))]
    keep = {"head only": head, "nothing": [], "first layer only": [next(iter(params))]}[trainable]
    for k in keep:
        params[k].requires_grad_(True)
    flags = {k: p.requires_grad for k, p in params.items()}
    got = attnroll.explain(m, x, method)
    torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=1e-6)
    assert {k: p.requires_grad for k, p in m.named_parameters()} == flags
    assert all(p.grad is None for p in m.parameters())


# ------------------------------------------------------------------ fully padded examples: zero maps
ALL_METHODS = ["raw", "rollout", "per_head_rollout", "flow", "grad_rollout", "gae", "attn_gradcam",
               "integrated_gradients", "saliency", "input_x_gradient", "random"]


CAPTUM = ("integrated_gradients", "saliency", "input_x_gradient")  # need a transformers embedding lookup


@pytest.mark.parametrize("method, family", [(m, f) for f in ("mha", "bert") for m in ALL_METHODS
                                            if not (f == "mha" and m in CAPTUM)])
def test_an_example_that_is_all_padding_gets_a_zero_map_and_changes_nothing_else(method, family):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 20, (4, 6), generator=g)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1] = 0  # all padding (the MHA model's attention is NaN there)
    mask[3, 4:] = 0
    m = Classifier().eval() if family == "mha" else model("bert")
    full = attnroll.explain(m, {"input_ids": ids, "attention_mask": mask}, method)
    keep = torch.tensor([0, 2, 3])
    alone = attnroll.explain(m, {"input_ids": ids[keep], "attention_mask": mask[keep]}, method)
    assert torch.isfinite(full.scores).all()
    assert torch.equal(full.scores[1], torch.zeros_like(full.scores[1]))
    if method != "random":  # the control's scores depend on the example's index by design
        torch.testing.assert_close(full.scores[keep], alone.scores, rtol=1e-5, atol=1e-6)


def test_nan_attention_at_real_tokens_is_still_refused():
    m = Classifier().eval()
    ids = torch.randint(0, 20, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)

    def poison(mod, args, out):
        out[0][0, 1] = float("nan")  # one real token's output feeds NaN into the next layer's attention
        return out

    m.enc.layers[0].self_attn.register_forward_hook(poison)
    with pytest.raises(ValueError, match=r"attention of Classifier \(stream 'self', layer 1\) contains NaN"):
        attnroll.explain(m, {"input_ids": ids, "attention_mask": mask}, "raw")


# ------------------------------------------------------------------ Explanation.overlay validated like viz.overlay
@pytest.mark.parametrize("alpha", [2.0, -0.1, float("nan"), "0.5", True, None])
def test_overlay_alpha_is_refused_by_both_overlays_alike(alpha):
    e = attnroll.explain(model("vit"), inputs_for("vit"))
    img = np.zeros((32, 32, 3), np.uint8)
    with pytest.raises((TypeError, ValueError), match="alpha") as a:
        e.overlay(img, alpha=alpha)
    with pytest.raises((TypeError, ValueError), match="alpha") as b:
        viz.overlay(e, img, alpha=alpha)
    assert type(a.value) is type(b.value) and str(a.value) == str(b.value)


def test_overlay_index_is_checked():
    e = attnroll.explain(model("vit"), inputs_for("vit"))
    with pytest.raises(ValueError, match=r"index=3 is out of range for 3 examples"):
        e.overlay(np.zeros((32, 32, 3), np.uint8), index=3)
    with pytest.raises(TypeError, match="index must be an integer"):
        e.to_html(index=0.5)


# ------------------------------------------------------------------ Explanation.load: malformed files
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("expl")
    e = attnroll.explain(model("vit"), inputs_for("vit"))
    return e, e.save(d / "good.npz")


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("frac", [0.0, 0.01, 0.1, 0.5, 0.9, 0.99])
def test_a_truncated_file_is_a_value_error_naming_it(saved, tmp_path, frac):
    data = open(saved[1], "rb").read()
    path = _write(tmp_path / "cut.npz", data[: int(len(data) * frac)])
    with pytest.raises(ValueError, match=rf"{tmp_path}/cut.npz") as err:
        Explanation.load(path)
    if frac == 0.0:
        assert "empty (0 bytes)" in str(err.value)


def test_other_files_are_value_errors_naming_what_is_wrong(saved, tmp_path):
    e, good = saved
    np.save(tmp_path / "plain.npy", np.zeros(3))
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    np.savez(tmp_path / "meta_only.npz", __meta__=np.array('{"format": "attnroll.Explanation/1"}'))
    np.savez(tmp_path / "bad_json.npz", __meta__=np.array("{not json"), scores=np.zeros((1, 2)))
    np.savez(tmp_path / "list_meta.npz", __meta__=np.array("[1, 2]"), scores=np.zeros((1, 2)))
    with np.load(good) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(tmp_path / "no_scores.npz", **{k: v for k, v in arrays.items() if k != "scores"})
    np.savez(tmp_path / "bad_shape.npz", **{**arrays, "scores": np.zeros(3)})
    _write(tmp_path / "text.npz", b"hello, not a zip")
    cases = {
        "plain.npy": "plain .npy array", "other.npz": "no metadata record", "meta_only.npz": "scores, full_row",
        "bad_json.npz": "JSONDecodeError", "list_meta.npz": "unknown format", "no_scores.npz": "scores missing",
        "bad_shape.npz": "must be", "text.npz": "not a zip file",
    }
    for name, why in cases.items():
        with pytest.raises(ValueError, match=str(tmp_path / name)) as err:
            Explanation.load(tmp_path / name)
        assert why in str(err.value), (name, str(err.value))
    back = Explanation.load(good)  # and a good file still loads exactly
    assert torch.equal(back.scores, e.scores) and back.grid == e.grid


def test_a_missing_file_stays_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        Explanation.load(tmp_path / "nope.npz")
    with pytest.raises(IsADirectoryError):
        Explanation.load(tmp_path)


def test_file_readers_share_the_rule(tmp_path):
    from attnroll._io import reading

    path = _write(tmp_path / "x.json", b"")
    with pytest.raises(ValueError, match=rf"{path} is not a valid settings file: the file is empty"):
        with reading(path, "settings file"):
            import json

            json.loads(open(path).read())
    assert os.path.exists(path)


@pytest.mark.parametrize("which, content", [("config.json", b""), ("config.json", b"{not json"),
                                            ("model.safetensors", b""), ("model.safetensors", b"\x00" * 40)])
def test_the_shapes_model_loader_names_a_malformed_file(tmp_path, which, content):
    import shutil

    from attnroll.models import shapes

    for f in ("config.json", "model.safetensors"):
        shutil.copy(shapes.WEIGHTS_DIR / f, tmp_path / f)
    _write(tmp_path / which, content)
    with pytest.raises(ValueError, match=rf"{tmp_path / which} is not a valid shapes model"):
        shapes.load_shapes_model(tmp_path)
