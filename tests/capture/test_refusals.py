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

from ..zoo import shrink  # noqa: E402

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


def _auto(model_type: str, **config):
    return lambda: T.AutoModel.from_config(T.AutoConfig.for_model(model_type, **config))


def _pixels(side: int):
    return lambda: {"pixel_values": torch.randn(1, 3, side, side)}


#: family -> (tiny model, its inputs, words its refusal must hold: its own obstacle)
CASES = {
    "rwkv": (lambda: T.RwkvModel(T.RwkvConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                              attention_hidden_size=32, intermediate_size=37)),
             _ids, ("recurrent", "no attention matrices")),
    "xlstm": (lambda: T.AutoModel.from_config(shrink(T.AutoConfig.for_model("xlstm"))),
              _ids, ("recurrent", "no attention matrices")),
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
    "yoso": (_auto("yoso", **COMMON, **TEXT), _ids, ("locality-sensitive hashing", "never forms attention")),
    "reformer": (_auto("reformer", hidden_size=32, num_attention_heads=2, attn_layers=["local", "lsh"],
                       axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16], local_attn_chunk_length=4,
                       lsh_attn_chunk_length=4, vocab_size=99, feed_forward_size=37, attention_head_size=16),
                 _ids, ("chunks", "hash buckets", "no full token-to-token matrix")),
    "squeezebert": (_auto("squeezebert", **COMMON, **TEXT, q_groups=1, k_groups=1, v_groups=1,
                          post_attention_groups=1, intermediate_groups=1, output_groups=1, embedding_size=32),
                    _ids, ("scores before the softmax", "not the probabilities")),
    "levit": (_auto("levit", hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
                    key_dim=[8, 8, 8], patch_size=16, image_size=64),
              _pixels(64), ("subsampled grid", "no attention weights")),
    "mobilevit": (_auto("mobilevit", hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
                        image_size=64),
                  _pixels(64), ("between patches", "each pixel position")),
    "vitdet": (_auto("vitdet", **COMMON, image_size=32, patch_size=8, window_block_indices=[0], window_size=2,
                     residual_block_indices=[]),
               _pixels(32), ("local windows", "window_block_indices", "globally")),
}

#: What the refusals said before each named its family's obstacle: a generic or wrong reason.
WRONG = ("different token counts", "pooled or windowed", "fused", "expected (B, H, n_q, n_k)", "ran more than once",
         "non-square", "not row-stochastic", "returned no attentions", "not (B, H, n_q, n_k)")


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


def test_a_vitdet_without_window_blocks_is_still_explained():
    """The ViTDet obstacle is its window blocks: the global-attention ViTDet stays supported (README)."""
    torch.manual_seed(0)
    model = _auto("vitdet", **COMMON, image_size=32, patch_size=8)().eval()
    e = attnroll.explain(model, _pixels(32)(), "rollout")
    assert e.scores.shape == (1, 16)


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


def test_a_sentence_transformer_around_a_refused_family_is_refused_with_its_obstacle(built, tmp_path):
    """The obstacles of the transformers model inside a SentenceTransformer apply to it (ALBERT-based
    sentence embedders are common)."""
    S = pytest.importorskip("sentence_transformers")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    T.BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    _model(built, "albert").save_pretrained(tmp_path)
    st = S.SentenceTransformer(str(tmp_path), device="cpu")
    with pytest.raises(UnsupportedModelError, match=r"AlbertModel \(albert\) shares one layer"):
        attnroll.explain(st, st.tokenize(["the cat sat"]), "rollout")
