"""BLIP-2 / InstructBLIP (capture/qformer.py): the Q-Former stage between the vision tower and the language model,
on tiny random configs. The streams against the model's own eager attention (the Q-Former's self- and
cross-attention from its own output); the map against a naive numpy composition written here from those
attentions; image + prompt + queries (+ instruction) shares adding up; a dominant query mapping back to the patches
it attends; the map following the image and the vision weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import attnroll

from .test_vlm_families import IMG, TEXT, naive_rollout

T = pytest.importorskip("transformers")

Q = 4
KINDS = ["blip-2", "instructblip"]


def build(kind, qformer_layers=2, frequency=2):
    torch.manual_seed(0)
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8)
    qc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=qformer_layers, num_attention_heads=4,
              encoder_hidden_size=32, cross_attention_frequency=frequency)
    if kind == "blip-2":
        c = T.Blip2Config(vision_config=vc, qformer_config=qc, text_config=T.OPTConfig(**{**TEXT, "ffn_dim": 64}).to_dict(),
                          num_query_tokens=Q, image_token_index=IMG)
        model = T.Blip2ForConditionalGeneration(c).eval()
    else:
        c = T.InstructBlipConfig(vision_config=vc, qformer_config=qc, text_config=T.LlamaConfig(**TEXT).to_dict(),
                                 num_query_tokens=Q, image_token_index=IMG)
        model = T.InstructBlipForConditionalGeneration(c).eval()
    with torch.no_grad():  # larger than the init's std 0.02, under which every attention is uniform
        for mod in (model.vision_model, model.qformer):
            for p in mod.parameters():
                if p.ndim >= 2:  # linear maps, the patch embedding's convolution, position embeddings
                    p.normal_(0.0, 0.25)
        model.query_tokens.normal_(0.0, 1.0)
    return model


def prompt(kind, seed=1, pixels=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (1, 12), generator=g)
    ids[0, 2:2 + Q] = IMG
    px = torch.randn(1, 3, 32, 32, generator=g) if pixels is None else pixels
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": px}
    if kind == "instructblip":
        inp["qformer_input_ids"] = torch.randint(3, 99, (1, 5), generator=g)
        inp["qformer_attention_mask"] = torch.ones(1, 5, dtype=torch.long)
    return inp


def eager_copy(model):
    cfg = copy.deepcopy(model.config)
    for c in (cfg, cfg.vision_config, cfg.qformer_config, cfg.text_config):
        c._attn_implementation = "eager"
    ref = type(model)(cfg).eval()
    ref.load_state_dict(model.state_dict())
    return ref


def own(model, inp):
    """The model's own eager attentions: vision tower, Q-Former self- and cross-attention (its own call on the
    tower's output, as get_image_features makes it), language model."""
    ref = eager_copy(model)
    with torch.no_grad():
        vis = ref.vision_model(inp["pixel_values"], output_attentions=True)
        embeds = vis.last_hidden_state
        queries = ref.query_tokens.expand(embeds.shape[0], -1, -1)
        kw = {}
        if "qformer_input_ids" in inp:
            kw = {"input_ids": inp["qformer_input_ids"],
                  "attention_mask": torch.cat([torch.ones(1, Q, dtype=torch.long), inp["qformer_attention_mask"]], 1)}
        qf = ref.qformer(query_embeds=queries, encoder_hidden_states=embeds, output_attentions=True, **kw)
        out = ref(**inp, output_attentions=True)
        lang = out.language_model_outputs.attentions
    # transformers' own "attentions" recorder (layer name ".attention") also matches ".crossattention.attention":
    # the self-attention layers are its square entries
    selfs = [a for a in qf.attentions if a.shape[-1] == a.shape[-2]]
    assert len(selfs) == len(ref.qformer.encoder.layer)
    return vis.attentions, selfs, qf.cross_attentions, lang


def naive_queries(selfs, crosses, has_cross, n_v):
    """Each query's shares over [queries | vision tokens | instruction], written out layer by layer."""
    n = selfs[0].shape[-1]
    L = n - Q
    R = np.zeros((n, Q + n_v + L))
    R[:Q, :Q] = np.eye(Q)
    R[Q:, Q + n_v:] = np.eye(L)
    c = 0
    for i, a in enumerate(selfs):
        R = (0.5 * a[0].double().numpy().mean(axis=0) + 0.5 * np.eye(n)) @ R
        if has_cross[i]:
            C = crosses[c][0].double().numpy().mean(axis=0)
            c += 1
            new = 0.5 * R[:Q]
            new[:, Q:Q + n_v] += 0.5 * C
            R[:Q] = new
    return R[:Q]


@pytest.mark.parametrize("kind", KINDS)
def test_streams_equal_the_models_own_eager_attention(kind):
    model = build(kind)
    inp = prompt(kind)
    rec = attnroll.capture(model, inp)
    vis, selfs, crosses, lang = own(model, inp)
    for got, want in ((rec.streams["vision"], vis), (rec.streams["qformer"], selfs),
                      (rec.extra["qformer_cross"], crosses), (rec.streams["language"], lang)):
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_the_map_equals_a_naive_composition_and_shares_add_up(kind):
    model = build(kind)
    inp = prompt(kind)
    vis, selfs, crosses, lang = own(model, inp)
    has_cross = [i % 2 == 0 for i in range(len(selfs))]
    n_v = vis[0].shape[-1]
    RQ = naive_queries(selfs, crosses, has_cross, n_v)
    R_v = naive_rollout([a[0].double().numpy() for a in vis])
    row = naive_rollout([a[0].double().numpy() for a in lang])[-1]
    positions = list(range(2, 2 + Q))
    want = sum(row[p] * RQ[k, Q:Q + n_v] @ R_v for k, p in enumerate(positions))
    e = attnroll.explain(model, inp, "rollout")
    assert e.grid == (4, 4) and e.scores.shape == (1, 16)
    assert np.allclose(e.full_row[0].numpy(), want, atol=1e-5)
    queries = sum(row[p] * RQ[k, :Q] for k, p in enumerate(positions))
    assert np.allclose(e.extra["queries_scores"][0].numpy(), queries, atol=1e-6)
    total = e.extra["image_share"] + e.extra["text_share"] + e.extra["queries_share"]
    if kind == "instructblip":
        instruction = sum(row[p] * RQ[k, Q + n_v:] for k, p in enumerate(positions))
        assert np.allclose(e.extra["instruction_scores"][0].numpy(), instruction, atol=1e-6)
        assert float(e.extra["instruction_share"][0]) > 0
        total = total + e.extra["instruction_share"]
    text = row.copy()
    text[positions] = 0
    assert np.allclose(e.extra["text_scores"][0].numpy(), text, atol=1e-6)
    assert float(total[0]) == pytest.approx(1.0, abs=1e-5)
    assert float(e.extra["queries_share"][0]) > 0 and float(e.extra["image_share"][0]) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_dominant_query_maps_back_to_the_patches_it_attends(kind):
    """One Q-Former layer (self-attention, then cross-attention): a one-hot language row on query k's image token,
    the vision layers skipped, puts on the vision tokens exactly half (the residual) of query k's own
    cross-attention row, and its largest share on the patch query k attends most."""
    from attnroll.explain.linked import compose_link

    model = build(kind, qformer_layers=1, frequency=1)
    inp = prompt(kind)
    rec = attnroll.capture(model, inp)
    link = rec.info["language"].link
    _, _, crosses, _ = own(model, inp)
    C = crosses[0][0].mean(dim=0)
    for k in range(Q):
        row = torch.zeros(1, inp["input_ids"].shape[1])
        row[0, 2 + k] = 1.0
        image, text, extra = compose_link(row, link, rec.stream_shape("vision"), lambda s, r, kk: r.weights,
                                          "language")
        assert torch.allclose(image[0], 0.5 * C[k], atol=1e-6)
        assert int(image[0].argmax()) == int(C[k].argmax())
        assert float(text.abs().sum()) == 0
        assert float(image.sum() + extra["queries_share"].sum() + extra.get("instruction_share",
                                                                             torch.zeros(1)).sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_the_map_changes_with_the_image_and_the_vision_weights(kind):
    model = build(kind)
    inp = prompt(kind)
    e = attnroll.explain(model, inp, "rollout")
    other = prompt(kind, pixels=torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(9)))
    assert not torch.allclose(attnroll.explain(model, other, "rollout").scores, e.scores, atol=1e-4)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.vision_model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    assert not torch.allclose(attnroll.explain(changed, inp, "rollout").scores, e.scores, atol=1e-4)


def test_gradient_methods_compose_through_the_qformer_and_shares_add_to_the_rows_total():
    model = build("instructblip")
    e = attnroll.explain(model, prompt("instructblip"), "grad_rollout", target=5)
    x = e.extra
    total = float(x["language_row"][0].sum())
    got = x["image_share"] + x["text_share"] + x["queries_share"] + x["instruction_share"]
    assert float(got[0]) == pytest.approx(total, rel=1e-5) and float(x["image_share"][0]) > 0


def test_a_batch_equals_its_single_prompts_and_the_explanation_saves(tmp_path):
    """Two prompts, each with its image and a padded instruction: each prompt's map and shares are its own."""
    model = build("instructblip")
    one, two = prompt("instructblip", seed=1), prompt("instructblip", seed=2)
    two["qformer_attention_mask"] = torch.tensor([[1, 1, 1, 0, 0]])
    both = {k: torch.cat([one[k], two[k]]) for k in one}
    e = attnroll.explain(model, both, "rollout")
    for b, alone in enumerate((one, two)):
        a = attnroll.explain(model, alone, "rollout")
        for key in ("queries_share", "instruction_share", "image_share", "text_share"):
            assert float(a.extra[key][0]) == pytest.approx(float(e.extra[key][b]), abs=1e-5)
        assert torch.allclose(a.scores[0], e.scores[b], atol=1e-5)
    assert float(e.extra["instruction_scores"][1, 3:].abs().sum()) == 0  # padding gets nothing
    back = attnroll.Explanation.load(e.save(tmp_path / "qformer.npz"))
    assert torch.equal(back.extra["queries_scores"], e.extra["queries_scores"]) and back.grid == e.grid
