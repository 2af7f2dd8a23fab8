"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL on tiny random-weight configs: the vision tower's chunked kernels against
an eager recomputation written here from each attention module's own input (its qkv projection and rotary
embedding, per chunk of the cu_seqlens it was called with), the composed map against a naive dense
composition, shares, the 2×2 merger, window order, several images per prompt, refusals."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch

import attnroll
from attnroll import UnsupportedModelError

transformers = pytest.importorskip("transformers")

from attnroll.capture.qwen_vl import capture_qwen_vl, vision_layers  # noqa: E402
from attnroll.core.chunked import chunked_probs  # noqa: E402

# Tiny multi-part models (VLMs, hybrids, token mixers, mixtures of experts): left out of `make test-fast`.
pytestmark = pytest.mark.slow

IMG, VSTART, VEND = 150, 152, 153
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=160, max_position_embeddings=256)
ROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
IDS = dict(image_token_id=IMG, video_token_id=151, vision_start_token_id=VSTART, vision_end_token_id=VEND)
VISION = dict(hidden_size=32, num_heads=4, patch_size=4)


def qwen2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2VLConfig(text_config=dict(TEXT, rope_parameters=ROPE), **IDS,
                                     vision_config=dict(VISION, depth=2, embed_dim=32, mlp_ratio=2))
    return transformers.Qwen2VLForConditionalGeneration(cfg).eval()


def qwen25(seed=0):
    torch.manual_seed(seed)
    vc = dict(VISION, depth=3, intermediate_size=64, window_size=16, fullatt_block_indexes=[1], out_hidden_size=32)
    cfg = transformers.Qwen2_5_VLConfig(text_config=dict(TEXT, rope_parameters=ROPE), vision_config=vc, **IDS)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()


def qwen3(seed=0):
    torch.manual_seed(seed)
    vc = dict(VISION, depth=3, intermediate_size=64, out_hidden_size=32, num_position_embeddings=64,
              deepstack_visual_indexes=[1])
    tc = dict(TEXT, head_dim=8, rope_parameters=dict(ROPE, mrope_interleaved=True))
    cfg = transformers.Qwen3VLConfig(text_config=tc, vision_config=vc, **IDS)
    return transformers.Qwen3VLForConditionalGeneration(cfg).eval()


BUILD = {"qwen2_vl": qwen2, "qwen2_5_vl": qwen25, "qwen3_vl": qwen3}


def prompt(model, grids=((1, 8, 8),), n_text=6, seed=1):
    """One prompt, as the processor lays it out: text, then per image <start> image tokens (one per 2×2 merged
    patches) <end> and a little text; pixel_values one row per patch."""
    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    ids = torch.randint(3, 99, (n_text,), generator=g).tolist()
    for t, h, w in grids:
        ids += [VSTART] + [IMG] * (t * h * w // 4) + [VEND] + torch.randint(3, 99, (3,), generator=g).tolist()
    ids = torch.tensor([ids])
    n = sum(t * h * w for t, h, w in grids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMG).long(),
            "pixel_values": torch.randn(n, 3 * vc.temporal_patch_size * vc.patch_size ** 2, generator=g),
            "image_grid_thw": torch.tensor(grids)}


def own_vision_attention(model, inp, *, in_graph=False):
    """Per vision layer the dense (H, N, N) probabilities computed here from what each attention module received
    (its own qkv projection and rotary function, softmax(q·kᵀ/√d) per chunk of its cu_seqlens), and whether
    proj(P·v) reproduced the module's output. ``in_graph``: float32, and the module's output replaced by
    proj(P·v), so that the model's output is computed from these P (their .grad after a backward)."""
    visual = model.model.visual
    out, ok = [], []

    def hook(module, args, kwargs, output):
        x, cu, (cos, sin) = args[0], kwargs["cu_seqlens"], kwargs["position_embeddings"]
        n = x.shape[0]
        q, k, v = module.qkv(x).reshape(n, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = sys.modules[type(module).__module__].apply_rotary_pos_emb_vision(q, k, cos, sin)
        dt = torch.float32 if in_graph else torch.float64
        q, k, v = (t.transpose(0, 1).to(dt) for t in (q, k, v))  # (H, N, d)
        blocks = [torch.zeros(q.shape[0], n, n, dtype=dt)]
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            blocks.append(torch.nn.functional.pad(
                torch.softmax(q[:, s:e] @ k[:, s:e].transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1),
                (s, n - e, s, n - e)))
        P = sum(blocks)
        y = module.proj((P @ v).transpose(0, 1).reshape(n, -1).float())
        if in_graph:
            P.retain_grad()
        out.append(P)
        ok.append(torch.allclose(y, output, atol=1e-5))
        return y if in_graph else None

    handles = [b.attn.register_forward_hook(hook, with_kwargs=True) for b in visual.blocks]
    try:
        with torch.enable_grad() if in_graph else torch.no_grad():
            outputs = model(**inp)
    finally:
        for h in handles:
            h.remove()
    return (out, ok, outputs) if in_graph else (out, ok)


def language_attention(model, inp):
    cfg = copy.deepcopy(model.config)
    for c in (cfg, cfg.vision_config, cfg.text_config):
        c._attn_implementation = "eager"
    ref = type(model)(cfg).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        return [a[0].double() for a in ref(**inp, output_attentions=True).attentions]


def sharp(model):
    """The vision tower's attention far from uniform (the default initialisation gives nearly flat rows)."""
    with torch.no_grad():
        for blk in model.model.visual.blocks:
            blk.attn.qkv.weight.normal_(0, 1.0)
    return model


def naive_rollout(layers):
    n = layers[0].shape[-1]
    R = torch.eye(n, dtype=torch.float64)
    for a in layers:
        R = (0.5 * a.mean(dim=0) + 0.5 * torch.eye(n, dtype=torch.float64)) @ R
    return R


@pytest.mark.parametrize("name", list(BUILD))
def test_vision_stream_equals_the_eager_recomputation_of_its_own_q_k(name):
    model = sharp(BUILD[name]())
    inp = prompt(model, grids=((1, 8, 8), (1, 4, 8)))
    rec = capture_qwen_vl(model, inp)
    want, reproduced = own_vision_attention(model, inp)
    got = vision_layers(rec)
    assert len(got) == len(want) and all(reproduced)
    for layer, P in zip(got, want):
        assert torch.allclose(chunked_probs(layer).double(), P, atol=1e-5)
    sizes = [[c.stop - c.start for c in layer.chunks] for layer in got]
    if name == "qwen2_5_vl":  # windows of 4x4 patches in layers 0 and 2, whole images in the full layer 1
        assert sizes == [[16] * 6, [64, 32], [16] * 6]
    else:
        assert all(s == [64, 32] for s in sizes)


@pytest.mark.parametrize("name", list(BUILD))
def test_the_map_equals_a_naive_dense_composition_and_shares_add_to_one(name):
    model = sharp(BUILD[name]())
    inp = prompt(model)
    e = attnroll.explain(model, inp, "rollout")
    lang = language_attention(model, inp)
    row = naive_rollout(lang)[-1]
    vision, _ = own_vision_attention(model, inp)
    R_v = naive_rollout(vision)  # tower order
    geo = capture_qwen_vl(model, inp).geometry
    ids = inp["input_ids"][0]
    positions = (ids == IMG).nonzero()[:, 0]
    reads = [len(vision) - 1] + ([1] if name == "qwen3_vl" else [])  # Qwen3-VL: deepstack after block 1
    tower = torch.zeros(R_v.shape[0], dtype=torch.float64)
    for k, p in enumerate(positions.tolist()):
        for read in reads:
            R = naive_rollout(vision[:read + 1])
            for src in geo.units[k].tolist():
                tower += row[p] / len(reads) / 4 * R[src]
    orig = tower[geo.tower_of]
    want = torch.zeros(64, dtype=torch.float64)
    want[geo.hw[:, 0] * 8 + geo.hw[:, 1]] = orig
    assert e.grid == (8, 8) and torch.allclose(e.scores[0].double(), want, atol=1e-5)
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0, abs=1e-5)
    assert float(e.scores.sum()) == pytest.approx(float(row[positions].sum()), abs=1e-5)
    text = row.clone()
    text[positions] = 0
    assert torch.allclose(e.extra["text_scores"][0].double(), text, atol=1e-5)


@pytest.mark.parametrize("name", list(BUILD))
def test_a_dominant_image_token_maps_back_to_its_2x2_patches(name):
    """With alpha=1 every layer is the identity: the readout's one image token keeps the whole row, and the map
    is ¼ on exactly the 2×2 patches the merger folded into it (Qwen2.5-VL: a merged token in the second window
    of the first merged row, so the window order must be undone)."""
    model = BUILD[name]()
    inp = prompt(model)
    positions = (inp["input_ids"][0] == IMG).nonzero()[:, 0].tolist()
    for k in (0, 2, 7, 13):  # merged token k sits at (k // 4, k % 4) on the 4x4 merged grid
        e = attnroll.explain(model, inp, "rollout", alpha=1.0, position=positions[k])
        i, j = divmod(k, 4)
        want = torch.zeros(8, 8)
        want[2 * i:2 * i + 2, 2 * j:2 * j + 2] = 0.25
        assert torch.allclose(e.as_grid()[0], want, atol=1e-6), (k, e.as_grid()[0])


@pytest.mark.parametrize("name", list(BUILD))
def test_the_map_changes_with_the_image_and_the_vision_weights(name):
    model = sharp(BUILD[name]())
    inp = prompt(model)
    base = attnroll.explain(model, inp, "rollout").scores
    other = dict(inp, pixel_values=torch.randn_like(inp["pixel_values"]))
    changed = copy.deepcopy(model)
    with torch.no_grad():
        qkv = changed.model.visual.blocks[0].attn.qkv.weight
        qkv.copy_(torch.randn_like(qkv))
    for new in (attnroll.explain(model, other, "rollout").scores, attnroll.explain(changed, inp, "rollout").scores):
        assert float((new - base).abs().max()) > 0.05 * float(base.abs().max())


@pytest.mark.parametrize("name", list(BUILD))
def test_two_images_in_one_prompt_each_get_a_map(name):
    model = BUILD[name]()
    inp = prompt(model, grids=((1, 8, 8), (1, 4, 8)))
    e = attnroll.explain(model, inp, "rollout")
    maps = e.extra["image_maps"][0]
    assert [tuple(m.shape) for m in maps] == [(8, 8), (4, 8)] and e.grid is None
    assert e.extra["image_grids"] == [[[8, 8], [4, 8]]] and e.extra["image_pixels"] == [[[32, 32], [16, 32]]]
    row = e.extra["language_row"][0]
    pos = (inp["input_ids"][0] == IMG).nonzero()[:, 0]
    assert float(maps[0].sum()) == pytest.approx(float(row[pos[:16]].sum()), abs=1e-5)
    assert float(maps[1].sum()) == pytest.approx(float(row[pos[16:]].sum()), abs=1e-5)
    assert torch.allclose(e.scores[0], torch.cat([maps[0].reshape(-1), maps[1].reshape(-1)]))
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("method", ["raw", "grad_rollout", "gae"])
def test_other_methods_compose_and_shares_add_to_the_rows_total(method):
    model = qwen25()
    inp = prompt(model, grids=((1, 8, 8), (1, 4, 8)))
    e = attnroll.explain(model, inp, method, target=5)
    total = float(e.extra["language_row"][0].sum())
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(total, rel=1e-5)
    assert float(e.scores.abs().sum()) > 0 and torch.isfinite(e.scores).all()
    assert e.target == [5] or method == "raw"


def test_gradients_reach_every_vision_chunk():
    from attnroll.capture.qwen_vl import attach_gradients

    model = qwen25()
    inp = prompt(model)
    rec = capture_qwen_vl(model, inp, keep_grad=True)
    attach_gradients(rec, rec.outputs.logits[:, -1, 5])
    for layer in vision_layers(rec):
        assert all(float(c.layer.grad_out.abs().sum()) > 0 for c in layer.chunks)


def test_refusals_say_why():
    model = qwen2()
    inp = prompt(model)
    with pytest.raises(UnsupportedModelError, match="returns no probabilities"):
        attnroll.capture(model, inp)
    for method, match in (("flow", "does not compose"), ("alti", "does not compose")):
        with pytest.raises(ValueError, match=match):
            attnroll.explain(model, inp, method)
    with pytest.raises(ValueError, match="no dense route"):
        attnroll.explain(model, inp, "rollout", attention="dense")
    with pytest.raises(ValueError, match="discard_ratio"):
        attnroll.explain(model, inp, "rollout", discard_ratio=0.5)
    text = {k: v for k, v in inp.items() if k not in ("pixel_values", "image_grid_thw")}
    text["input_ids"] = torch.where(text["input_ids"] == IMG, 7, text["input_ids"])
    text["mm_token_type_ids"] = torch.zeros_like(text["input_ids"])
    alone = attnroll.explain(model, text, "rollout")  # no image: the prompt's tokens, as a language model
    row = naive_rollout(language_attention(model, text))[-1]
    assert alone.grid is None and torch.allclose(alone.scores[0].double(), row, atol=1e-5)
    with pytest.raises(ValueError, match="video"):
        attnroll.explain(model, dict(inp, pixel_values_videos=inp["pixel_values"]), "rollout")


def test_the_model_is_left_as_it_was():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from attnroll.capture.transformers_private import sdpa_kernel

    from .helpers import snapshot

    model = qwen25().train()
    model.model.visual.blocks[1].eval()
    before, params = snapshot(model), {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.requires_grad for k, p in model.named_parameters()}
    for method in ("rollout", "gae"):
        attnroll.explain(model, prompt(model), method)
    assert snapshot(model) == before and {k: p.requires_grad for k, p in model.named_parameters()} == grads
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is sdpa_kernel()
    assert attnroll.capture.model_facts(model).stream_inputs == {"vision": "pixel_values", "language": "input_ids"}


def test_the_explanation_saves_and_loads(tmp_path):
    model = qwen3()
    e = attnroll.explain(model, prompt(model), "rollout")
    back = attnroll.Explanation.load(e.save(tmp_path / "qwen.npz"))
    assert back.grid == (8, 8) and torch.equal(back.scores, e.scores)
    assert np.allclose(np.asarray(back.extra["image_maps"][0][0]), e.extra["image_maps"][0][0].numpy())


def _pad(x, n):
    return torch.nn.functional.pad(x, (0, n - x.shape[1]))


@pytest.mark.parametrize("method", ["rollout", "gae"])
def test_a_padded_batch_of_prompts_equals_each_prompt_alone(method):
    model = sharp(qwen25())
    a, b = prompt(model, seed=1), prompt(model, grids=((1, 4, 8),), seed=2)
    n = a["input_ids"].shape[1]
    both = {k: torch.cat([_pad(a[k], n), _pad(b[k], n)]) for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    both.update(pixel_values=torch.cat([a["pixel_values"], b["pixel_values"]]),
                image_grid_thw=torch.cat([a["image_grid_thw"], b["image_grid_thw"]]))
    e = attnroll.explain(model, both, method, target=5)
    assert e.extra["image_grids"] == [[[8, 8]], [[4, 8]]] and e.scores.shape == (2, 64)
    for i, one in enumerate((a, b)):
        alone = attnroll.explain(model, one, method, target=5)
        m = one["input_ids"].shape[1]
        assert torch.allclose(e.extra["image_maps"][i][0], alone.extra["image_maps"][0][0], atol=1e-6)
        assert torch.allclose(e.extra["text_scores"][i, :m], alone.extra["text_scores"][0], atol=1e-6)
        assert float(e.extra["text_scores"][i, m:].abs().sum()) == 0


def naive_gae(atts, grads):
    """R = Π (I + mean_h((dy/dA ⊙ A)^+)) written out, layers (H, n, n) first to last."""
    n = atts[0].shape[-1]
    R = torch.eye(n, dtype=torch.float64)
    for a, g in zip(atts, grads):
        R = R + (a.detach().double() * g.double()).clamp(min=0).mean(dim=0) @ R
    return R


def test_gae_equals_a_naive_composition_on_dense_gradients():
    """The language model's eager attentions and the vision tower's per-chunk probabilities, both put in the
    model's graph here, differentiated by autograd; gae written out on them and composed through the 2×2
    merger and the window order."""
    model = sharp(qwen25())
    inp = prompt(model)
    e = attnroll.explain(model, inp, "gae", target=5)
    ref = copy.deepcopy(model)
    for c in (ref.config, ref.config.vision_config, ref.config.text_config):
        c._attn_implementation = "eager"
    vision, _, outputs = own_vision_attention(ref, dict(inp, output_attentions=True), in_graph=True)
    lang = list(outputs.attentions)
    grads = torch.autograd.grad(outputs.logits[0, -1, 5], lang + vision)
    row = naive_gae([a[0] for a in lang], [g[0] for g in grads[:len(lang)]])[-1]
    R_v = naive_gae(vision, grads[len(lang):])
    geo = capture_qwen_vl(model, inp).geometry
    positions = (inp["input_ids"][0] == IMG).nonzero()[:, 0]
    tower = sum(row[p] / 4 * R_v[src] for k, p in enumerate(positions.tolist()) for src in geo.units[k].tolist())
    tower = tower * float(row[positions].sum()) / float(tower.sum())  # the map sums to the image tokens' share
    want = torch.zeros(64, dtype=torch.float64)
    want[geo.hw[:, 0] * 8 + geo.hw[:, 1]] = tower[geo.tower_of]
    assert torch.allclose(e.extra["language_row"][0].double(), row, rtol=1e-4, atol=1e-6)
    assert torch.allclose(e.scores[0].double(), want, rtol=1e-4, atol=1e-6)
