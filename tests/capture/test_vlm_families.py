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

# Tiny multi-part models (VLMs, hybrids, token mixers, mixtures of experts): left out of `make test-fast`.
pytestmark = pytest.mark.slow

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


def dependence(model, inp, n=None):
    """(T, n) bool over the vision tokens (CLS included): which image features change when one token of the
    projector's input is perturbed (the vision tower's output for InternVL, whose pixel shuffle comes before
    its projector): the model's own vision-to-language map."""
    base = image_features(model, inp)
    name = model.config.model_type
    n = SIZES[name][1] if n is None else n
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


# ------------------------------------------------------------------------------- any-resolution tiles
PINPOINTS = [[32, 64], [64, 32], [64, 64]]
H0, W0 = 40, 70  # the user's image: 4 tiles of the 64×64 pinpoint + the base view


def build_anyres(name):
    torch.manual_seed(0)
    if name == "llava_next":
        c = T.LlavaNextConfig(vision_config=T.CLIPVisionConfig(**VISION).to_dict(),
                              text_config=T.LlamaConfig(**TEXT).to_dict(), image_token_index=IMG,
                              image_grid_pinpoints=PINPOINTS)
        model = T.LlavaNextForConditionalGeneration(c).eval()
    else:
        c = T.LlavaOnevisionConfig(vision_config=_siglip(), text_config=T.Qwen2Config(**TEXT).to_dict(),
                                   image_token_index=IMG, image_grid_pinpoints=PINPOINTS)
        model = T.LlavaOnevisionForConditionalGeneration(c).eval()
    with torch.no_grad():
        for p in tower_of(model).parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.25)
    return model


def coordinate_image():
    """(3, H0, W0): channel 0 = x, channel 1 = y (pixel centres, in [0, 1]), channel 2 = 1 inside the image."""
    yy, xx = torch.meshgrid((torch.arange(H0) + 0.5) / H0, (torch.arange(W0) + 0.5) / W0, indexing="ij")
    return torch.stack([xx, yy, torch.ones(H0, W0)])


def anyres_inputs(name, model, image=None, extra=10):
    if name == "llava_next":
        proc = T.LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                         image_grid_pinpoints=PINPOINTS, do_normalize=False, do_rescale=False,
                                         do_center_crop=False)
    else:
        proc = T.LlavaOnevisionImageProcessor(size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS,
                                              do_normalize=False, do_rescale=False)
    out = dict(proc(images=[coordinate_image() if image is None else image], return_tensors="pt"))
    with torch.no_grad():
        feats = model.model.get_image_features(out["pixel_values"], out["image_sizes"]).pooler_output
    n = sum(f.shape[0] for f in feats)
    ids = torch.randint(3, 99, (1, n + extra), generator=torch.Generator().manual_seed(1))
    ids[0, 2:2 + n] = IMG
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **out}


ANYRES = ["llava_next", "llava_onevision"]


@pytest.mark.parametrize("name", ANYRES)
def test_tiles_round_trip_to_the_original_image(name):
    """Every tile token lands on the canvas cell that holds the original-image point its pixels came from (the
    processor's own tiles of an image whose pixels are their coordinates); padding and CLS tokens on slot 0; a
    base-view token mostly on the cell under its centre."""
    model = build_anyres(name)
    inp = anyres_inputs(name, model)
    P = attnroll.capture(model, inp).info["language"].link.placement
    px = inp["pixel_values"][0]
    first = 1 if name == "llava_next" else 0
    Hc, Wc = P.grid
    assert P.prefix == 1 and abs(Hc / Wc - H0 / W0) < 0.1
    checked = 0
    for i in range(px.shape[0]):
        for r in range(8):
            for c in range(8):
                patch = px[i, :, 4 * r:4 * r + 4, 4 * c:4 * c + 4]
                sel = (P.item == i) & (P.token == first + r * 8 + c)
                cells, w = P.cell[sel], P.weight[sel]
                assert float(w.sum()) == pytest.approx(1.0, abs=1e-6)
                x, y = float(patch[0].mean()), float(patch[1].mean())
                want = 1 + min(int(y * Hc), Hc - 1) * Wc + min(int(x * Wc), Wc - 1)
                if i == 0:  # the cell under the centre takes the largest share (ties at cell borders)
                    assert float(w[cells == want].sum()) == pytest.approx(float(w.max()), abs=1e-6)
                elif float(patch[2].max()) < 0.01:
                    assert cells.tolist() == [0]
                elif float(patch[2].min()) > 0.99:
                    assert cells.tolist() == [want]
                checked += 1
    assert checked == px.shape[0] * 64
    if first:
        assert P.cell[P.token == 0].unique().tolist() == [0]


def anyres_dependence(model, inp):
    """(T, N, n) bool: which image features change when one (item, token) of the projector's input is
    perturbed; newline features depend on nothing."""
    kw = {"image_sizes": inp["image_sizes"]}
    with torch.no_grad():
        base = torch.cat(list(model.model.get_image_features(inp["pixel_values"], **kw).pooler_output))
    proj = model.model.multi_modal_projector
    seen = []
    h = proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
    with torch.no_grad():
        model.model.get_image_features(inp["pixel_values"], **kw)
    h.remove()
    N, n, D = seen[0]
    bump = 3.0 * torch.randn(D, generator=torch.Generator().manual_seed(5))
    out = torch.zeros(base.shape[0], N, n, dtype=torch.bool)
    for i in range(N):
        for v in range(n):
            def pre(_m, a, i=i, v=v):
                x = a[0].clone()
                x[i, v] += bump
                return (x, *a[1:])
            handle = proj.register_forward_pre_hook(pre)
            with torch.no_grad():
                changed = torch.cat(list(model.model.get_image_features(inp["pixel_values"], **kw).pooler_output))
            handle.remove()
            out[:, i, v] = (changed - base).abs().amax(dim=-1) > 1e-6
    return out


@pytest.mark.parametrize("name", ANYRES)
def test_anyres_streams_map_and_shares(name):
    """The vision stream is the tiles' own eager attention; the canvas map is the naive composition (language
    row -> image tokens -> the tile tokens each depends on -> per-tile vision rollout) put through the
    placement (checked above); newline shares spread over their rows; image + text shares add to 1."""
    model = build_anyres(name)
    inp = anyres_inputs(name, model)
    rec = attnroll.capture(model, inp)
    ref = eager_copy(model)
    with torch.no_grad():
        vision = vision_call(ref, inp).attentions
        lang = ref(**inp, output_attentions=True).attentions
    for a, b in zip(rec.streams["vision"], vision):
        assert torch.allclose(a, b, atol=1e-5)
    e = attnroll.explain(model, inp, "rollout")
    link = rec.info["language"].link
    row = naive_rollout([t[0].double().numpy() for t in lang])[-1]
    dep = anyres_dependence(model, inp).double()
    first = 1 if name == "llava_next" else 0
    used = len(vision) - 1 if name == "llava_next" else len(vision)  # vision_feature_layer -2 / -1
    positions = [p for p in range(row.shape[0]) if int(inp["input_ids"][0, p]) == IMG]
    N, n_v = vision[0].shape[0], vision[0].shape[-1]
    M = np.zeros((N, n_v))
    newline = 0.0
    for j, p in enumerate(positions):
        if float(dep[j].sum()) == 0:
            newline += row[p]
            continue
        F = (dep[j] / dep[j].sum()).numpy()
        for i in range(N):
            if F[i].any():
                R_v = naive_rollout([t[i].double().numpy() for t in vision[:used]])
                M[i] += row[p] * (F[i] @ R_v[first:])
    P = link.placement
    canvas = np.zeros(P.prefix + P.grid[0] * P.grid[1])
    np.add.at(canvas, P.cell.numpy(), M[P.item.numpy(), P.token.numpy()] * P.weight.double().numpy())
    direct = e.full_row[0].numpy() - canvas
    assert float(e.extra["newline_share"][0]) == pytest.approx(newline, abs=1e-5)
    assert abs(direct.sum() - newline) < 1e-5 and direct.min() > -1e-5
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0, abs=1e-5)
    assert e.grid == P.grid and e.scores.shape == (1, P.grid[0] * P.grid[1])


@pytest.mark.parametrize("name", ANYRES)
def test_anyres_map_changes_with_the_image_and_the_vision_weights(name):
    model = build_anyres(name)
    inp = anyres_inputs(name, model)
    e = attnroll.explain(model, inp, "rollout")
    other = anyres_inputs(name, model, image=torch.rand(3, H0, W0, generator=torch.Generator().manual_seed(3)))
    assert not torch.allclose(attnroll.explain(model, other, "rollout").scores, e.scores, atol=1e-4)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in tower_of(changed).parameters():
            p.add_(0.2 * torch.randn_like(p))
    assert not torch.allclose(attnroll.explain(changed, inp, "rollout").scores, e.scores, atol=1e-4)


# ------------------------------------------------------------------------------- refusals
def test_several_vision_items_in_one_prompt_are_refused_naming_the_tiles():
    model = build("idefics3")
    inp = prompt("idefics3", extra=26)
    inp["input_ids"][0, 20:36] = IMG  # a second view's 16 tokens
    inp["pixel_values"] = torch.randn(1, 2, 3, 32, 32)
    with pytest.raises(ValueError, match="do_image_splitting=False"):
        attnroll.explain(model, inp, "rollout")


def blip2():
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8)
    qc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, encoder_hidden_size=32)
    return T.Blip2ForConditionalGeneration(T.Blip2Config(vision_config=vc, qformer_config=qc,
                                                         text_config=T.OPTConfig(**{**TEXT, "ffn_dim": 64}).to_dict(),
                                                         num_query_tokens=4))


def mllama():
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=4,
              image_size=32, patch_size=8, max_num_tiles=4, vision_output_dim=64, intermediate_layers_indices=[0])
    tc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=120, cross_attention_layers=[1], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return T.MllamaForConditionalGeneration(T.MllamaConfig(vision_config=vc, text_config=tc, image_token_index=100))


def llama4():
    tc = T.Llama4TextConfig(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=120,
                            num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=1,
                            no_rope_layers=[1, 1], attention_chunk_size=64)
    vc = T.Llama4VisionConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=4, pixel_shuffle_ratio=0.5, projector_input_dim=32,
                              projector_output_dim=32, vision_output_dim=32)
    return T.Llama4ForConditionalGeneration(T.Llama4Config(vision_config=vc.to_dict(), text_config=tc.to_dict(),
                                                           image_token_index=IMG))


@pytest.mark.parametrize("make, words", [(blip2, "Q-Former.*image_token_index is None"), (mllama, "gated cross-attention layers"),
                                         (llama4, r"\(llama4\) is not composed")])
def test_families_that_cannot_be_composed_are_refused_naming_their_obstacle(make, words):
    torch.manual_seed(0)
    with pytest.raises(attnroll.UnsupportedModelError, match=words):
        attnroll.capture(make().eval(), {"input_ids": torch.tensor([[1, 2, 3]])})


def test_llama4_is_refused_whether_or_not_transformers_own_forward_runs():
    """transformers 5.24's own forward fails on Llama 4 ('image_outputs'); 5.25's runs. Either way attnroll refuses
    it as not composed, on the inputs a user would give."""
    torch.manual_seed(0)
    model = llama4().eval()
    ids = torch.randint(3, 99, (1, 30))
    ids[0, 2:18] = IMG
    inputs = {"input_ids": ids, "pixel_values": torch.randn(1, 3, 32, 32), "attention_mask": torch.ones_like(ids)}
    try:
        with torch.no_grad():
            model(**inputs)
    except AttributeError as e:
        assert "image_outputs" in str(e)
    with pytest.raises(attnroll.UnsupportedModelError, match=r"\(llama4\) is not composed"):
        attnroll.explain(model, inputs, "rollout")


# ------------------------------------------------------------------------------- batches, gradients, state
@pytest.mark.parametrize("name", ["gemma3", "idefics3"])
def test_a_batch_equals_its_single_prompts_and_the_model_is_unchanged(name):
    from .helpers import snapshot

    model = build(name)
    one, two = prompt(name, start=2, seed=1), prompt(name, start=4, seed=2)
    with torch.no_grad():
        model(**one)  # transformers installs its own recorders on the first call, for good
    before = snapshot(model)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    both = {k: torch.cat([one[k], two[k]]) for k in one}
    e = attnroll.explain(model, both, "rollout")
    for b, alone in enumerate((one, two)):
        a = attnroll.explain(model, alone, "rollout")
        assert torch.allclose(a.scores[0], e.scores[b], atol=1e-5)
        assert torch.allclose(a.extra["text_scores"][0], e.extra["text_scores"][b], atol=1e-5)
    assert snapshot(model) == before
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name, method", [("vipllava", "gae"), ("gemma3", "grad_rollout"), ("llava_next", "gae")])
def test_gradient_methods_compose_and_shares_add_to_the_rows_total(name, method):
    model = build_anyres(name) if name in ANYRES else build(name)
    inp = anyres_inputs(name, model) if name in ANYRES else prompt(name)
    e = attnroll.explain(model, inp, method, target=5)
    total = float(e.extra["language_row"][0].sum())
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(total, rel=1e-5)
    assert float(e.extra["image_share"][0]) > 0 and float(e.scores.abs().sum()) > 0


@pytest.mark.parametrize("name", ANYRES)
def test_a_dominant_tile_token_or_newline_lands_on_its_place(name):
    """A one-hot language row on one image token, the vision layers skipped: a tile token's whole share lands
    on the canvas cell holding the original-image point its pixels came from; a newline's spreads evenly over
    one canvas row."""
    from attnroll.explain.linked import compose_link

    model = build_anyres(name)
    inp = anyres_inputs(name, model)
    rec = attnroll.capture(model, inp)
    link = rec.info["language"].link
    P = link.placement
    Hc, Wc = P.grid
    px = inp["pixel_values"][0]
    first = 1 if name == "llava_next" else 0
    ex, pos = link.example.tolist(), link.position.tolist()
    checked = 0
    for k in range(0, link.item.numel(), 37):
        i, v = int(link.item[k]), int(link.token[k]) - first
        patch = px[i, :, 4 * (v // 8):4 * (v // 8) + 4, 4 * (v % 8):4 * (v % 8) + 4]
        if i == 0 or float(patch[2].min()) < 0.99:
            continue  # base view (by area) and border patches are checked in the round trip
        row = torch.zeros(1, inp["input_ids"].shape[1])
        row[ex[k], pos[k]] = 1.0
        image, _, _ = compose_link(row, link, rec.stream_shape("vision"), lambda s, r, kk: r.weights, "language")
        x, y = float(patch[0].mean()), float(patch[1].mean())
        assert int(image[0].argmax()) == 1 + int(y * Hc) * Wc + int(x * Wc)
        assert float(image[0].max()) == pytest.approx(1.0, abs=1e-6)
        checked += 1
    assert checked >= 3
    newline = int(P.direct[1][0])
    row = torch.zeros(1, inp["input_ids"].shape[1])
    row[0, newline] = 1.0
    image, text, _ = compose_link(row, link, rec.stream_shape("vision"), lambda s, r, kk: r.weights, "language")
    hit = torch.nonzero(image[0]).reshape(-1) - 1
    assert float(text.abs().sum()) == 0 and float(image.sum()) == pytest.approx(1.0, abs=1e-6)
    assert (hit // Wc).unique().numel() == 1 and hit.numel() == Wc


def test_mistral3_maps_a_non_square_image_on_its_own_grid():
    """Pixtral takes the image at its own size: 32×48 pixels are an 8×12 patch grid, 4×6 merged tokens."""
    from attnroll.explain.linked import compose_link

    model = build("mistral3")
    ids = torch.randint(3, 99, (1, 34), generator=torch.Generator().manual_seed(1))
    ids[0, 2:26] = IMG
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(1, 3, 32, 48),
           "image_sizes": torch.tensor([[32, 48]])}
    e = attnroll.explain(model, inp, "rollout")
    assert e.grid == (8, 12) and float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0)
    rec = attnroll.capture(model, inp)
    link = rec.info["language"].link
    dep = dependence(model, inp, n=96)
    for j in (0, 7, 23):
        row = torch.zeros(1, 34)
        row[0, 2 + j] = 1.0
        image, _, _ = compose_link(row, link, rec.stream_shape("vision"), lambda s, r, k: r.weights, "language")
        assert torch.nonzero(image[0]).reshape(-1).tolist() == torch.nonzero(dep[j]).reshape(-1).tolist()


@pytest.mark.parametrize("name", ["idefics3", "smolvlm"])
def test_a_padded_view_is_mapped_on_the_image_s_own_patches(name):
    """A 20×28-pixel image padded to 32×32 (pixel_attention_mask): the map lies on its 5×7 patches, the padding
    patches' relevance on slot 0; the vision stream is still the model's own eager attention."""
    model = build(name)
    inp = prompt(name)
    mask = torch.zeros(1, 1, 32, 32, dtype=torch.long)
    mask[..., :20, :28] = 1
    inp["pixel_values"] = inp["pixel_values"] * mask[:, :, None]
    inp["pixel_attention_mask"] = mask
    e = attnroll.explain(model, inp, "rollout")
    plain = attnroll.explain(model, {k: v for k, v in inp.items() if k != "pixel_attention_mask"}, "rollout")
    assert e.grid == (5, 7) and e.prefix == 1 and e.scores.shape == (1, 35)
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0, abs=1e-5)
    assert float(e.full_row[0].sum()) == pytest.approx(float(e.extra["image_share"][0]), abs=1e-6)
    assert plain.grid == (8, 8)
    rec = attnroll.capture(model, inp)
    ref = eager_copy(model)
    px = inp["pixel_values"].flatten(0, 1)
    with torch.no_grad():
        full = ref(**inp, output_attentions=True)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(rec.streams["language"], full.attentions))
    assert rec.streams["vision"][0].shape == (1, 4, 64, 64) and px.shape[0] == 1


def test_an_anyres_explanation_saves_and_loads(tmp_path):
    model = build_anyres("llava_next")
    e = attnroll.explain(model, anyres_inputs("llava_next", model), "rollout")
    back = attnroll.Explanation.load(e.save(tmp_path / "anyres.npz"))
    assert back.grid == e.grid and torch.equal(back.scores, e.scores) and back.as_grid().shape == (1, *e.grid)
    assert torch.equal(back.extra["newline_share"], e.extra["newline_share"])
    assert back.extra["placement"] == e.extra["placement"]
