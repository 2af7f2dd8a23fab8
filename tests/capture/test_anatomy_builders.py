"""The layer-anatomy builders of transformers BEiT and
Data2Vec-Vision (block-level λ scales), CLIP / SigLIP encoder layers (vision and causal text), wav2vec2 /
HuBERT encoder layers (post-norm and stable-layer-norm, told apart by a probe).

Each family: every block recomputed in the test from the anatomy's arrays (the naive block of
test_layer_anatomy) equals the block's real output; DecompX shares summed over the tokens equal every layer's
real output; sanity's components re-draw exactly the tensors a hand-written table names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnroll
from attnroll._checks import UnsupportedModelError
from attnroll.capture import model_facts
from attnroll.capture.anatomy import anatomy
from attnroll.evaluate.sanity import _reinitialise

from ..methods import value_aware_reference as R
from .test_layer_anatomy import _block, _block_io

# Left out of `make test-fast` (its 90 s budget on 2 cores); `make test` and CI run it.
pytestmark = pytest.mark.slow

T = pytest.importorskip("transformers")
F64 = torch.float64
SMALL_EAGER = dict(attn_implementation="eager")
SMALL = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
             attn_implementation="eager")


def _wav2vec2_config(Config, **kw):
    return Config(**SMALL, conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=4,
                  num_conv_pos_embedding_groups=2, vocab_size=12, **kw)


def build(family: str):
    """(2-block float64 random-weight model, inputs, expected builder name, causal) of ``family``."""
    g = torch.Generator().manual_seed(5)
    img = torch.randn(2, 3, 16, 16, generator=g, dtype=F64)
    vision = dict(image_size=16, patch_size=8, num_channels=3)
    ids = {"input_ids": torch.randint(1, 30, (2, 6), generator=g)}
    if family == "beit":
        cfg = T.BeitConfig(**SMALL, **vision, layer_scale_init_value=0.5, use_mean_pooling=True, num_labels=3)
        return R._randomise(T.BeitForImageClassification(cfg), 1), img, "beit", False
    if family == "data2vec-vision":
        cfg = T.Data2VecVisionConfig(**SMALL, **vision, layer_scale_init_value=0.5, num_labels=3)
        return R._randomise(T.Data2VecVisionForImageClassification(cfg), 2), img, "data2vec-vision", False
    if family == "clip_vision":
        cfg = T.CLIPVisionConfig(**SMALL, **vision)
        return R._randomise(T.CLIPVisionModel(cfg), 3), img, "clip", False
    if family == "clip_text":
        cfg = T.CLIPTextConfig(**SMALL, vocab_size=30, max_position_embeddings=16)
        return R._randomise(T.CLIPTextModel(cfg), 4), ids, "clip", True
    if family == "siglip_vision":
        cfg = T.SiglipVisionConfig(**SMALL, **vision)
        return R._randomise(T.SiglipVisionModel(cfg), 5), img, "clip", False
    audio = torch.randn(2, 160, generator=g, dtype=F64)
    if family == "wav2vec2":
        return R._randomise(T.Wav2Vec2Model(_wav2vec2_config(T.Wav2Vec2Config)), 6), audio, "wav2vec2", False
    if family == "wav2vec2_stable":
        cfg = _wav2vec2_config(T.Wav2Vec2Config, do_stable_layer_norm=True, feat_extract_norm="layer")
        return R._randomise(T.Wav2Vec2Model(cfg), 7), audio, "wav2vec2", False
    if family == "wav2vec2_stable_cls":
        cfg = _wav2vec2_config(T.Wav2Vec2Config, do_stable_layer_norm=True, feat_extract_norm="layer", num_labels=3)
        return R._randomise(T.Wav2Vec2ForSequenceClassification(cfg), 7), audio, "wav2vec2", False
    if family == "hubert":
        return R._randomise(T.HubertModel(_wav2vec2_config(T.HubertConfig)), 8), audio, "wav2vec2", False
    if family.startswith("t5"):
        cfg = T.T5Config(vocab_size=30, d_model=8, d_kv=4, d_ff=12, num_layers=2, num_heads=2, decoder_start_token_id=0,
                         feed_forward_proj="gated-gelu" if family == "t5_encoder" else "relu", **SMALL_EAGER)
        if family == "t5_encoder":
            return R._randomise(T.T5EncoderModel(cfg), 13), ids, "t5", False
        return R._randomise(T.T5Model(cfg), 14), {**ids, "decoder_input_ids": ids["input_ids"][:, :4]}, "t5", False
    if family.split("_")[0] in ("bart", "mbart", "whisper"):
        return _seq2seq(family, g)
    if family.startswith("eva") or family == "timm_beit":
        return _timm(family), img, "timm-eva", False
    raise ValueError(family)


def _seq2seq(family: str, g: torch.Generator):
    """BART (post-norm), mBART and Whisper (pre-norm): the whole encoder-decoder, or its encoder alone."""
    kind, part = family.split("_")
    sizes = dict(d_model=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=12, decoder_ffn_dim=12, vocab_size=30, attn_implementation="eager", pad_token_id=1,
                 bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    if kind == "whisper":
        cfg = T.WhisperConfig(**sizes, num_mel_bins=4, max_source_positions=6, max_target_positions=16)
        model, x = T.WhisperModel(cfg), {"input_features": torch.randn(2, 4, 12, generator=g, dtype=F64)}
    else:
        Config, Model = (T.BartConfig, T.BartModel) if kind == "bart" else (T.MBartConfig, T.MBartModel)
        model = Model(Config(**sizes, max_position_embeddings=16))
        x = {"input_ids": torch.randint(3, 30, (2, 6), generator=g)}
    if part == "encoder":
        return R._randomise(model.encoder, 11), x, "bart", False
    x = {**x, "decoder_input_ids": torch.randint(3, 30, (2, 5), generator=g)}
    return R._randomise(model, 12), x, "bart", False


def _timm(family: str):
    timm = pytest.importorskip("timm")
    from timm.models.beit import Beit
    from timm.models.eva import Eva

    base = dict(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3)
    kw = {"eva_glu": dict(swiglu_mlp=True, init_values=0.5),  # packed GLU MLP, fused qkv with q / v biases
          "eva_swiglu": dict(swiglu_mlp=True, swiglu_align_to=8, qkv_fused=False),  # SwiGLU, separate q / k / v
          "eva_rope": dict(use_rot_pos_emb=True, init_values=0.5, ref_feat_shape=(2, 2))}.get(family)
    model = Beit(**base, init_values=0.5, qkv_bias=True, use_rel_pos_bias=True) if family == "timm_beit" else Eva(**base, **kw)
    assert timm is not None
    return R._randomise(model, 10)


FAMILIES = ["beit", "data2vec-vision", "clip_vision", "clip_text", "siglip_vision", "wav2vec2", "wav2vec2_stable",
            "hubert", "eva_glu", "eva_swiglu", "bart_encoder", "mbart_encoder", "whisper_encoder"]
#: Rotary EVA, T5 (unscaled scores, relative bias): their blocks are checked through the captured attention
#: (DecompX shares) only.
ROPE = ["eva_rope", "t5_encoder"]
#: The residual layout each tiny model's blocks compute (from the transformers sources).
RESIDUAL = {"wav2vec2": "post-norm", "hubert": "post-norm", "bart_encoder": "post-norm", "bart_model": "post-norm"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_block_recomputed_from_the_anatomy_equals_its_real_output(family):
    model, x, builder, causal = build(family)
    anat = model_facts(model).anatomy
    assert anat.family == builder and len(anat.layers) == 2 and anat.value_aware == ""
    assert {L.residual for L in anat.layers} == {RESIDUAL.get(family, "pre-norm")}
    for layer, (inp, _, out) in zip(anat.layers, _block_io(model, x, anat)):
        with torch.no_grad():
            mine = _block(layer, inp, causal, None)
        torch.testing.assert_close(mine, out, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES + ROPE)
def test_decompx_shares_add_up_to_every_layer_output(family):
    from attnroll.capture.value_path import record_states
    from attnroll.core.decompx import block_shares, initial_shares

    model, x, _, _ = build(family)
    rec, st, anat = record_states(model, x)
    S = initial_shares(st.inputs[0])
    for i, blk in enumerate(anat.blocks(F64)):
        S = block_shares(S, rec.attentions[i], blk)
        # T5LayerNorm takes its variance in float32 even in a float64 model: 1e-6 there
        torch.testing.assert_close(S.sum(2), st.outputs[i], atol=1e-6 if family.startswith("t5") else 1e-9, rtol=0)


def test_the_timm_variants_are_the_layouts_the_tables_assume():
    glu, swiglu, beit = (build(f)[0].blocks[0] for f in ("eva_glu", "eva_swiglu", "timm_beit"))
    assert type(glu.mlp).__name__ == "GluMlp" and not glu.mlp.gate_last and glu.attn.q_bias is not None
    assert type(swiglu.mlp).__name__ == "SwiGLU" and swiglu.attn.qkv is None
    assert beit.attn.relative_position_bias_table is not None and beit.attn.q_bias is not None
    layer = model_facts(build("eva_glu")[0]).anatomy.layers[0]
    w = layer.module.mlp.fc1.weight.detach()  # gate_last=False: act(first half) * second half
    torch.testing.assert_close(layer.gate.arrays()[0], w[: w.shape[0] // 2])
    torch.testing.assert_close(layer.fc1.arrays()[0], w[w.shape[0] // 2:])
    assert "window" in model_facts(build("timm_beit")[0]).anatomy.value_aware  # relative-position BEiT: sanity only


@pytest.mark.parametrize("family,layout", [("bart_model", "post-norm"), ("mbart_model", "pre-norm"),
                                           ("whisper_model", "pre-norm")])
def test_encoder_decoder_layers_are_described_with_their_cross_attention(family, layout):
    model, *_ = build(family)
    anat = model_facts(model).anatomy
    assert [L.path.rsplit(".", 1)[0] for L in anat.layers] == ["encoder.layers"] * 2 + ["decoder.layers"] * 2
    assert {L.residual for L in anat.layers} == {layout}
    assert [L.cross is None for L in anat.layers] == [True, True, False, False]
    dec = anat.layers[-1]
    assert dec.cross[2].module is dec.module.encoder_attn.v_proj and dec.cross[3].module is dec.module.encoder_attn.out_proj
    assert "several stacks" in anat.value_aware  # sanity only


def test_beit_layer_scales_are_the_blocks_own_lambda_parameters():
    model, *_ = build("beit")
    layer = model_facts(model).anatomy.layers[0]
    assert layer.ls1.gamma is layer.module.lambda_1 and layer.ls2.gamma is layer.module.lambda_2
    blk = layer.block(F64)
    w_o = layer.module.attention.o_proj.weight.detach()
    torch.testing.assert_close(blk.wo, w_o * layer.module.lambda_1.detach()[:, None])


def test_decompx_refuses_a_head_the_anatomy_does_not_read_naming_it():
    model, x, _, _ = build("beit")
    with pytest.raises(UnsupportedModelError, match="beit head .*mean pooling.* is not described"):
        attnroll.explain(model, x, "decompx")


class _ParallelLayer(T.models.wav2vec2.modeling_wav2vec2.Wav2Vec2EncoderLayer):
    """wav2vec2's parameters, but parallel branches: x + Attn(LN(x)) + FF(LN'(x)) (neither layout)."""

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        a = self.attention(self.layer_norm(hidden_states))[0]
        return (hidden_states + a + self.feed_forward(self.final_layer_norm(hidden_states)),)


def test_a_block_with_wav2vec2_parameters_but_another_residual_layout_is_refused():
    cfg = _wav2vec2_config(T.Wav2Vec2Config)
    block = R._randomise(_ParallelLayer(cfg), 9)
    with pytest.raises(UnsupportedModelError, match="neither the pre-norm nor the post-norm"):
        anatomy(nn.ModuleDict({"encoder": nn.ModuleDict({"layers": nn.ModuleList([block])})}))


def test_the_residual_probe_leaves_a_running_captures_hooks_unfired():
    model, *_ = build("wav2vec2")
    calls = []
    handles = [m.register_forward_hook(lambda *a: calls.append(1)) for m in model.modules()]
    try:
        assert model_facts(model).anatomy.layers[0].residual == "post-norm"
    finally:
        for h in handles:
            h.remove()
    assert calls == []  # the probe ran on a hook-free copy
    assert not any(m._forward_hooks for m in model.modules())


# ------------------------------------------------------------------------------------------- sanity
A = slice(None)
_WB = ("weight", "bias")
#: family -> component -> block-relative parameters re-drawn (whole tensors), written from the modules' layouts.
EXPECTED = {
    "beit": {
        "qk": {"attention.q_proj.weight", "attention.q_proj.bias", "attention.k_proj.weight"},
        "value": {f"attention.{n}_proj.{p}" for n in "vo" for p in _WB},
        "mlp": {f"mlp.fc{n}.{p}" for n in "12" for p in _WB},
    },
    "data2vec-vision": {
        "qk": {"attention.attention.query.weight", "attention.attention.query.bias", "attention.attention.key.weight"},
        "value": {"attention.attention.value.weight", "attention.attention.value.bias",
                  "attention.output.dense.weight", "attention.output.dense.bias"},
        "mlp": {f"{n}.dense.{p}" for n in ("intermediate", "output") for p in _WB},
    },
    "clip_text": {
        "qk": {f"self_attn.{n}_proj.{p}" for n in "qk" for p in _WB},
        "value": {f"self_attn.{n}_proj.{p}" for n in ("v", "out") for p in _WB},
        "mlp": {f"mlp.fc{n}.{p}" for n in "12" for p in _WB},
    },
    "wav2vec2": {
        "qk": {f"attention.{n}_proj.{p}" for n in "qk" for p in _WB},
        "value": {f"attention.{n}_proj.{p}" for n in ("v", "out") for p in _WB},
        "mlp": {f"feed_forward.{n}_dense.{p}" for n in ("intermediate", "output") for p in _WB},
    },
}
_ATT = ("self_attn", "encoder_attn")
EXPECTED["bart_model"] = {  # the last block: decoder layer 1, its cross-attention with the self-attention
    "qk": {f"{a}.{n}_proj.{p}" for a in _ATT for n in "qk" for p in _WB},
    "value": {f"{a}.{n}_proj.{p}" for a in _ATT for n in ("v", "out") for p in _WB},
    "mlp": {f"fc{n}.{p}" for n in "12" for p in _WB},
}
EXPECTED["whisper_model"] = {  # Whisper: bias-free k_proj in both attentions
    **EXPECTED["bart_model"], "qk": {f"{a}.{n}" for a in _ATT for n in ("q_proj.weight", "q_proj.bias", "k_proj.weight")}}
EXPECTED["t5_model"] = {  # the last decoder block: self-attention layer.0, cross-attention layer.1, MLP layer.2
    "qk": {f"layer.{j}.{a}.{n}.weight" for j, a in ((0, "SelfAttention"), (1, "EncDecAttention")) for n in "qk"},
    "value": {f"layer.{j}.{a}.{n}.weight" for j, a in ((0, "SelfAttention"), (1, "EncDecAttention")) for n in "vo"},
    "mlp": {"layer.2.DenseReluDense.wi.weight", "layer.2.DenseReluDense.wo.weight"},
}
EXPECTED["siglip_vision"] = EXPECTED["clip_vision"] = EXPECTED["clip_text"]
EXPECTED["hubert"] = EXPECTED["wav2vec2_stable"] = EXPECTED["wav2vec2"]
EXPECTED = {f: {c: {n: A for n in names} for c, names in comps.items()} for f, comps in EXPECTED.items()}
#: timm EVA / BEiT with a fused qkv (d = 16): q, k = rows 0..31, v = rows 32..47, separate q / v biases.
_FUSED = {"qk": {"attn.qkv.weight": slice(0, 32), "attn.q_bias": A},
          "value": {"attn.qkv.weight": slice(32, 48), "attn.v_bias": A, "attn.proj.weight": A, "attn.proj.bias": A}}
EXPECTED["eva_glu"] = {**_FUSED, "mlp": {f"mlp.fc{n}.{p}": A for n in "12" for p in _WB}}  # the packed fc1: whole
EXPECTED["timm_beit"] = EXPECTED["eva_rope"] = EXPECTED["eva_glu"]
EXPECTED["eva_swiglu"] = {
    "qk": {"attn.q_proj.weight": A, "attn.q_proj.bias": A, "attn.k_proj.weight": A},  # timm: a bias-free k_proj
    "value": {**{f"attn.v_proj.{p}": A for p in _WB}, "attn.proj.weight": A, "attn.proj.bias": A},
    "mlp": {f"mlp.{n}.{p}": A for n in ("fc1_x", "fc1_g", "fc2") for p in _WB},
}
#: The block's norm parameters (reset to 1 / 0 by "all").
NORMS = {"beit": ("layernorm_before", "layernorm_after"), "data2vec-vision": ("layernorm_before", "layernorm_after"),
         "clip": ("layer_norm1", "layer_norm2"), "wav2vec2": ("layer_norm", "final_layer_norm"),
         "timm-eva": ("norm1", "norm2"), "bart": ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"),
         "t5": ("layer.0.layer_norm", "layer.1.layer_norm", "layer.2.layer_norm")}


@pytest.mark.parametrize("family", sorted(EXPECTED))
@pytest.mark.parametrize("component", ["qk", "value", "mlp", "all"])
def test_sanity_redraws_exactly_the_tensors_the_table_names(family, component):
    model, _, builder, _ = build(family)
    layer = model_facts(model).anatomy.layers[-1]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _reinitialise(layer.targets(component), torch.Generator().manual_seed(0))
    prefix = layer.path + "."
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    if component != "all":
        want = EXPECTED[family][component]
        assert changed == {prefix + n for n in want}
        for n, idx in want.items():
            p = dict(model.named_parameters())[prefix + n].detach()
            mask = torch.zeros_like(p, dtype=torch.bool)
            mask[idx] = True
            assert torch.equal(before[prefix + n] != p, mask), n
        return
    assert changed == {n for n in before if n.startswith(prefix)}  # every parameter of the block, λ included
    params = dict(model.named_parameters())
    for norm in NORMS[builder]:
        assert f"{prefix}{norm}.weight" in params
        for p in _WB:
            if f"{prefix}{norm}.{p}" in params:  # T5's RMS norms have no bias
                assert torch.all(params[f"{prefix}{norm}.{p}"] == (0.0 if p == "bias" else 1.0))


@pytest.mark.parametrize("family", ["beit", "wav2vec2_stable_cls", "eva_glu"])
def test_cascading_randomisation_runs_through_the_new_builders(family):
    import numpy as np

    from attnroll.evaluate.sanity import cascading_randomization

    model, x, _, _ = build(family)
    r = cascading_randomization(model, x, ("rollout",), component="value")
    assert r.steps == ["classifier", "layer 1", "layer 0"] and r.head in ("classifier", "head")
    # the top block's value path enters no attention: rollout's map is unchanged after re-drawing it
    top = r.steps.index("layer 1")
    assert r.per_example["rollout"][top] == pytest.approx(np.ones(r.per_example["rollout"].shape[1]), abs=1e-12)
