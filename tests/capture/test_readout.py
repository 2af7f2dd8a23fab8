"""Readouts: the rows the model's prediction reads, declared by the adapter, overridden by readout=.

References are computed here from the models' own pieces (manual softmax of timm's qkv, transformers'
eager attentions, the pooling head's input/output), never from attnroll's capture."""

from __future__ import annotations

import pytest
import torch

import attnroll

timm = pytest.importorskip("timm")
T = pytest.importorskip("transformers")

from .helpers import snapshot  # noqa: E402
from .test_timm import SMALL, manual  # noqa: E402


def build(name, **kw):
    torch.manual_seed(0)
    return timm.create_model(name, **{**SMALL, **kw}).eval()


def full_rollout(atts):
    """Π (½A + ½I), head mean, float64 — the reference product."""
    n = atts[0].shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    R = eye.expand(atts[0].shape[0], n, n)
    for A in atts:
        R = (0.5 * A.double().mean(1) + 0.5 * eye) @ R
    return R


def test_timm_avg_pool_reads_the_mean_of_the_patch_rows():
    model = build("vit_tiny_patch16_224", global_pool="avg", class_token=True)
    x = torch.randn(2, 3, 32, 32)
    before = snapshot(model)
    e = attnroll.explain(model, x, "rollout")
    assert snapshot(model) == before
    atts, _ = manual(model, x)
    expect = full_rollout(atts)[:, 1:].mean(dim=1)  # rows of the 16 patches, not the class token
    assert e.readout["kind"] == "mean" and "avg" in e.readout["source"]
    torch.testing.assert_close(e.full_row, expect.float(), atol=1e-5, rtol=1e-4)
    cls = attnroll.explain(model, x, "rollout", readout="cls")
    torch.testing.assert_close(cls.full_row, full_rollout(atts)[:, 0].float(), atol=1e-5, rtol=1e-4)


def test_timm_attention_pool_head_weights_reproduce_its_output():
    """One head: the pooled vector before the projection is Σ_j w_j v_j, with v from the head's kv on its
    own input; the readout weights must reproduce it."""
    model = build("vit_so150m_patch16_reg4_map_256", num_heads=1, mlp_ratio=2)
    x = torch.randn(2, 3, 32, 32)
    seen = {}
    h1 = model.attn_pool.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    h2 = model.attn_pool.proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("pooled", a[0]))
    e = attnroll.explain(model, x, "raw")
    h1.remove(), h2.remove()
    inp = seen["x"]
    v = model.attn_pool.kv(inp).chunk(2, dim=-1)[1]  # (B, N, C), one head
    w = e.readout_weights[:, model.num_prefix_tokens:]  # the head saw the tokens after the prefix
    assert e.readout["kind"] == "attention_pool"
    assert float(e.readout_weights[:, : model.num_prefix_tokens].abs().sum()) == 0
    torch.testing.assert_close(torch.einsum("bn,bnc->bc", w, v.detach()), seen["pooled"][:, 0].detach(),
                               atol=1e-5, rtol=1e-4)


def test_timm_parallel_blocks_compose_their_branches_inside_one_layer():
    model = build("vit_small_patch16_18x2_224")
    x = torch.randn(2, 3, 32, 32)
    rec = attnroll.capture(model, x)
    assert len(rec.attentions) == 2 and rec.attentions[0].shape[1] == 8  # 2 branches x 4 heads per layer
    seen = []
    hooks = [a.attn.register_forward_pre_hook(lambda m, a: seen.append((m, a[0])))
             for b in model.blocks for a in b.attns]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    probs = []
    for attn, inp in seen:
        B, N, _ = inp.shape
        q, k, _ = attn.qkv(inp).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        probs.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(-1))
    for layer in range(2):
        expect = torch.cat(probs[2 * layer : 2 * layer + 2], dim=1)
        torch.testing.assert_close(rec.attentions[layer], expect, atol=1e-5, rtol=1e-4)
    g = attnroll.explain(model, x, "gae")  # gradients reach both branches
    assert g.scores.shape == (2, 16) and float(g.scores.abs().sum()) > 0


def test_timm_differential_attention_is_refused_with_the_reason():
    model = build("vit_dwee_patch16_reg1_gap_256")
    with pytest.raises(attnroll.UnsupportedModelError, match="differential attention"):
        attnroll.capture(model, torch.randn(1, 3, 32, 32))


def test_timm_max_pool_has_no_default_readout_but_takes_readout_option():
    model = build("vit_tiny_patch16_224", global_pool="max")
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match="readout"):
        attnroll.explain(model, x)
    assert attnroll.explain(model, x, readout="mean").readout["kind"] == "mean"


def test_readout_option_forms_and_save_load(tmp_path):
    torch.manual_seed(0)
    cfg = T.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37,
                       vocab_size=99, max_position_embeddings=64)
    model = T.BertModel(cfg).eval()
    ids = torch.randint(3, 99, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    enc = {"input_ids": ids, "attention_mask": mask}
    ref = T.BertModel(cfg).eval()
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("eager")
    with torch.no_grad():
        atts = ref(**enc, output_attentions=True).attentions
    R = attnroll.rollout(atts, attention_mask=mask).double()  # (B, n, n), padded rows 0
    cases = {
        "cls": R[:, 0],
        "last": torch.stack([R[0, 5], R[1, 3]]),
        2: R[:, 2],
        "mean": torch.stack([R[0].mean(0), R[1, :4].mean(0)]),
    }
    w = torch.tensor([0.0, 1.0, 3.0, 0.0, 0.0, 0.0])
    cases["weights"] = torch.einsum("i,bij->bj", w.double() / 4, R)
    for spec, expect in cases.items():
        e = attnroll.explain(model, enc, "rollout", readout=w if spec == "weights" else spec)
        torch.testing.assert_close(e.full_row.double(), expect * mask, atol=1e-5, rtol=1e-4, msg=str(spec))
    assert e.readout["kind"] == "weights"
    loaded = attnroll.Explanation.load(e.save(tmp_path / "e.npz"))
    assert loaded.readout == e.readout and torch.equal(loaded.readout_weights, e.readout_weights)
    with pytest.raises(ValueError, match="readout"):
        attnroll.explain(model, enc, readout="median")
    with pytest.raises(ValueError, match="readout weights"):
        attnroll.explain(model, enc, readout=torch.ones(3))


def test_beit_mean_pooling_and_clip_text_eot():
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37)
    beit = T.BeitForImageClassification(T.BeitConfig(**common, image_size=32, patch_size=8, num_labels=3,
                                                     use_mean_pooling=True)).eval()
    e = attnroll.explain(beit, {"pixel_values": torch.randn(1, 3, 32, 32)})
    assert e.readout["kind"] == "mean" and "use_mean_pooling" in e.readout["source"]
    assert float(e.readout_weights[0, 0]) == 0 and torch.allclose(e.readout_weights[0, 1:], torch.full((16,), 1 / 16))
    clip = T.CLIPModel(T.CLIPConfig(text_config=dict(**common, vocab_size=99, max_position_embeddings=64,
                                                     bos_token_id=0, eos_token_id=2),
                                    vision_config=dict(**common, image_size=32, patch_size=8), projection_dim=16))
    ids = torch.tensor([[0, 5, 7, 98, 2, 1], [0, 9, 98, 3, 4, 2]])
    rec = attnroll.capture(clip.eval(), {"input_ids": ids, "pixel_values": torch.randn(2, 3, 32, 32)})
    # eos id 2 is the original configs' case: the pooled token is the argmax id (transformers' rule).
    assert rec.info["text"].readout.positions() == [3, 2] and rec.info["text"].readout.kind == "eot"
    assert rec.info["vision"].readout.kind == "cls" and rec.info["vision"].prefix == 1


def test_siglip_attention_pool_head_is_the_vision_readout():
    """SigLIP's MAP head: the readout is its probe's attention over the patches, recomputed here by hand from
    the head's in_proj weights (softmax(q kᵀ/√d), mean over heads)."""
    torch.manual_seed(0)
    cfg = T.SiglipVisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37,
                               image_size=32, patch_size=8)
    model = T.SiglipVisionModel(cfg).eval()
    x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    seen = {}
    head = model.head
    before = snapshot(model)
    h = head.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    e = attnroll.explain(model, x, "rollout")
    h.remove()
    assert snapshot(model) == before
    mha = head.attention
    wq, wk, _ = mha.in_proj_weight.chunk(3)
    bq, bk, _ = mha.in_proj_bias.chunk(3)
    q = (head.probe @ wq.T + bq).reshape(1, 1, 4, 8).transpose(1, 2)  # (1, H, 1, d)
    k = (seen["x"] @ wk.T + bk).reshape(2, -1, 4, 8).transpose(1, 2)  # (B, H, n, d)
    expect = ((q @ k.transpose(-2, -1)) / 8**0.5).softmax(-1).mean(dim=1)[:, 0]
    assert e.readout["kind"] == "attention_pool" and e.prefix == 0
    torch.testing.assert_close(e.readout_weights, expect.detach(), atol=1e-5, rtol=1e-4)
