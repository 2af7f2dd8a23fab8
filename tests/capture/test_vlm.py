"""Vision-language models (LLaVA, PaliGemma) on tiny random-weight configs: the "vision" and "language" streams
against each model's own eager attention, the image tokens found from the model's own image token id, and the
composed rollout against a naive computation written here in numpy (full language rollout matrix, its row,
the image positions, the naive vision rollout up to the feature layer)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import attnroll
from attnroll import UnsupportedModelError

from .helpers import snapshot

transformers = pytest.importorskip("transformers")

IMG = 100  # the image token id of the tiny configs
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=120, max_position_embeddings=128)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
              patch_size=8)


def llava(**cfg):
    torch.manual_seed(0)
    c = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**VISION),
                                 text_config=transformers.LlamaConfig(**TEXT), image_token_index=IMG, **cfg)
    return transformers.LlavaForConditionalGeneration(c).eval()


def paligemma():
    torch.manual_seed(0)
    vc = transformers.SiglipVisionConfig(**VISION, vision_use_head=False)
    tc = transformers.GemmaConfig(**TEXT, head_dim=8)
    c = transformers.PaliGemmaConfig(vision_config=vc.to_dict(), text_config=tc.to_dict(), image_token_index=IMG,
                                     projection_dim=32)
    return transformers.PaliGemmaForConditionalGeneration(c).eval()


BUILD = {"llava": llava, "paligemma": paligemma}
#: Vision tokens (16 patches; LLaVA's CLIP tower adds a CLS) and image tokens in the prompt (16 each).
N_VISION = {"llava": 17, "paligemma": 16}


def prompt(name, starts=(2,), n=24, images=True, seed=1):
    """One prompt per start: image tokens at start..start+15, random text around them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (len(starts), n), generator=g)
    if images:
        for b, s in enumerate(starts):
            ids[b, s:s + 16] = IMG
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        inp["pixel_values"] = torch.randn(len(starts), 3, 32, 32, generator=g)
    if name == "paligemma":  # the processor's prefix (image + prompt) marker: bidirectional attention there
        inp["token_type_ids"] = torch.zeros_like(ids)
    return inp


def eager_copy(model):
    cfg = copy.deepcopy(model.config)
    for c in (cfg, cfg.vision_config, cfg.text_config):
        c._attn_implementation = "eager"
    ref = type(model)(cfg).eval()
    ref.load_state_dict(model.state_dict())
    return ref


def own_attentions(model, inp):
    """The model's own eager attentions: the language model's from its output, the vision tower's from a call of
    the tower itself (the VLM does not return them)."""
    ref = eager_copy(model)
    with torch.no_grad():
        lang = list(ref(**inp, output_attentions=True).attentions)
        vision = list(ref.model.vision_tower(inp["pixel_values"], output_attentions=True).attentions)
    return vision, lang


def naive_rollout(layers):
    """Full rollout matrix in numpy: R = Ã_L ··· Ã_1, Ã = ½ mean_h(A) + ½ I (one example: layers (H, n, n))."""
    n = layers[0].shape[-1]
    R = np.eye(n)
    for a in layers:
        R = (0.5 * a.mean(axis=0) + 0.5 * np.eye(n)) @ R
    return R


def naive_vlm(vision, lang, ids, b, image, first, used):
    """(image map over the vision tokens, language row) of prompt b, written out: the last token's row of the
    language rollout, the share of every image token (in order) sent to vision token first + j of the image."""
    row = naive_rollout([t[b].double().numpy() for t in lang])[-1]
    R_v = naive_rollout([t[image].double().numpy() for t in vision[:used]])
    positions = [p for p in range(row.shape[0]) if int(ids[b, p]) == IMG]
    out = np.zeros(R_v.shape[0])
    for j, p in enumerate(positions):
        out += row[p] * R_v[first + j]
    return out, row


@pytest.mark.parametrize("name", list(BUILD))
def test_streams_equal_the_models_own_eager_attention(name):
    model = BUILD[name]()
    inp = prompt(name, starts=(2, 5))
    rec = attnroll.capture(model, inp)
    vision, lang = own_attentions(model, inp)
    assert set(rec.streams) == {"vision", "language"}
    for got, want in ((rec.streams["vision"], vision), (rec.streams["language"], lang)):
        assert len(got) == len(want)
        for a, e in zip(got, want):
            assert a.shape == e.shape and torch.allclose(a, e, atol=1e-5)
    v, lg = rec.info["vision"], rec.info["language"]
    assert v.kind == "image" and v.grid == (4, 4) and v.prefix == N_VISION[name] - 16
    assert lg.readout.positions() == [23, 23]


@pytest.mark.parametrize("name", list(BUILD))
def test_image_tokens_are_found_from_the_models_own_image_token_id(name):
    model = BUILD[name]()
    inp = prompt(name, starts=(2, 5))
    rec = attnroll.capture(model, inp)
    link = rec.info["language"].link
    assert link.position.tolist() == list(range(2, 18)) + list(range(5, 21))
    assert link.example.tolist() == [0] * 16 + [1] * 16 and link.item.tolist() == [0] * 16 + [1] * 16
    first = N_VISION[name] - 16  # LLaVA's "default" strategy drops the CLS; SigLIP has none
    assert link.token.tolist() == list(range(first, first + 16)) * 2
    # Another image token id in the config: the same ids now hold no image token, so the model itself fails,
    # and with the new id in place of 100 the link follows it.
    model.config.image_token_id = 7
    inp["input_ids"] = torch.where(inp["input_ids"] == IMG, 7, torch.where(inp["input_ids"] == 7, 8, inp["input_ids"]))
    assert attnroll.capture(model, inp).info["language"].link.position.tolist() == link.position.tolist()


@pytest.mark.parametrize("name", list(BUILD))
def test_the_image_map_equals_a_naive_composition_and_shares_add_to_one(name):
    model = BUILD[name]()
    inp = prompt(name, starts=(3,))
    e = attnroll.explain(model, inp, "rollout")
    vision, lang = own_attentions(model, inp)
    first = N_VISION[name] - 16
    used = 2 if name == "llava" else 3  # LLaVA's vision_feature_layer -2: the last vision layer is not read
    want, row = naive_vlm(vision, lang, inp["input_ids"], 0, 0, first, used)
    assert e.grid == (4, 4) and e.scores.shape == (1, 16)
    assert np.allclose(e.scores[0].numpy(), want[first:], atol=1e-5)
    assert np.allclose(e.full_row[0].numpy(), want, atol=1e-5)
    text = row.copy()
    text[3:19] = 0
    assert np.allclose(e.extra["text_scores"][0].numpy(), text, atol=1e-5)
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0, abs=1e-5)
    assert float(e.full_row.sum()) == pytest.approx(float(e.extra["image_share"][0]), abs=1e-6)
    assert e.extra["image_positions"] == [list(range(3, 19))]
    layered = attnroll.explain(model, inp, "rollout", return_layers=True)
    assert np.allclose(layered.extra["language_layers"][-1, 0].numpy(), row, atol=1e-5)


def test_llava_full_strategy_and_call_override_of_the_feature_layer():
    model = llava(vision_feature_select_strategy="full", vision_feature_layer=-1)
    inp = prompt("llava", starts=(2,), n=26)
    inp["input_ids"][0, 18] = IMG  # 17 image tokens: CLS included
    inp["vision_feature_layer"] = -3  # the call overrides the config: hidden_states[-3], one vision layer
    e = attnroll.explain(model, inp, "rollout")
    vision, lang = own_attentions(model, inp)
    want, _ = naive_vlm(vision, lang, inp["input_ids"], 0, 0, 0, 1)
    assert np.allclose(e.full_row[0].numpy(), want, atol=1e-5)
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("name", list(BUILD))
def test_a_padded_batch_equals_its_single_prompts_and_the_state_is_unchanged(name):
    model = BUILD[name]()
    with torch.no_grad():  # transformers installs its own hidden-state recorders on the first call, for good
        model(**prompt(name, starts=(2,)))
    before = snapshot(model)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    inp = prompt(name, starts=(2, 4))
    inp["attention_mask"][1, 21:] = 0
    both = attnroll.explain(model, inp, "rollout")
    for b, keep in ((0, 24), (1, 21)):
        one = {k: v[b:b + 1, :keep] if k != "pixel_values" else v[b:b + 1] for k, v in inp.items()}
        alone = attnroll.explain(model, one, "rollout")
        assert torch.allclose(alone.scores[0], both.scores[b], atol=1e-5)
        assert torch.allclose(alone.extra["text_scores"][0], both.extra["text_scores"][b, :keep], atol=1e-5)
    assert float(both.extra["text_scores"][1, 21:].abs().sum()) == 0
    assert snapshot(model) == before
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", list(BUILD))
def test_a_prompt_without_an_image_is_explained_as_text(name):
    model = BUILD[name]()
    inp = prompt(name, images=False)
    e = attnroll.explain(model, inp, "rollout")
    ref = eager_copy(model)
    with torch.no_grad():
        lang = ref(**inp, output_attentions=True).attentions
    row = naive_rollout([t[0].double().numpy() for t in lang])[-1]
    assert e.grid is None and np.allclose(e.scores[0].numpy(), row, atol=1e-5)


@pytest.mark.parametrize("method", ["gae", "grad_rollout"])
def test_gradient_methods_reach_both_streams_and_shares_add_to_the_rows_total(method):
    model = llava()
    inp = prompt("llava", starts=(2,))
    e = attnroll.explain(model, inp, method, target=5)
    total = float(e.extra["language_row"][0].sum())
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(total, rel=1e-5)
    assert float(e.extra["image_share"][0]) > 0 and float(e.scores.abs().sum()) > 0
    assert e.target == [5]


def test_refusals_say_why():
    model = llava()
    inp = prompt("llava", starts=(2,))
    for method in ("raw", "flow", "integrated_gradients"):  # IG would perturb the image tokens away
        with pytest.raises(ValueError, match="does not compose the streams"):
            attnroll.explain(model, inp, method)
    with pytest.raises(ValueError, match="recompute"):
        attnroll.explain(model, inp, "rollout", attention="recompute")
    alone = attnroll.explain(model, inp, "rollout", stream="language")  # one stream, image tokens as positions
    assert alone.scores.shape == (1, 24)
    tower = attnroll.explain(model, inp, "rollout", stream="vision")  # the tower alone, read at the patch tokens
    assert tower.grid == (4, 4) and tower.readout["kind"] == "weights"
    two = prompt("llava", starts=(2,), n=40)
    two["input_ids"][0, 20:36] = IMG
    two["pixel_values"] = torch.randn(2, 3, 32, 32)
    with pytest.raises(ValueError, match="prompt 0 holds images 0 and 1"):
        attnroll.explain(model, two, "rollout")
    layered = llava(vision_feature_layer=[-2, -1])
    with pytest.raises(ValueError, match="concatenated across several"):
        attnroll.explain(layered, inp, "rollout")


def test_qwen2_vl_is_refused_with_the_reason():
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(TEXT, vocab_size=160, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4),
        image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    with pytest.raises(UnsupportedModelError, match="returns no probabilities"):
        attnroll.capture(model)


def naive_gae(atts, grads):
    """R = Π (I + mean_h((dy/dA ⊙ A)^+)) in numpy, one example: lists of (H, n, n)."""
    n = atts[0].shape[-1]
    R = np.eye(n)
    for a, g in zip(atts, grads):
        R = R + np.clip(a * g, 0, None).mean(axis=0) @ R
    return R


def test_gae_composition_equals_a_naive_one_on_the_models_own_gradients():
    model = llava()
    inp = prompt("llava", starts=(2,))
    e = attnroll.explain(model, inp, "gae", target=5)
    rec = attnroll.capture(model, inp, keep_grad=True)
    rec.outputs.logits[0, -1, 5].backward()  # the next-token logit of token 5 at the last position
    np_ = lambda ts: [t[0].detach().double().numpy() for t in ts]  # noqa: E731
    lang, vision = rec.streams["language"], rec.streams["vision"][:2]  # feature layer -2: two of three layers
    assert rec.streams["vision"][2].grad is None  # the last vision layer is not read: no gradient reaches it
    row = naive_gae(np_(lang), np_([t.grad for t in lang]))[-1]
    R_v = naive_gae(np_(vision), np_([t.grad for t in vision]))
    share = row[2:18]
    src = (share / share.sum()) @ R_v[1:17]
    want = share.sum() * src / src.sum()
    assert np.allclose(e.full_row[0].numpy(), want, rtol=1e-4, atol=1e-6)
    assert np.allclose(e.extra["language_row"][0].numpy(), row, rtol=1e-4, atol=1e-6)


def test_model_facts_name_both_streams_inputs_and_the_dense_route():
    facts = attnroll.capture.model_facts(paligemma())
    assert facts.stream_inputs == {"vision": "pixel_values", "language": "input_ids"}
    assert "dense" in facts.dense_only and facts.family == "hf:paligemma"


def test_an_explanation_of_a_vlm_saves_and_loads(tmp_path):
    model = llava()
    e = attnroll.explain(model, prompt("llava", starts=(2,)), "rollout")
    back = attnroll.Explanation.load(e.save(tmp_path / "vlm.npz"))
    assert back.grid == (4, 4) and torch.equal(back.scores, e.scores)
    assert torch.equal(back.extra["text_scores"], e.extra["text_scores"])
    assert back.extra["image_positions"] == e.extra["image_positions"]


def test_a_batch_with_and_without_an_image_equals_its_single_prompts():
    model = llava()
    inp = prompt("llava", starts=(2, 4))
    inp["input_ids"][1, 4:20] = 7  # prompt 1 is text only; one image, for prompt 0
    inp["pixel_values"] = inp["pixel_values"][:1]
    both = attnroll.explain(model, inp, "rollout")
    first = attnroll.explain(model, {k: v[:1] for k, v in inp.items()}, "rollout")
    text = attnroll.explain(model, {k: v[1:] for k, v in inp.items() if k != "pixel_values"}, "rollout")
    assert torch.allclose(both.scores[0], first.scores[0], atol=1e-5)
    assert float(both.scores[1].abs().sum()) == 0 and float(both.extra["image_share"][1]) == 0
    assert text.grid is None and torch.allclose(both.extra["text_scores"][1], text.scores[0], atol=1e-5)


def test_llava_next_video_is_refused_with_the_reason():
    cfg = transformers.LlavaNextVideoConfig(vision_config=transformers.CLIPVisionConfig(**VISION).to_dict(),
                                            text_config=transformers.LlamaConfig(**TEXT).to_dict(),
                                            image_token_index=IMG, video_token_index=IMG + 1)
    model = transformers.LlavaNextVideoForConditionalGeneration(cfg).eval()
    with pytest.raises(UnsupportedModelError, match="any-resolution"):
        attnroll.capture(model)
