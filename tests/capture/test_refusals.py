"""Refused transformers families: each refusal names the family's own obstacle (what the model computes in
place of a token-to-token attention matrix), before any forward pass, on both capture routes; the README's
family table agrees with what is refused (ALBERT); a family split into named stacks (SeamlessM4T's
``text_encoder`` / ``text_decoder``) is captured as encoder / decoder / cross streams."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll import UnsupportedModelError  # noqa: E402
from attnroll.capture import registry  # noqa: E402

TEXT = dict(vocab_size=99, max_position_embeddings=64)
COMMON = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=37)
SEQ2SEQ = dict(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37)
SEAMLESS = dict(SEQ2SEQ, hidden_size=32, speech_encoder_layers=1, speech_encoder_attention_heads=2,
                speech_encoder_intermediate_size=37, t2u_vocab_size=99, t2u_encoder_layers=1, t2u_decoder_layers=1,
                t2u_encoder_attention_heads=2, t2u_decoder_attention_heads=2, t2u_encoder_ffn_dim=37,
                t2u_decoder_ffn_dim=37, unit_hifi_gan_vocab_size=10, max_position_embeddings=64,
                t2u_max_position_embeddings=64)
RESNET = {"model_type": "resnet", "num_channels": 3, "embedding_size": 8, "hidden_sizes": [8, 16, 16, 32],
          "depths": [1, 1, 1, 1], "out_features": ["stage2", "stage3", "stage4"]}


def _ids(n: int = 8) -> dict:
    return {"input_ids": torch.randint(5, 90, (1, n))}


#: family -> (tiny model, its inputs, words its refusal must hold: its own obstacle)
CASES = {
    "rwkv": (lambda: T.RwkvModel(T.RwkvConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                              attention_hidden_size=32, intermediate_size=37)),
             _ids, ("recurrent", "no attention matrices")),
    "mamba": (lambda: T.MambaModel(T.MambaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, state_size=4)),
              _ids, ("state-space", "no attention matrices")),
    "longformer": (lambda: T.LongformerModel(T.LongformerConfig(**COMMON, **TEXT, attention_window=4)),
                   _ids, ("sliding window", "global tokens", "no full token-to-token matrix")),
    "led": (lambda: T.LEDModel(T.LEDConfig(**SEQ2SEQ, attention_window=4, max_encoder_position_embeddings=64,
                                           max_decoder_position_embeddings=64)),
            lambda: {**_ids(), "decoder_input_ids": torch.randint(5, 90, (1, 4))},
            ("sliding window", "global tokens", "no full token-to-token matrix")),
    "albert": (lambda: T.AlbertModel(T.AlbertConfig(**COMMON, **TEXT, embedding_size=16)),
               _ids, ("shares one layer", "across all its layers")),
    "sam": (lambda: T.SamVisionModel(T.SamVisionConfig(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16,
                window_size=2, global_attn_indexes=[1], output_channels=16, mlp_dim=37)),
            lambda: {"pixel_values": torch.randn(1, 3, 64, 64)}, ("local windows", "globally", "global_attn_indexes")),
    "deformable_detr": (lambda: T.DeformableDetrModel(T.DeformableDetrConfig(
                            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, num_queries=5,
                            use_timm_backbone=False, backbone=None, use_pretrained_backbone=False,
                            backbone_config=RESNET)),
                        lambda: {"pixel_values": torch.randn(1, 3, 64, 64)},
                        ("deformable attention", "samples", "points", "no token-to-token matrix")),
    "seamless_m4t": (lambda: T.SeamlessM4TModel(T.SeamlessM4TConfig(**SEAMLESS)),
                     lambda: {**_ids(), "decoder_input_ids": torch.randint(5, 90, (1, 4))},
                     ("speech encoder", "text encoder", "SeamlessM4TForTextToText")),
}

#: What the refusals said before each named its family's obstacle: a generic or wrong reason.
WRONG = ("different token counts", "pooled or windowed", "fused", "expected (B, H, n_q, n_k)", "ran more than once")


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    return {}


def _model(built: dict, name: str) -> torch.nn.Module:
    if name not in built:
        built[name] = CASES[name][0]().eval()
    return built[name]


@pytest.mark.parametrize("attention", [None, "dense"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_refusal_names_the_family_s_own_obstacle_before_any_forward(built, name, attention):
    model, (_, inputs, words) = _model(built, name), CASES[name]
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(UnsupportedModelError) as err:
            attnroll.explain(model, inputs(), "rollout", **({} if attention is None else {"attention": attention}))
    finally:
        handle.remove()
    msg = str(err.value)
    assert msg.startswith(f"{type(model).__name__} ({model.config.model_type})")
    assert all(w in msg for w in words), msg
    assert not any(w in msg for w in WRONG), msg
    assert calls == []  # refused from the model's structure, not from what a forward pass returned


def test_every_obstacle_applies_to_its_own_models_only(built):
    """Each registry obstacle accepts the tiny model it names, and no other of the cases, nor BERT."""
    obstacles = registry.TRANSFORMERS.obstacles
    bert = T.BertModel(T.BertConfig(**COMMON, **TEXT))
    for name in CASES:
        hits = [o.readme for o in obstacles if o.applies(_model(built, name))]
        assert len(hits) == 1, (name, hits)
    assert [o.readme for o in obstacles if o.applies(bert)] == []
    assert {o.readme for o in obstacles} <= set(registry.refusals())


def test_a_non_square_attention_without_an_obstacle_is_named_so(built, monkeypatch):
    """The generic refusal, for a family no obstacle describes: layers returning (n x m) weights are called
    non-square, not "pooled or windowed between layers"."""
    families = tuple(replace(f, obstacles=()) for f in registry.FAMILIES)
    monkeypatch.setattr(registry, "FAMILIES", families)
    with pytest.raises(UnsupportedModelError, match="non-square") as err:
        attnroll.explain(_model(built, "rwkv"), _ids(), "rollout", attention="dense")
    assert "pooled or windowed" not in str(err.value)


def test_albert_is_refused_and_readme_says_so_only(built):
    """README lists ALBERT among the refused models only, as the registry does, and capture refuses it."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    rows = [r for r in readme.splitlines() if r.startswith("|") and "ALBERT" in r]
    assert len(rows) == 1 and rows[0].startswith("| refused, with the reason |")
    assert not any("ALBERT" in m.models for f in registry.FAMILIES for m in f.models)
    with pytest.raises(UnsupportedModelError, match="shares one layer"):
        attnroll.capture(_model(built, "albert"), _ids())


def test_seamless_text_to_text_is_captured_as_encoder_decoder_and_cross():
    torch.manual_seed(0)
    model = T.SeamlessM4TForTextToText(T.SeamlessM4TConfig(**SEAMLESS)).eval()
    inputs = {**_ids(8), "decoder_input_ids": torch.randint(5, 90, (1, 5))}
    rec = attnroll.capture(model, inputs)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    own = {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions, "cross": out.cross_attentions}
    assert sorted(rec.streams) == ["cross", "decoder", "encoder"]
    for stream, layers in own.items():
        assert len(rec.streams[stream]) == len(layers)
        for got, want in zip(rec.streams[stream], layers):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    e = attnroll.explain(model, inputs, "encdec_rollout")
    assert e.scores.shape == (1, 8)
