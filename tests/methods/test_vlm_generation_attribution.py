"""Generation attribution for vision-language models: every generated token's row against an independent
computation (``explain`` on that token's prefix alone: prompt + the answer before it, with the images), on tiny
random-weight configs of the composed families; shares adding up; a dominant image token mapped back to its
patch; refusals."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.explain.vlm_generation_attribution import answer_inputs

transformers = pytest.importorskip("transformers")

from ..capture import test_qwen_vl as Q  # noqa: E402
from ..capture import test_vlm as V  # noqa: E402
from ..capture import test_vlm_families as F  # noqa: E402

# Tiny multi-part models (VLMs, hybrids, token mixers, mixtures of experts): left out of `make test-fast`.
pytestmark = pytest.mark.slow


def mistral3_two_images():
    """Two images of different sizes in one prompt: 32×48 pixels (4×6 merged tokens) and 16×16 (2×2)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (1, 40), generator=g)
    ids[0, 2:26] = F.IMG
    ids[0, 28:32] = F.IMG
    px = torch.zeros(2, 3, 32, 48)
    px[0] = torch.randn(3, 32, 48, generator=g)
    px[1, :, :16, :16] = torch.randn(3, 16, 16, generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": px,
            "image_sizes": torch.tensor([[32, 48], [16, 16]])}


#: family -> (model builder, its prompt with images)
CASES = {
    "llava": (V.llava, lambda m: V.prompt("llava")),
    "paligemma": (V.paligemma, lambda m: V.prompt("paligemma")),
    "gemma3": (lambda: F.build("gemma3"), lambda m: F.prompt("gemma3")),
    "idefics3": (lambda: F.build("idefics3"), lambda m: F.prompt("idefics3")),
    "mistral3": (lambda: F.build("mistral3"), lambda m: mistral3_two_images()),
    "llava_next": (lambda: F.build_anyres("llava_next"), lambda m: F.anyres_inputs("llava_next", m)),
    "llava_onevision": (lambda: F.build_anyres("llava_onevision"), lambda m: F.anyres_inputs("llava_onevision", m)),
    **{f: (lambda f=f: F.build(f), lambda m, f=f: F.prompt(f))
       for f in ("vipllava", "smolvlm", "internvl", "aya_vision")},
    "qwen2_vl": (Q.qwen2, lambda m: Q.prompt(m)),
    "qwen2_5_vl": (Q.qwen25, lambda m: Q.prompt(m, grids=((1, 8, 8), (1, 4, 8)))),
    "qwen3_vl": (Q.qwen3, lambda m: Q.prompt(m)),
}


def reference(model, inp, ans, t, method, **options):
    """explain on the prompt + the answer's first t tokens alone: its last row (rollout) or the log-probability
    of answer token t there (gradient methods)."""
    pre = answer_inputs(model, inp, ans[:t])

    def logp(out, tid=ans[t]):
        return out.logits[:, -1].float().log_softmax(dim=-1)[:, tid]

    e = attnroll.explain(model, pre, method, None if method == "rollout" else logp, **options)
    maps = e.extra["image_maps"][0] if "image_maps" in e.extra else [e.scores[0].reshape(e.grid)]
    return e, maps, pre["input_ids"].shape[1]


def check_rows(ga, model, inp, method, **options):
    n_in, T = ga.n_input, len(ga.answer_ids)
    assert ga.matrix.shape == (T, n_in + T - 1)
    for t in range(T):
        e, maps, n = reference(model, inp, ga.answer_ids, t, method, **options)
        row = e.extra["language_row"][0]
        tol = 1e-5 * max(1.0, float(row.abs().max()))
        torch.testing.assert_close(ga.matrix[t, :n], row, atol=tol, rtol=0)
        assert float(ga.matrix[t, n:].abs().sum()) == 0.0  # nothing from the future
        assert len(ga.image_maps[t]) == len(maps)
        for got, want in zip(ga.image_maps[t], maps):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want.float(), atol=1e-5 * max(1.0, float(want.abs().max())), rtol=0)
        assert float(ga.image_share[t]) == pytest.approx(float(e.extra["image_share"][0]), abs=1e-5)
        assert float(ga.text_share[t]) == pytest.approx(float(e.extra["text_share"][0]), abs=1e-5)
        # the shares add up: each image's map to its image tokens' share, images + text to the row's total
        placed = sum(float(m.sum()) for m in ga.image_maps[t]) + float(ga.unplaced_share[t])
        assert placed == pytest.approx(float(ga.image_share[t]), abs=1e-5)
        assert float(ga.unplaced_share[t]) == pytest.approx(float(e.full_row[0, : e.prefix].sum()), abs=1e-6)
        total = float(ga.matrix[t].sum())
        assert float(ga.image_share[t] + ga.text_share[t]) == pytest.approx(total, abs=1e-5)
        if method == "rollout" and not options:  # mean over heads: stochastic rows (max fusion's are not)
            assert total == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rollout_row_is_explain_on_that_prefix_alone(name):
    build, make = CASES[name]
    model = build()
    inp = make(model)
    ga = attnroll.vlm_generation_attribution(model, inp, generate=3)
    assert ga.method == "rollout" and len(ga.answer_ids) == 3 and ga.n_input == inp["input_ids"].shape[1]
    ids = inp["input_ids"][0]
    assert set(ga.image_positions) >= set(torch.nonzero(ids == (Q.IMG if name.startswith("qwen") else F.IMG))
                                          .reshape(-1).tolist())
    check_rows(ga, model, inp, "rollout")


@pytest.mark.parametrize("name,method", [("llava", "gae"), ("qwen2_5_vl", "grad_rollout"), ("gemma3", "gae"),
                                         ("mistral3", "grad_rollout")])
def test_each_gradient_row_is_explain_on_that_prefix_with_its_token_s_log_probability(name, method):
    build, make = CASES[name]
    model = build()
    inp = make(model)
    ga = attnroll.vlm_generation_attribution(model, inp, generate=3, method=method, batch_size=2)
    check_rows(ga, model, inp, method)


def test_a_given_answer_and_rollout_options():
    model = V.llava()
    inp = V.prompt("llava")
    ga = attnroll.vlm_generation_attribution(model, inp, answer=[5, 7, 9, 11], alpha=0.7, head_fusion="max")
    assert ga.answer_ids == [5, 7, 9, 11] and ga.options == {"alpha": 0.7, "head_fusion": "max"}
    check_rows(ga, model, inp, "rollout", alpha=0.7, head_fusion="max")


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl"])
def test_a_dominant_image_token_in_an_answer_row_maps_back_to_its_patch(name):
    """With alpha=1 every layer is the identity: the row that predicts the first answer token is the prompt's
    last token, here an image token; its whole share lies on its own patch (LLaVA: one patch, the CLS dropped;
    Qwen2.5-VL: the 2×2 patches its merger folded, ¼ each, on the image's own grid)."""
    model = CASES[name][0]()
    if name == "llava":
        inp = V.prompt("llava")
        ids = inp["input_ids"]
        ids[0, 2:18] = 3
        ids[0, -16:] = V.IMG  # the image last: its last token (patch 15, the bottom-right) predicts the answer
        want = torch.zeros(4, 4)
        want[3, 3] = 1.0
    else:
        inp = Q.prompt(model, grids=((1, 8, 8),), n_text=6)
        ids = inp["input_ids"]
        pos = torch.nonzero(ids[0] == Q.IMG).reshape(-1)
        ids = ids[:, : int(pos[-1]) + 1]  # end on the last merged token (row 3, col 3 of the 4×4 merged grid)
        inp = {**inp, "input_ids": ids, "attention_mask": torch.ones_like(ids),
               "mm_token_type_ids": (ids == Q.IMG).long()}
        want = torch.zeros(8, 8)
        want[6:8, 6:8] = 0.25
    ga = attnroll.vlm_generation_attribution(model, inp, answer=[5, 6], alpha=1.0)
    assert float(ga.image_share[0]) == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(ga.image_maps[0][0], want, atol=1e-6, rtol=0)
    assert float(ga.image_share[1]) == pytest.approx(0.0, abs=1e-6)  # row 1 is the first answer token's own


def test_mistral3_two_images_keep_apart():
    """The Pixtral tower attends within each image only (one vision sequence, a block mask): a language row
    whose share is all on one token of the second image, composed through the captured vision rollout, leaves
    the first image's map at zero and puts the whole share on the second image, on the 2×2 patches it merged
    from and the patches they attend to."""
    from attnroll.explain.linked import compose_link

    model = F.build("mistral3")
    inp = mistral3_two_images()
    rec = attnroll.capture(model, inp)
    link = rec.info["language"].link
    vision = rec.streams["vision"]
    assert vision[0].shape[-1] == 8 * 12 + 4 * 4 and link.placement.views == [(8, 12), (4, 4)]

    def source(stream, readout, k):
        return readout.weights @ attnroll.rollout(vision[:k])[0]

    row = torch.zeros(1, inp["input_ids"].shape[1])
    row[0, 29] = 1.0  # the second image's merged token (0, 1): patches (0..1, 2..3) of its 4×4 grid
    _, _, extra = compose_link(row, link, rec.stream_shape("vision"), source, "language")
    first, second = extra["image_maps"][0]
    assert first.shape == (8, 12) and second.shape == (4, 4)
    assert float(first.abs().sum()) == 0.0 and float(second.sum()) == pytest.approx(1.0, abs=1e-5)
    e = attnroll.explain(model, inp, "rollout")  # explain itself: one map per image, each its tokens' share
    maps, lang = e.extra["image_maps"][0], e.extra["language_row"][0]
    assert [tuple(m.shape) for m in maps] == [(8, 12), (4, 4)] and e.grid is None
    assert float(maps[0].sum()) == pytest.approx(float(lang[2:26].sum()), abs=1e-5)
    assert float(maps[1].sum()) == pytest.approx(float(lang[28:32].sum()), abs=1e-5)
    assert e.extra["image_grids"] == [[[8, 12], [4, 4]]] and e.scores.shape == (1, 96 + 16)
    _, _, ident = compose_link(row, link, rec.stream_shape("vision"), lambda s, r, k: r.weights, "language")
    want = torch.zeros(4, 4)
    want[0:2, 2:4] = 0.25
    torch.testing.assert_close(ident["image_maps"][0][1], want, atol=1e-6, rtol=0)


def test_mistral3_with_several_prompts_in_one_call_is_refused_naming_why():
    model = F.build("mistral3")
    one = F.prompt("mistral3")
    two = {"input_ids": one["input_ids"].repeat(2, 1), "attention_mask": one["attention_mask"].repeat(2, 1),
           "pixel_values": one["pixel_values"].repeat(2, 1, 1, 1), "image_sizes": one["image_sizes"].repeat(2, 1)}
    with pytest.raises(ValueError, match="one vision sequence.*explain one prompt at a time"):
        attnroll.explain(model, two, "rollout")


def test_the_result_as_a_dict_a_table_and_json(tmp_path):
    model = V.llava()
    ga = attnroll.vlm_generation_attribution(model, V.prompt("llava"), generate=2)
    d = ga.to_dict()
    assert d["method"] == "rollout" and len(d["image_maps"]) == 2 and len(d["image_maps"][0][0]) == 4
    assert d["image_positions"] == list(range(2, 18)) and len(d["matrix"]) == 2
    assert len(ga.table().splitlines()) == 2 and "images" in ga.table()
    text = ga.text_matrix()
    assert float(text[:, 2:18].abs().sum()) == 0 and torch.allclose(text.sum(dim=1), ga.text_share, atol=1e-5)
    import json

    back = json.loads(ga.to_json(tmp_path / "g.json"))
    assert back == json.loads((tmp_path / "g.json").read_text()) and back["answer_ids"] == ga.answer_ids


def test_bad_input_is_refused_naming_it():
    model = V.llava()
    inp = V.prompt("llava")
    with pytest.raises(ValueError, match="exactly one of generate"):
        attnroll.vlm_generation_attribution(model, inp)
    with pytest.raises(ValueError, match="method must be one of"):
        attnroll.vlm_generation_attribution(model, inp, generate=1, method="alti")
    with pytest.raises(ValueError, match="one prompt"):
        attnroll.vlm_generation_attribution(model, V.prompt("llava", starts=(2, 4)), generate=1)
    with pytest.raises(ValueError, match="sets position= itself"):
        attnroll.vlm_generation_attribution(model, inp, generate=1, position=3)
    with pytest.raises(ValueError, match="has padding"):
        attnroll.vlm_generation_attribution(model, {**inp, "attention_mask": torch.zeros_like(inp["input_ids"])},
                                            generate=1)
    with pytest.raises(TypeError, match="processor's output"):
        attnroll.vlm_generation_attribution(model, torch.zeros(1, 3, 32, 32), generate=1)
    with pytest.raises(ValueError, match="needs tokenizer="):
        attnroll.vlm_generation_attribution(model, inp, answer="a cat")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        attnroll.vlm_generation_attribution(model, inp, generate=1, batch_size=0)
