"""Encoder-decoder (T5, BART, Marian) and CLIP methods: shapes, sum rules, Chefer's rules against an independent
computation on transformers' own attentions, text dependence, batches."""

from __future__ import annotations

import pytest
import torch

from attnroll.methods import explain

from ..zoo import sharp as M


def _bar(R):
    n = R.shape[-1]
    S = R - torch.eye(n)
    s = S.sum(-1, keepdim=True)
    return torch.nan_to_num(S / s) + torch.eye(n)


@pytest.mark.parametrize("name", M.SEQ2SEQ_MODELS)
def test_encdec_rollout_shapes_and_sum_rule(name):
    m, x = M.model(name), M.inputs_for(name)
    e = explain(m, x, "encdec_rollout")
    assert e.scores.shape == (3, 7) and e.extra["target_scores"].shape == (3, 5) and e.positions == [4, 4, 4]
    total = e.scores.sum(-1) + e.extra["target_scores"].sum(-1)
    torch.testing.assert_close(total, torch.ones(3))  # source share + target share = 1
    assert float(e.scores[-1, 5:].abs().sum()) == 0  # padded source tokens get nothing
    assert float(e.scores.min()) >= 0 and float(e.scores[:, :5].min()) > 0
    early = explain(m, x, "encdec_rollout", position=1)
    assert float(early.extra["target_scores"][:, 2:].abs().sum()) == 0  # causal: no later target tokens


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_encdec_gae_equals_chefer_rules_on_transformers_attentions(name):
    m, x = M.model(name), M.inputs_for(name, pad=False)
    target = [3, 50, 97]
    e = explain(m, x, "encdec_gae", target=target)
    ref = M.eager(m)
    out = ref(**x, output_attentions=True)
    y = out.logits[torch.arange(3), -1, torch.tensor(target)]
    streams = [out.encoder_attentions, out.decoder_attentions, out.cross_attentions]
    flat = [a for s in streams for a in s]
    grads = torch.autograd.grad(y.sum(), flat)
    W = [(g * a).clamp(min=0).mean(1).detach() for a, g in zip(flat, grads)]
    Le, Ld = len(streams[0]), len(streams[1])
    We, Wd, Wc = W[:Le], W[Le : Le + Ld], W[Le + Ld :]
    ne, nd = 7, 5
    R_ee = torch.eye(ne).repeat(3, 1, 1)
    for A in We:
        R_ee = R_ee + A @ R_ee
    R_dd, R_de = torch.eye(nd).repeat(3, 1, 1), torch.zeros(3, nd, ne)
    for Ad, Ac in zip(Wd, Wc):
        R_dd = R_dd + Ad @ R_dd
        R_de = R_de + Ad @ R_de
        R_de = R_de + _bar(R_dd).transpose(1, 2) @ Ac @ _bar(R_ee)
    torch.testing.assert_close(e.scores, R_de[:, -1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(e.extra["target_scores"], R_dd[:, -1], atol=1e-5, rtol=1e-4)
    other = explain(m, x, "encdec_gae", target=[4, 51, 98])
    assert (other.scores - e.scores).abs().max() > 1e-5
    assert e.target == target


@pytest.mark.parametrize("method", ["encdec_rollout", "encdec_gae"])
def test_encdec_batch_equals_per_example(method):
    m, x = M.model("bart"), M.inputs_for("bart")
    batch = explain(m, x, method, target=[1, 2, 3])
    for b in range(3):
        one = explain(m, M.example(x, b) | {"decoder_input_ids": x["decoder_input_ids"][b : b + 1]}, method, target=b + 1)
        n = one.scores.shape[-1]
        torch.testing.assert_close(batch.scores[b, :n], one.scores[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(batch.extra["target_scores"][b], one.extra["target_scores"][0], atol=1e-5, rtol=1e-4)


def test_encdec_errors():
    m, x = M.model("bart"), M.inputs_for("bart")
    with pytest.raises(ValueError, match=r"several attention streams.*encdec_rollout"):
        explain(m, x, "rollout")
    e = explain(m, x, "rollout", stream="encoder")  # one stream on its own is fine
    assert e.scores.shape == (3, 7)
    with pytest.raises(ValueError, match="needs an encoder-decoder"):
        explain(M.model("bert"), M.inputs_for("bert"), "encdec_rollout")


def clip_inputs(texts=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (texts, 7), generator=g)
    mask = torch.ones(texts, 7, dtype=torch.long)
    mask[-1, 5:] = 0
    return {"pixel_values": torch.randn(1, 3, 32, 32, generator=g), "input_ids": ids, "attention_mask": mask}


def test_clip_one_image_against_texts_maps_change_with_the_text():
    m, x = M.model("clip"), clip_inputs()
    e = explain(m, x, "clip")
    assert e.scores.shape == (3, 16) and e.grid == (4, 4) and e.extra["text_scores"].shape == (3, 7)
    assert (e.scores[0] - e.scores[1]).abs().max() > 1e-4  # same image, other text -> other image map
    assert float(e.extra["text_scores"][-1, 5:].abs().sum()) == 0
    eot = e.extra["text_positions"]
    assert eot == x["input_ids"].argmax(-1).tolist()
    # pairs in one call == each pair alone
    for b in range(3):
        keep = int(x["attention_mask"][b].sum())
        one = explain(m, {"pixel_values": x["pixel_values"], "input_ids": x["input_ids"][b : b + 1, :keep],
                          "attention_mask": x["attention_mask"][b : b + 1, :keep]}, "clip")
        torch.testing.assert_close(e.scores[b], one.scores[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(e.extra["text_scores"][b, :keep], one.extra["text_scores"][0], atol=1e-5, rtol=1e-4)


def test_clip_image_map_is_chefer_rule_on_the_vision_tower():
    m, x = M.model("clip"), clip_inputs(texts=2)
    e = explain(m, x, "clip", start_layer=-1)
    ref = M.eager(m)
    x2 = {**x, "pixel_values": x["pixel_values"].expand(2, -1, -1, -1)}
    out = ref(**x2, output_attentions=True)
    atts = out.vision_model_output.attentions
    grads = torch.autograd.grad(out.logits_per_image.diagonal().sum(), atts)
    A = (grads[-1] * atts[-1]).clamp(min=0).mean(1).detach()
    expect = (torch.eye(17) + A)[:, 0, 1:]
    torch.testing.assert_close(e.scores, expect, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="class indices make no sense"):
        explain(m, x, "clip", target=1)
    with pytest.raises(ValueError, match="got 2 images and 3 texts"):
        explain(m, {**clip_inputs(), "pixel_values": torch.randn(2, 3, 32, 32)}, "clip")
