"""Token mixers other than softmax attention (capture/mixers.py): hybrid stacks are refused by default naming the
mixer, ``mixers="attention_only"`` rolls out through their attention layers alone, warned about and recorded;
models without such mixers are unaffected; methods that read no layer ignore them."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnroll
from attnroll.core.rollout import rollout
from attnroll.capture.mixers import find_mixers

from ..zoo import HYBRIDS, decoder, sharp

FAST = ("jamba", "qwen3_next", "lfm2")
#: The class each tiny hybrid's layer-0 mixer has (read off transformers' modeling files).
MIXER_CLASS = {
    "jamba": "JambaMambaMixer", "bamba": "BambaMixer", "zamba": "ZambaMambaMixer", "zamba2": "Zamba2MambaMixer",
    "falcon_h1": "FalconH1Mixer", "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "nemotron_h": "NemotronHMamba2Mixer", "lfm2": "Lfm2ShortConv", "lfm3": "Lfm3ShortConv",
    "recurrent_gemma": "RecurrentGemmaRecurrentBlock", "kimi_linear": "KimiLinearDeltaAttention",
    "qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
}


def _hybrids() -> list:
    return [pytest.param(t, marks=() if t in FAST else (pytest.mark.slow,)) for t in HYBRIDS]


def _inputs(n: int = 6) -> dict:
    ids = torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_every_hybrid_is_listed():
    assert set(MIXER_CLASS) == set(HYBRIDS)


@pytest.mark.parametrize("model_type", _hybrids())
def test_hybrid_refused_by_default_naming_its_mixer(model_type):
    model = decoder(model_type)
    with pytest.raises(attnroll.UnsupportedModelError) as err:
        attnroll.explain(model, _inputs(), method="rollout")
    msg = str(err.value)
    assert MIXER_CLASS[model_type] in msg and "layer 0" in msg and "mixers='attention_only'" in msg
    assert type(model).__name__ in msg


@pytest.mark.parametrize("model_type", _hybrids())
def test_attention_only_rolls_out_the_attention_layers_and_warns(model_type):
    model, inputs = decoder(model_type), _inputs()
    with pytest.warns(UserWarning, match="attention_only.*partial map"):
        e = attnroll.explain(model, inputs, method="rollout", mixers="attention_only", sinks="keep")
    assert e.extra["mixers"] == "attention_only"
    assert any(MIXER_CLASS[model_type] in line for line in e.extra["mixers_left_out"])
    assert e.options["mixers"] == "attention_only"
    # the same map as rolling out the captured attention layers by hand (core maths, independent of the method)
    rec = attnroll.capture(model, inputs)
    layers = rec.streams["self"]
    assert len(layers) == sum(1 for _ in layers) and len(layers) >= 1
    R = rollout([a.to(torch.float64) for a in layers], attention_mask=inputs["attention_mask"])
    last = inputs["attention_mask"].sum(-1) - 1
    want = torch.stack([R[b, int(last[b])] for b in range(2)]).to(torch.float32)
    torch.testing.assert_close(e.full_row, want * inputs["attention_mask"], atol=1e-5, rtol=1e-5)


def test_gradient_methods_refused_too_and_input_gradients_are_not():
    model, inputs = decoder("jamba"), _inputs()
    for method in ("grad_rollout", "gae", "raw", "flow"):
        with pytest.raises(attnroll.UnsupportedModelError, match="JambaMambaMixer"):
            attnroll.explain(model, inputs, method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no mixer warning for a method that reads no layer
        e = attnroll.explain(model, inputs, method="saliency")
    assert "mixers" not in e.extra


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "vit", "t5", "clip", "timm_vit", "torch_mha"])
def test_models_without_other_mixers_have_none(family):
    assert find_mixers(sharp.model(family)) == []


class _Block(torch.nn.Module):
    """A block with no attention whose unnamed sub-module convolves over the sequence (a custom mixer)."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Module()
        self.mix.conv = torch.nn.Conv1d(8, 8, 3, groups=8, padding=2)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        self.pointwise = torch.nn.Conv1d(8, 8, 1)  # kernel 1: no token mixing


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])


def test_generic_detection_by_structure():
    found = find_mixers(_Net())
    assert [(m.layer, m.path) for m in found] == [(0, "layers.0.mix"), (1, "layers.1.mix")]
    assert "convolution over the sequence" in found[0].kind


def test_minimax_refused_as_an_obstacle():
    T = pytest.importorskip("transformers")
    from ..zoo import shrink

    cfg = shrink(T.AutoConfig.for_model("minimax"))
    cfg.num_hidden_layers, cfg.layer_types, cfg.block_size = 2, ["linear_attention", "full_attention"], 4
    cfg.num_local_experts, cfg.num_experts_per_tok = 2, 1
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(attnroll.UnsupportedModelError, match="lightning"):
        attnroll.explain(model, _inputs(), method="rollout", mixers="attention_only")


def test_bad_mixers_option():
    with pytest.raises(ValueError, match="mixers"):
        attnroll.explain(sharp.model("gpt2"), _inputs(), method="rollout", mixers="all")
