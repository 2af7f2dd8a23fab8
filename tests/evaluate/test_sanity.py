"""Cascading randomisation: what rollout can and cannot see, determinism, the caller's model left alone."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

import attnroll

from attnroll.evaluate.sanity import (
    SanityResult,
    _plan,
    _reinitialise,
    cascading_randomization,
    component_parameters,
    find_blocks,
    find_head,
)

from ..zoo import TIMM_SMALL, EncoderClassifier

# Left out of `make test-fast` (its 90 s budget on 2 cores); `make test` and CI run it.
pytestmark = pytest.mark.slow

ALL4 = ("rollout", "gae", "grad_rollout", "raw")
EXACT = dict(abs=1e-12)


@pytest.fixture(scope="module")
def shapes():
    pytest.importorskip("transformers")
    from attnroll.models.shapes import load_shapes_model, make_dataset, preprocess

    return load_shapes_model(), preprocess(make_dataset(4, 3)[0])


@pytest.fixture(scope="module")
def shapes_value(shapes):
    return cascading_randomization(*shapes, ALL4, component="value")


def tiny_timm():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", **TIMM_SMALL).eval()


# ----------------------------------------------------------------------------------------------- shapes model
def test_shapes_head_and_top_block_values_leave_rollout_exactly_unchanged(shapes_value):
    r = shapes_value
    assert isinstance(r, SanityResult)
    assert r.steps == ["classifier", "layer 3", "layer 2", "layer 1", "layer 0"]
    assert r.methods == list(ALL4) and r.component == "value"
    assert r.head == "classifier" and r.blocks == "vit.layers"
    for m in ALL4:
        assert r.correlations[m].shape == (5,) and r.per_example[m].shape == (5, 4)
    # attention-only maps: the head and the top block's value/output projections do not enter any attention
    for m in ("rollout", "raw"):
        assert r.per_example[m][:2] == pytest.approx(np.ones((2, 4)), **EXACT)
    # gradient methods see the new head at once
    for m in ("gae", "grad_rollout"):
        assert r.correlations[m][0] < 0.95
        assert np.all(r.per_example[m][0] < 0.999)
    # values of lower blocks change the attention of the blocks above them
    assert r.correlations["rollout"][-1] < 0.99
    assert r.correlations["raw"][2] < 0.99


def test_shapes_mlp_of_top_block_leaves_rollout_unchanged(shapes):
    r = cascading_randomization(*shapes, ("rollout",), component="mlp")
    assert r.per_example["rollout"][:2] == pytest.approx(np.ones((2, 4)), **EXACT)
    assert r.correlations["rollout"][-1] < 0.99


def test_shapes_qk_of_top_block_changes_rollout(shapes):
    r = cascading_randomization(*shapes, ("rollout",), component="qk")
    assert r.correlations["rollout"][0] == pytest.approx(1.0, **EXACT)
    assert r.correlations["rollout"][1] < 0.999


def test_shapes_all_blocks_randomised_drive_rollout_well_below_one(shapes):
    r = cascading_randomization(*shapes, ("rollout",), component="all")
    c = r.correlations["rollout"]
    assert c[0] == pytest.approx(1.0, **EXACT)
    assert c[-1] < 0.8
    assert c[-1] < c[1]  # cumulative: more randomised blocks, further from the original


def _value_redrawn(model):
    """Eager-attention copies of ``model``: as trained, and after every step of the "value" plan (head, then
    every block's v / o)."""
    trained = copy.deepcopy(model).eval()
    trained.set_attn_implementation("eager")  # so that output_attentions returns the probabilities
    work = copy.deepcopy(trained)
    gen = torch.Generator().manual_seed(0)
    for _, targets in _plan(work, "value")[1]:
        _reinitialise(targets, gen)
    return trained, work


def test_value_redraw_changes_every_value_path_and_nothing_else(shapes):
    model, x = shapes
    model, work = _value_redrawn(model)
    before, after = dict(model.named_parameters()), dict(work.named_parameters())
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    want = {f"vit.layers.{i}.attention.{p}_proj.{w}" for i in range(4) for p in "vo" for w in ("weight", "bias")}
    assert changed == want | {"classifier.weight", "classifier.bias"}
    for k in want:  # every element re-drawn, at the replaced values' spread
        assert not torch.isclose(before[k], after[k]).any(), k
        assert float(after[k].detach().std()) == pytest.approx(float(before[k].detach().std()), rel=0.5), k
    with torch.no_grad():
        a = model(pixel_values=x, output_attentions=True, output_hidden_states=True)
        b = work(pixel_values=x, output_attentions=True, output_hidden_states=True)
    # block 0 reads the untouched embeddings with untouched q / k: the same attention; the blocks above read
    # hidden states the new value paths wrote, so theirs moves
    torch.testing.assert_close(a.attentions[0], b.attentions[0], atol=1e-7, rtol=0)
    assert (a.attentions[3] - b.attentions[3]).abs().max() > 1e-2
    for i in range(4):  # each block's value path on the same input: the new vectors are unrelated to the old
        with torch.no_grad():
            h = model.vit.layers[i].layernorm_before(a.hidden_states[i])
            old = model.vit.layers[i].attention.o_proj(model.vit.layers[i].attention.v_proj(h))
            new = work.vit.layers[i].attention.o_proj(work.vit.layers[i].attention.v_proj(h))
        cos = torch.nn.functional.cosine_similarity(old.flatten(0, 1), new.flatten(0, 1), dim=-1)
        assert float(cos.abs().mean()) < 0.25, i  # 64-dim independent directions: about 0.1


def test_value_aware_layer0_map_sees_the_redraw_through_the_values_alone(shapes):
    pytest.importorskip("transformers")
    model, x = shapes
    model, work = _value_redrawn(model)
    with torch.no_grad():
        a = work(pixel_values=x, output_attentions=True, output_hidden_states=True)
        att = work.vit.layers[0].attention
        h = work.vit.layers[0].layernorm_before(a.hidden_states[0])  # (B, n, d)
        v = att.v_proj(h).unflatten(-1, (4, 16))  # (B, n, H, d_h)
        alpha = a.attentions[0][:, :, 0]  # the CLS row (B, H, n)
        mixed = torch.einsum("bhj,bjhe->bjhe", alpha, v).flatten(-2) @ att.o_proj.weight.T  # b_O excluded
    want = mixed.norm(dim=-1)  # Kobayashi's ‖Σ_h α^h_0j f^h(x_j)‖ from the re-drawn modules
    got = attnroll.explain(work, x, "norm", layer=0).full_row
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the cascade on the layer-0 maps: raw attention never moves (exactly 1), norm only at the layer 0 step
    r = cascading_randomization(model, x, ("raw", "norm"), component="value",
                                method_options={"raw": {"layer": 0}, "norm": {"layer": 0}})
    assert r.per_example["raw"] == pytest.approx(np.ones((5, 4)), **EXACT)
    assert r.per_example["norm"][:4] == pytest.approx(np.ones((4, 4)), **EXACT)
    assert r.correlations["norm"][4] < 0.95


def test_image_correlations_count_every_patch(shapes, shapes_value):
    """Images: each map's Spearman correlation is over all its patches (no unit is left out), as scipy gives
    it on maps from a copy re-drawn step by step in the plan's order."""
    stats = pytest.importorskip("scipy.stats")
    model, x = shapes
    with torch.no_grad():
        pred = model(pixel_values=x).logits.argmax(-1).tolist()
    work = copy.deepcopy(model).eval()
    gen = torch.Generator().manual_seed(0)

    def maps():
        return {m: attnroll.explain(work, x, m, target=pred).scores.double().numpy() for m in ALL4}

    first = maps()
    for s, (_, targets) in enumerate(_plan(work, "value")[1]):
        _reinitialise(targets, gen)
        now = maps()
        for m in ALL4:
            want = [stats.spearmanr(first[m][i], now[m][i])[0] for i in range(x.shape[0])]
            np.testing.assert_allclose(shapes_value.per_example[m][s], want, atol=1e-9, rtol=0, err_msg=(m, s))


def test_seed_determinism_and_caller_model_untouched(shapes):
    model, x = shapes
    model.train()  # the caller's mode must survive (the copy runs in eval mode)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.requires_grad for k, p in model.named_parameters()}
    try:
        a = cascading_randomization(model, x, ("rollout", "gae"), component="all", seed=5)
        b = cascading_randomization(model, x, ("rollout", "gae"), component="all", seed=5)
        c = cascading_randomization(model, x, ("rollout", "gae"), component="all", seed=6)
    finally:
        training = model.training
        model.eval()
    assert training
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert grads == {k: p.requires_grad for k, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())
    for m in ("rollout", "gae"):
        np.testing.assert_array_equal(a.per_example[m], b.per_example[m])
    assert not np.array_equal(a.per_example["rollout"][1:], c.per_example["rollout"][1:])


def test_target_is_the_original_prediction_and_stays_fixed(shapes, shapes_value):
    model, x = shapes
    with torch.no_grad():
        pred = model(pixel_values=x).logits.argmax(-1).tolist()
    explicit = cascading_randomization(model, x, ("gae",), component="value", target=pred)
    # if the default re-resolved the target on the randomised model, gae would explain other classes
    np.testing.assert_array_equal(explicit.per_example["gae"], shapes_value.per_example["gae"])
    other = cascading_randomization(model, x, ("gae",), component="value", target=[(p + 1) % 4 for p in pred])
    assert not np.array_equal(other.per_example["gae"], shapes_value.per_example["gae"])


def test_batching_does_not_change_results(shapes, shapes_value):
    r = cascading_randomization(*shapes, ("rollout", "gae"), component="value", batch_size=3)
    for m in ("rollout", "gae"):
        np.testing.assert_allclose(r.per_example[m], shapes_value.per_example[m], atol=1e-6)


def test_works_under_no_grad(shapes):
    with torch.no_grad():
        r = cascading_randomization(*shapes, ("gae",), component="value")
    assert r.correlations["gae"][0] < 0.95


def test_summary_as_dict_plot(shapes_value):
    r = shapes_value
    text = r.summary()
    assert all(m in text for m in ALL4) and "layer 0" in text and "classifier" in text
    assert len(text.splitlines()) == 2 + len(r.steps)
    d = r.as_dict()
    json.dumps(d, allow_nan=False)
    assert d["correlations"]["rollout"][0] == pytest.approx(1.0) and len(d["per_example"]["gae"]) == 5
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        assert r.plot(ax) is ax
        assert len(ax.get_lines()) == len(ALL4) + 1  # one per method and the zero line
        np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), r.correlations["rollout"])
    finally:
        plt.close(fig)


# ----------------------------------------------------------------------------------------------- timm
def test_timm_vit_head_and_top_values_vs_qk():
    model = tiny_timm()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert find_blocks(model)[0] == "blocks" and find_head(model, "blocks")[0] == "head"
    r = cascading_randomization(model, x, ("rollout", "gae"), component="value")
    assert r.steps == ["classifier", "layer 1", "layer 0"]
    assert r.per_example["rollout"][:2] == pytest.approx(np.ones((2, 3)), **EXACT)
    assert r.correlations["gae"][0] < 0.95
    q = cascading_randomization(model, x, ("rollout",), component="qk")
    assert q.correlations["rollout"][0] == pytest.approx(1.0, **EXACT)
    assert q.correlations["rollout"][1] < 0.999


@pytest.mark.parametrize(
    "component,changed_rows,changed",
    [
        ("qk", slice(0, 64), {"attn.qkv.weight", "attn.qkv.bias"}),
        ("value", slice(64, 96), {"attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias"}),
        ("mlp", None, {"mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"}),
        ("all", slice(0, 96), None),
    ],
)
def test_timm_fused_qkv_rows(component, changed_rows, changed):
    block = tiny_timm().blocks[1]
    for p in block.parameters():  # non-constant biases and norms, so a replacement is visible
        with torch.no_grad():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    _reinitialise(component_parameters(block, component), torch.Generator().manual_seed(0))
    after = block.state_dict()
    names = set(before) if changed is None else changed
    for k in before:
        if k not in names:
            assert torch.equal(before[k], after[k]), k
            continue
        if k.startswith("attn.qkv"):
            rows = changed_rows
            keep = torch.ones(96, dtype=torch.bool)
            keep[rows] = False
            assert torch.equal(before[k][keep], after[k][keep]), k
            assert not torch.isclose(before[k][rows], after[k][rows]).any(), k
        else:
            assert not torch.isclose(before[k], after[k]).all(), k
    # the draws have the replaced values' spread
    if component == "mlp":
        w0, w1 = before["mlp.fc1.weight"], after["mlp.fc1.weight"]
        assert float(w1.std()) == pytest.approx(float(w0.std()), rel=0.15)
        assert abs(float(w1.mean())) < 0.2 * float(w0.std())


# ----------------------------------------------------------------------------------------------- other layouts
def test_hf_v4_bert_names_and_finders():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                                  vocab_size=30)
    model = transformers.BertForSequenceClassification(cfg)
    path, blocks = find_blocks(model)
    assert path == "bert.encoder.layer" and len(blocks) == 2
    assert find_head(model, path)[0] == "classifier"

    def names(c):
        return {n.rsplit(".", 1)[0] for n, _, _ in component_parameters(blocks[0], c)}

    assert names("qk") == {"attention.self.query", "attention.self.key"}
    assert names("value") == {"attention.self.value", "attention.output.dense"}
    assert names("mlp") == {"intermediate.dense", "output.dense"}
    assert "attention.output.LayerNorm" in names("all") and "output.LayerNorm" in names("all")
    # text inputs as a dict, split into batches (3 examples, batches of 2)
    torch.manual_seed(0)
    model.eval()
    ids = torch.randint(1, 30, (3, 6), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    r = cascading_randomization(model, inputs, ("rollout", "gae"), component="mlp", batch_size=2)
    assert r.steps == ["classifier", "layer 1", "layer 0"]
    assert r.per_example["rollout"][:2] == pytest.approx(np.ones((2, 3)), **EXACT)
    whole = cascading_randomization(model, inputs, ("rollout", "gae"), component="mlp")
    np.testing.assert_allclose(r.per_example["gae"], whole.per_example["gae"], atol=1e-6)


def test_hf_v5_vit_names(shapes):
    block = find_blocks(shapes[0])[1][0]
    names = lambda c: {n.rsplit(".", 1)[0] for n, _, _ in component_parameters(block, c)}  # noqa: E731
    assert names("qk") == {"attention.q_proj", "attention.k_proj"}
    assert names("value") == {"attention.v_proj", "attention.o_proj"}
    assert names("mlp") == {"mlp.fc1", "mlp.fc2"}
    assert {"layernorm_before", "layernorm_after"} <= names("all")


def test_torch_transformer_encoder_generic():
    torch.manual_seed(0)
    model = EncoderClassifier().eval()
    path, blocks = find_blocks(model)
    assert path == "encoder.layers" and find_head(model, path)[0] == "head"
    qk = component_parameters(blocks[0], "qk")
    assert [(n, r) for n, _, r in qk] == [("self_attn.in_proj_weight", slice(0, 32)),
                                          ("self_attn.in_proj_bias", slice(0, 32))]
    ids = torch.randint(0, 20, (3, 7), generator=torch.Generator().manual_seed(0))
    r = cascading_randomization(model, ids, ("rollout",), component="value")
    assert r.per_example["rollout"][:2] == pytest.approx(np.ones((2, 3)), **EXACT)


class Stages(nn.Module):
    """Blocks under an unusual name, a head under an unusual name."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.stages = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.small = nn.ModuleList([nn.Sequential(nn.Linear(8, 2), nn.ReLU()) for _ in range(2)])
        self.out = nn.Linear(8, 2)


def test_generic_finders():
    model = Stages()
    path, blocks = find_blocks(model)
    assert path == "stages" and len(blocks) == 3
    assert find_head(model, path)[0] == "out"
    with pytest.raises(ValueError, match="'qk' parameters"):
        component_parameters(blocks[0], "qk")


# ----------------------------------------------------------------------------------------------- errors
def test_errors(shapes):
    model, x = shapes
    with pytest.raises(ValueError, match="component must be one of 'all', 'qk', 'value', 'mlp'"):
        cascading_randomization(model, x, component="attention")
    with pytest.raises(ValueError, match="method must be one of the registered methods.*rollout"):
        cascading_randomization(model, x, ("rollout", "nope"))
    with pytest.raises(ValueError, match="at least one method"):
        cascading_randomization(model, x, [])
    with pytest.raises(ValueError, match="more than once"):
        cascading_randomization(model, x, ["gae", "gae"])
    with pytest.raises(TypeError, match="methods must hold method names"):
        cascading_randomization(model, x, [3])
    with pytest.raises(ValueError, match="not among the methods"):
        cascading_randomization(model, x, ("rollout",), method_options={"gae": {}})
    with pytest.raises(ValueError, match="has no option 'nope'"):
        cascading_randomization(model, x, ("rollout",), method_options={"rollout": {"nope": 1}})
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        cascading_randomization(lambda t: t, x)
    with pytest.raises(TypeError, match="inputs must be"):
        cascading_randomization(model, [1, 2])
    with pytest.raises(ValueError, match="seed must be"):
        cascading_randomization(model, x, seed=-1)
    flat = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 4))
    with pytest.raises(ValueError, match=r"cannot find the transformer blocks of Sequential: looked for .*encoder"):
        cascading_randomization(flat, x, ("rollout",))
