"""explain() on tiny ViT / DeiT / BERT / GPT-2 / Llama models: each method against an independent computation,
targets, batches, Explanation I/O and the error messages."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.methods import Explainer, Explanation, explain, methods

from ..zoo import sharp as M

SELF_METHODS = ["raw", "rollout", "per_head_rollout", "flow", "grad_rollout", "gae", "attn_gradcam", "random"]


def hf_attentions_and_grads(name, m, inputs, target):
    """transformers' own eager attentions (output_attentions=True) and d logit[target] / dA by autograd."""
    ref = M.eager(m)
    out = ref(**inputs, output_attentions=True)
    logits = out.logits if out.logits.ndim == 2 else out.logits[:, -1]
    y = logits[torch.arange(logits.shape[0]), torch.as_tensor(target)]
    grads = torch.autograd.grad(y.sum(), out.attentions)
    return [a.detach() for a in out.attentions], [g.detach() for g in grads]


def gae_reference(atts, grads, row):
    """Chefer ICCV'21, written out: R = I; R <- R + mean_h((grad*A)^+) R; row ``row`` of R."""
    B, _, n, _ = atts[0].shape
    R = torch.eye(n).expand(B, n, n)
    for a, g in zip(atts, grads):
        R = R + (g * a).clamp(min=0).mean(1) @ R
    return R[:, row]


def grad_rollout_reference(atts, grads, row, after_mean=False):
    B, _, n, _ = atts[0].shape
    R = torch.eye(n).expand(B, n, n)
    for a, g in zip(atts, grads):
        w = (g * a).mean(1).clamp(min=0) if after_mean else (g * a).clamp(min=0).mean(1)
        aug = w + torch.eye(n)
        R = (aug / aug.sum(-1, keepdim=True)) @ R
    return R[:, row]


# ----------------------------------------------------------------------------------- against references
@pytest.mark.parametrize("name", ["vit", "deit_distilled", "bert"])
def test_rollout_method_equals_core_rollout_on_captured_attention(name):
    m, x = M.model(name), M.inputs_for(name)
    rec = attnroll.capture(m, x)
    opts = dict(head_fusion="max", discard_ratio=0.3, residual_mode="renorm", start_layer=0)
    e = explain(m, x, "rollout", **opts)
    mask = rec.attention_mask
    rows = [0, 1] if name == "deit_distilled" else [0]  # DeiT with teacher averages its CLS and distillation heads
    expect = attnroll.rollout(rec.attentions, rows=rows, attention_mask=mask, protect_prefix=max(1, rec.prefix),
                              **opts).mean(dim=1)
    if mask is not None:
        expect = expect * mask
    torch.testing.assert_close(e.full_row, expect, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(e.scores, expect[:, rec.prefix:], atol=1e-6, rtol=1e-5)
    assert e.prefix == rec.prefix and e.grid == rec.grid and e.method == "rollout"
    assert e.options["head_fusion"] == "max" and e.options["discard_ratio"] == 0.3


@pytest.mark.parametrize("name", ["vit", "bert"])
@pytest.mark.parametrize("method", ["gae", "grad_rollout", "grad_rollout_after_mean"])
def test_gradient_methods_equal_independent_autograd_computation(name, method):
    m, x = M.model(name), M.inputs_for(name, pad=False)
    target = [1, 3, 4]
    atts, grads = hf_attentions_and_grads(name, m, x, target)
    if method == "gae":
        e = explain(m, x, "gae", target=target)
        expect = gae_reference(atts, grads, 0)
    else:
        after = method.endswith("after_mean")
        e = explain(m, x, "grad_rollout", target=target, clamp="after_mean" if after else "per_head")
        expect = grad_rollout_reference(atts, grads, 0, after_mean=after)
    torch.testing.assert_close(e.full_row, expect, atol=1e-6, rtol=1e-4)
    assert e.target == target
    # Not a vacuous comparison: the map is far from the identity row.
    assert float(e.scores.max()) > 1e-3


def test_layer_pairing_matters():
    """Pairing gradients with the wrong layers (vit-explain#6: reversed hook order) gives another map."""
    m, x = M.model("vit"), M.inputs_for("vit")
    atts, grads = hf_attentions_and_grads("vit", m, x, [0, 0, 0])
    e = explain(m, x, "gae", target=0)
    wrong = gae_reference(atts, grads[::-1], 0)
    assert not torch.allclose(e.full_row, wrong, atol=1e-4)


def test_attn_gradcam_matches_chefer_baseline():
    m, x = M.model("vit"), M.inputs_for("vit")
    atts, grads = hf_attentions_and_grads("vit", m, x, [2, 2, 2])
    e = explain(m, x, "attn_gradcam", target=2)
    a, g = atts[-1][:, :, 0, 1:], grads[-1][:, :, 0, 1:]  # CLS row over patches, per head
    expect = (a * g.mean(-1, keepdim=True)).mean(1).clamp(min=0)
    torch.testing.assert_close(e.scores, expect, atol=1e-7, rtol=1e-5)


def test_raw_is_last_layer_fused_row():
    m, x = M.model("bert"), M.inputs_for("bert")
    rec = attnroll.capture(m, x)
    e = explain(m, x, "raw", head_fusion="min", return_layers=True)
    torch.testing.assert_close(e.full_row, rec.attentions[-1].amin(1)[:, 0] * x["attention_mask"])
    torch.testing.assert_close(e.layers[0], rec.attentions[0].amin(1)[:, 0] * x["attention_mask"])
    e0 = explain(m, x, "raw", layer=0)
    torch.testing.assert_close(e0.full_row, rec.attentions[0].mean(1)[:, 0] * x["attention_mask"])


def test_flow_and_per_head_methods_match_core():
    m, x = M.model("vit"), M.inputs_for("vit", batch=2)
    rec = attnroll.capture(m, x)
    f = explain(m, x, "flow")
    torch.testing.assert_close(f.full_row, attnroll.attention_flow(rec.attentions, rows=[0])[:, 0])
    p = explain(m, x, "per_head_rollout", return_layers=True)
    ph = attnroll.per_head_rollout(rec.attentions, rows=[0])[:, :, 0]
    torch.testing.assert_close(p.extra["heads"], ph)
    torch.testing.assert_close(p.full_row, ph.mean(1))
    assert p.layers.shape == (2, 2, 17)
    torch.testing.assert_close(p.layers[-1], p.full_row)


# ----------------------------------------------------------------------------------------------- targets
def test_targets_change_gae_but_not_rollout():
    m, x = M.model("vit"), M.inputs_for("vit")
    g0, g1 = explain(m, x, "gae", target=0), explain(m, x, "gae", target=1)
    assert (g0.scores - g1.scores).abs().max() > 1e-4
    r0, r1 = explain(m, x, "rollout", target=0), explain(m, x, "rollout", target=1)
    torch.testing.assert_close(r0.scores, r1.scores, rtol=0, atol=0)
    assert r0.target == [0, 0, 0] and r1.target == [1, 1, 1]


def test_default_target_is_the_predicted_class_and_callable_targets_work():
    m, x = M.model("vit"), M.inputs_for("vit")
    with torch.no_grad():
        pred = m(**x).logits.argmax(-1).tolist()
    e = explain(m, x, "gae")
    assert e.target == pred
    torch.testing.assert_close(e.scores, explain(m, x, "gae", target=pred).scores)

    def pick(out):
        return out.logits[torch.arange(3), torch.tensor(pred)]

    c = explain(m, x, "gae", target=pick)
    torch.testing.assert_close(c.scores, e.scores)
    assert c.target.startswith("callable:")


# ----------------------------------------------------------------------------------------------- batches
@pytest.mark.parametrize("name", ["vit", "bert", "gpt2"])
@pytest.mark.parametrize("method", [m for m in SELF_METHODS if m != "random"])
def test_batch_equals_per_example(name, method):
    """Each example with its own target; text padded (cropped when run alone)."""
    m, x = M.model(name), M.inputs_for(name)
    target = [0, 2, 4] if name in M.IMAGE or name == "bert" else [5, 17, 42]
    batch = explain(m, x, method, target=target)
    for b in range(3):
        one = explain(m, M.example(x, b), method, target=target[b])
        n = one.full_row.shape[-1]
        torch.testing.assert_close(batch.full_row[b, :n], one.full_row[0], atol=2e-6, rtol=1e-4)
        assert float(batch.full_row[b, n:].abs().sum()) == 0.0
        assert batch.positions[b] == one.positions[0]


def test_decoder_only_lm_explains_the_last_real_token_with_causal_attention():
    for name in ("gpt2", "llama"):
        m, x = M.model(name), M.inputs_for(name)
        e = explain(m, x, "gae")
        assert e.positions == [6, 6, 4]  # the last example is padded after 5 tokens
        with torch.no_grad():
            logits = m(**x).logits
        assert e.target == [int(logits[b, p].argmax()) for b, p in enumerate(e.positions)]
        r = explain(m, x, "rollout", position=2)
        assert float(r.full_row[:, 3:].abs().max()) == 0.0  # causal: nothing from later tokens
        torch.testing.assert_close(r.full_row[:, :3].sum(-1), torch.ones(3))


# ------------------------------------------------------------------------------------- Explanation object
def test_explanation_views_save_load_html_overlay(tmp_path):
    m, x = M.model("vit"), M.inputs_for("vit")
    e = explain(m, x, "rollout", return_layers=True, head_fusion=[1.0, 2.0, 3.0, 4.0])
    assert e.as_grid().shape == (3, 4, 4) and e.layers.shape == (2, 3, 17)
    torch.testing.assert_close(e.layers[-1], e.full_row)
    assert torch.allclose(e.normalized("max").scores.amax(-1), torch.ones(3))
    mm = e.normalized("minmax").scores
    assert torch.allclose(mm.amin(-1), torch.zeros(3)) and torch.allclose(mm.amax(-1), torch.ones(3))
    assert torch.allclose(e.normalized("sum").scores.sum(-1), torch.ones(3))
    with pytest.raises(ValueError, match="kind must be one of"):
        e.normalized("l2")
    path = e.save(tmp_path / "ex")
    assert path.endswith(".npz") and not [p for p in tmp_path.iterdir() if p.name.startswith(".attnroll-")]
    back = Explanation.load(path)
    torch.testing.assert_close(back.scores, e.scores)
    torch.testing.assert_close(back.layers, e.layers)
    assert back.grid == (4, 4) and back.prefix == 1 and back.method == "rollout" and back.target == e.target
    assert back.options["head_fusion"] == [1.0, 2.0, 3.0, 4.0] and back.options["return_layers"] is True
    assert "<table" in e.to_html(0)
    PIL = pytest.importorskip("PIL.Image")
    img = e.overlay(PIL.new("RGB", (32, 32), "white"), index=0)
    assert img.size == (32, 32) and img.mode == "RGB"


def test_text_html_and_tokens(tmp_path):
    class Tok:
        def convert_ids_to_tokens(self, row):
            return [f"t{i}<" for i in row]

    m, x = M.model("bert"), M.inputs_for("bert")
    e = explain(m, x, "gae", tokenizer=Tok())
    assert e.tokens[0][0] == f"t{int(x['input_ids'][0, 0])}<"
    html = e.to_html(2)
    assert "&lt;" in html and html.count("<span") == 5  # padding left out
    with pytest.raises(ValueError, match="as_grid.. needs a patch grid"):
        e.as_grid()
    back = Explanation.load(e.save(tmp_path / "t.npz"))
    assert back.tokens == e.tokens
    torch.testing.assert_close(back.attention_mask, e.attention_mask)


def test_explainer_and_methods_listing():
    names = methods()
    for n in SELF_METHODS:
        assert n in names and names[n]
    m, x = M.model("vit"), M.inputs_for("vit")
    ex = Explainer(m, "grad_rollout", residual_mode="blend")
    torch.testing.assert_close(ex(x, target=1).scores, explain(m, x, "grad_rollout", 1, residual_mode="blend").scores)
    with pytest.raises(ValueError, match="has no option 'discard'"):
        Explainer(m, "rollout", discard=0.9)


def test_model_left_as_it_was():
    m, x = M.model("vit"), M.inputs_for("vit")
    m.train()
    for p in m.parameters():
        p.requires_grad_(False)
    explain(m, x, "gae")
    assert m.training and not any(p.requires_grad for p in m.parameters())
    assert all(p.grad is None for p in m.parameters())
    assert m.config._attn_implementation == M._built("vit").config._attn_implementation


# ----------------------------------------------------------------------------------------------- errors
def test_unknown_method_lists_the_methods():
    m, x = M.model("vit"), M.inputs_for("vit")
    with pytest.raises(ValueError, match=r"got 'rolout'.*rollout:.*gae:"):
        explain(m, x, "rolout")


@pytest.mark.parametrize("target,match", [
    (5, r"target=5 is out of range for 5 classes"),
    ([0, 1], r"one entry per example: the batch has B=3"),
    ([0, 1, -6], r"target\[2\]=-6 is out of range"),
    (1.5, r"target must be None .* got float"),
])
def test_bad_targets(target, match):
    m, x = M.model("vit"), M.inputs_for("vit")
    with pytest.raises((ValueError, TypeError), match=match):
        explain(m, x, "gae", target=target)
    with pytest.raises((ValueError, TypeError), match=match):
        explain(m, x, "rollout", target=target)  # validated even where the map does not depend on it


def test_bad_callable_targets():
    m, x = M.model("vit"), M.inputs_for("vit")
    with pytest.raises(ValueError, match=r"one scalar per example, shape \(3,\), got shape \(3, 5\)"):
        explain(m, x, "gae", target=lambda out: out.logits)
    with pytest.raises(ValueError, match=r"shape \(3,\), got shape \(\)"):
        explain(m, x, "gae", target=lambda out: out.logits.sum())
    with pytest.raises(TypeError, match="must return a torch.Tensor"):
        explain(m, x, "gae", target=lambda out: 1.0)


def test_gradient_methods_refuse_no_grad_with_a_way_out():
    m, x = M.model("vit"), M.inputs_for("vit")
    for method in ("gae", "grad_rollout", "attn_gradcam"):
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"under torch.no_grad\(\).*'rollout'"):
            explain(m, x, method)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"inference_mode"):
        explain(m, x, "gae")
    with torch.no_grad():
        explain(m, x, "rollout")  # fine


def test_options_that_make_no_sense_say_what_would():
    m, x = M.model("vit"), M.inputs_for("vit")
    with pytest.raises(ValueError, match=r"head_fusion= makes no sense for method 'gae'.*grad_rollout"):
        explain(m, x, "gae", head_fusion="max")
    with pytest.raises(ValueError, match=r"rows= makes no sense.*position="):
        explain(m, x, "rollout", rows=[0])
    with pytest.raises(ValueError, match=r"no option 'discard_ratio'.*Methods that take discard_ratio=: rollout"):
        explain(m, x, "attn_gradcam", discard_ratio=0.5)
    with pytest.raises(ValueError, match=r"return_layers= makes no sense for method 'flow'"):
        explain(m, x, "flow", return_layers=True)
    with pytest.raises(ValueError, match=r"flow on 17 tokens .*method='rollout'"):
        explain(m, x, "flow", max_tokens=10)
    with pytest.raises(ValueError, match=r"position=17 is out of range for 17 tokens"):
        explain(m, x, "rollout", position=17)
    with pytest.raises(ValueError, match="no logits.*callable"):
        explain(M.T.ViTModel(m.config), x, "gae")
