"""VLM families whose image tokens are linear maps of the vision tokens (capture/vlm_maps.py), on tiny random
configs: the streams against each model's own eager attention; the vision-to-language map against the model's
own projector (which vision tokens each image feature depends on, found by perturbing one vision token at the
read layer; Gemma 3's pooled features exactly); the composed map against a naive numpy composition written
here; shares adding up; the map following the image and the vision weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import attnroll

from .test_vlm import eager_copy

transformers = pytest.importorskip("transformers")
T = transformers

IMG = 100
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=120, max_position_embeddings=128)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
              patch_size=4)


def _siglip():
    return T.SiglipVisionConfig(**VISION, vision_use_head=False).to_dict()


def _build(name):
    if name == "vipllava":
        c = T.VipLlavaConfig(vision_config=T.CLIPVisionConfig(**VISION).to_dict(),
                             text_config=T.LlamaConfig(**TEXT).to_dict(), image_token_index=IMG,
                             vision_feature_layer=[-2, 0, 1])
        return T.VipLlavaForConditionalGeneration(c).eval()
    if name == "gemma3":
        c = T.Gemma3Config(vision_config=_siglip(), text_config=T.Gemma3TextConfig(**TEXT, head_dim=8).to_dict(),
                           image_token_index=IMG, mm_tokens_per_image=16)
        return T.Gemma3ForConditionalGeneration(c).eval()
    if name in ("idefics3", "smolvlm"):
        cls = (T.Idefics3Config, T.Idefics3ForConditionalGeneration) if name == "idefics3" else (
            T.SmolVLMConfig, T.SmolVLMForConditionalGeneration)
        return cls[1](cls[0](vision_config=dict(VISION), text_config=T.LlamaConfig(**TEXT).to_dict(),
                             image_token_id=IMG, scale_factor=2)).eval()
    if name == "internvl":
        vc = dict(VISION, image_size=[32, 32], patch_size=[4, 4])
        c = T.InternVLConfig(vision_config=vc, text_config=T.Qwen2Config(**TEXT).to_dict(), image_token_id=IMG,
                             downsample_ratio=0.5)
        return T.InternVLForConditionalGeneration(c).eval()
    if name == "aya_vision":
        c = T.AyaVisionConfig(vision_config=_siglip(), text_config=T.CohereConfig(**TEXT, eos_token_id=2).to_dict(),
                              image_token_index=IMG, downsample_factor=2)
        return T.AyaVisionForConditionalGeneration(c).eval()
    if name == "mistral3":
        vc = T.PixtralVisionConfig(**VISION, head_dim=8).to_dict()
        c = T.Mistral3Config(vision_config=vc, text_config=T.MistralConfig(**TEXT, head_dim=8).to_dict(),
                             image_token_index=IMG, spatial_merge_size=2)
        return T.Mistral3ForConditionalGeneration(c).eval()
    raise KeyError(name)


def tower_of(model):
    return getattr(model.model, "vision_tower", None) or model.model.vision_model


def build(name):
    """The tiny model, its vision tower's matrices drawn larger than the init's (std 0.02 gives uniform
    attention, under which no map could depend on the image)."""
    torch.manual_seed(0)
    model = _build(name)
    with torch.no_grad():
        for p in tower_of(model).parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.25)
        if name == "gemma3":  # its projection starts at zeros: every image feature would be 0
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.25)
    return model


#: family -> (image tokens per image, vision tokens per image incl. CLS, vision layers read)
SIZES = {"vipllava": (64, 65, (2, 0, 1)), "gemma3": (16, 64, (3,)), "idefics3": (16, 64, (3,)),
         "smolvlm": (16, 64, (3,)), "internvl": (16, 65, (3,)), "aya_vision": (16, 64, (3,)),
         "mistral3": (16, 64, (3,))}
FAMILIES = list(SIZES)


def prompt(name, start=2, extra=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = SIZES[name][0]
    ids = torch.randint(3, 99, (1, n + extra), generator=g)
    ids[0, start:start + n] = IMG
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    px = torch.randn(1, 3, 32, 32, generator=g)
    inp["pixel_values"] = px[None] if name in ("idefics3", "smolvlm") else px
    if name == "mistral3":
        inp["image_sizes"] = torch.tensor([[32, 32]])
    if name == "gemma3":
        inp["token_type_ids"] = (ids == IMG).long()
    return inp


def vision_call(model, inp):
    """The vision tower called alone on the prompt's images (its own eager attentions)."""
    base = model.model
    tower = getattr(base, "vision_tower", None) or base.vision_model
    px = inp["pixel_values"]
    px = px.flatten(0, 1) if px.ndim == 5 else px
    kw = {"image_sizes": inp["image_sizes"]} if "image_sizes" in inp else {}
    return tower(px, output_attentions=True, output_hidden_states=True, **kw)


def vision_layers(model):
    base = model.model
    tower = getattr(base, "vision_tower", None) or base.vision_model
    for path in ("vision_model.encoder.layers", "encoder.layers", "encoder.layer", "transformer.layers"):
        mod = tower
        try:
            for part in path.split("."):
                mod = getattr(mod, part)
            return list(mod)
        except AttributeError:
            continue
    raise AssertionError("no vision layers")


def image_features(model, inp):
    kw = {k: inp[k] for k in ("image_sizes",) if k in inp}
    with torch.no_grad():
        out = model.model.get_image_features(inp["pixel_values"], **kw)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
    return feats.reshape(-1, feats.shape[-1])


def dependence(model, inp):
    """(T, n) bool over the vision tokens (CLS included): which image features change when one token of the
    projector's input is perturbed (the vision tower's output for InternVL, whose pixel shuffle comes before
    its projector): the model's own vision-to-language map."""
    base = image_features(model, inp)
    name = model.config.model_type
    n = SIZES[name][1]
    first = 1 if name in ("vipllava", "internvl") else 0
    out = torch.zeros(base.shape[0], n, dtype=torch.bool)
    bump = 3.0 * torch.randn(4096, generator=torch.Generator().manual_seed(5))

    def perturbed(h, v):
        h = h.clone()
        h[..., v, :] += bump[: h.shape[-1]]  # not a constant: a LayerNorm after it would remove that
        return h

    for v in range(first, n):
        if name == "internvl":
            def hook(_m, args, output, v=v):
                return type(output)(**{**output, "last_hidden_state": perturbed(output.last_hidden_state, v)})
            handle = tower_of(model).register_forward_hook(hook)
        else:
            proj = getattr(model.model, "multi_modal_projector", None) or model.model.connector
            handle = proj.register_forward_pre_hook(lambda _m, a, v=v: (perturbed(a[0], v - first), *a[1:]))
        try:
            changed = image_features(model, inp)
        finally:
            handle.remove()
        out[:, v] = (changed - base).abs().amax(dim=-1) > 1e-6
    return out


def naive_rollout(layers, n=None):
    n = layers[0].shape[-1] if layers else n
    R = np.eye(n)
    for a in layers:
        R = (0.5 * a.mean(axis=0) + 0.5 * np.eye(n)) @ R
    return R


@pytest.mark.parametrize("name", FAMILIES)
def test_streams_equal_the_models_own_eager_attention(name):
    model = build(name)
    inp = prompt(name)
    rec = attnroll.capture(model, inp)
    ref = eager_copy(model)
    with torch.no_grad():
        lang = ref(**inp, output_attentions=True).attentions
        vision = vision_call(ref, inp).attentions
    for got, want in ((rec.streams["vision"], vision), (rec.streams["language"], lang)):
        assert len(got) == len(want)
        for a, e in zip(got, want):
            assert a.shape == e.shape and torch.allclose(a, e, atol=1e-5)


def expected_map(name, model, inp):
    """The image map composed naively: language rollout row -> image tokens -> (equal shares over the vision
    tokens each image feature depends on, per read layer) -> vision rollout up to that layer."""
    ref = eager_copy(model)
    with torch.no_grad():
        lang = ref(**inp, output_attentions=True).attentions
        vision = vision_call(ref, inp).attentions
    row = naive_rollout([t[0].double().numpy() for t in lang])[-1]
    positions = [p for p in range(row.shape[0]) if int(inp["input_ids"][0, p]) == IMG]
    n = SIZES[name][1]
    out = np.zeros(n)
    layers = SIZES[name][2]
    deepest = max(layers)
    for k in layers:
        R_v = naive_rollout([t[0].double().numpy() for t in vision[:k]], n)
        dep = dependence(model, inp).double().numpy()
        if name == "gemma3":  # the pooling's weights are the model's: its pooled input, read off its forward
            dep = gemma3_pool(model, inp)
        F = dep / dep.sum(axis=1, keepdims=True)
        for j, p in enumerate(positions):
            out += row[p] * (F[j] @ R_v) / len(layers)
    return out, row, positions


def gemma3_pool(model, inp):
    """Gemma 3's averaging matrix, solved from its own pooled features: pooled = A @ last_hidden_state."""
    seen = []
    h = model.model.multi_modal_projector.mm_soft_emb_norm.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].detach()))
    try:
        image_features(model, inp)
    finally:
        h.remove()
    with torch.no_grad():
        last = vision_call(model, inp).last_hidden_state[0].double()
    pooled = seen[0][0].double()
    dep = dependence(model, inp).double()
    A = torch.zeros(pooled.shape[0], last.shape[0], dtype=torch.float64)
    for j in range(pooled.shape[0]):
        idx = torch.nonzero(dep[j]).reshape(-1)
        A[j, idx] = torch.linalg.lstsq(last[idx].T, pooled[j]).solution
    return A.numpy()


@pytest.mark.parametrize("name", FAMILIES)
def test_the_image_map_equals_a_naive_composition_and_shares_add_up(name):
    model = build(name)
    inp = prompt(name)
    e = attnroll.explain(model, inp, "rollout")
    want, row, positions = expected_map(name, model, inp)
    prefix = SIZES[name][1] - 64
    assert e.grid == (8, 8) and e.scores.shape == (1, 64)
    assert np.allclose(e.full_row[0].numpy(), want, atol=1e-5)
    assert np.allclose(e.scores[0].numpy(), want[prefix:], atol=1e-5)
    text = row.copy()
    text[positions] = 0
    assert np.allclose(e.extra["text_scores"][0].numpy(), text, atol=1e-5)
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0, abs=1e-5)
    assert e.extra["image_positions"] == [positions]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_dominant_image_token_maps_back_to_its_own_patches(name):
    """Only image token j gets the language row's mass (the composition's own maths, a one-hot row); its map,
    through the vision rollout, is the model's own patches of j when the vision layers are skipped."""
    from attnroll.explain.linked import compose_link

    model = build(name)
    inp = prompt(name)
    rec = attnroll.capture(model, inp)
    link = rec.info["language"].link
    positions = sorted(set(link.position.tolist()))
    dep = dependence(model, inp)
    prefix = SIZES[name][1] - 64
    for j in (0, len(positions) // 2, len(positions) - 1):
        row = torch.zeros(1, inp["input_ids"].shape[1])
        row[0, positions[j]] = 1.0
        image, text, _ = compose_link(row, link, rec.stream_shape("vision"), lambda s, r, k: r.weights, "language")
        assert float(text.abs().sum()) == 0 and float(image.sum()) == pytest.approx(1.0, abs=1e-6)
        got = torch.nonzero(image[0] > 1e-9).reshape(-1).tolist()
        assert got == torch.nonzero(dep[j]).reshape(-1).tolist() and all(g >= prefix for g in got)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_map_changes_with_the_image_and_the_vision_weights(name):
    model = build(name)
    inp = prompt(name)
    e = attnroll.explain(model, inp, "rollout")
    other = dict(inp, pixel_values=torch.randn_like(inp["pixel_values"]))
    assert not torch.allclose(attnroll.explain(model, other, "rollout").scores, e.scores, atol=1e-4)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in tower_of(changed).parameters():
            p.add_(0.2 * torch.randn_like(p))
    again = attnroll.explain(changed, inp, "rollout")
    assert not torch.allclose(again.scores, e.scores, atol=1e-4)
