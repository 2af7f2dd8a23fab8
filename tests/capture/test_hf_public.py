"""The public output_attentions=True path, for transformers families that declare no output recorder:
captured attention against the model's own eager output_attentions (a separately built eager copy), padded
batches against cropped examples, state restored, gradients reaching the captured tensors."""

from __future__ import annotations

import copy

import pytest
import torch

import attnroll

from .helpers import snapshot

T = pytest.importorskip("transformers")

C = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=32, vocab_size=99,
         max_position_embeddings=64)
BUILDERS = {
    "deberta-v2": lambda: T.DebertaV2Model(T.DebertaV2Config(**C)),
    "mpnet": lambda: T.MPNetModel(T.MPNetConfig(**C)),
    "roformer": lambda: T.RoFormerModel(T.RoFormerConfig(**C)),
    "xlm": lambda: T.XLMModel(T.XLMConfig(n_layers=2, emb_dim=32, n_heads=4, vocab_size=99, max_position_embeddings=64)),
    "bloom": lambda: T.BloomModel(T.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=99)),
    "falcon": lambda: T.FalconModel(T.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                   vocab_size=99)),
    "gpt_neo": lambda: T.GPTNeoModel(T.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=99,
                                                    attention_types=[[["global", "local"], 1]],
                                                    max_position_embeddings=64)),
    "data2vec-vision": lambda: T.Data2VecVisionModel(T.Data2VecVisionConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37, image_size=32,
        patch_size=8)),
}
CAUSAL = ("bloom", "falcon", "gpt_neo")


def build(name):
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


def eager_copy(model):
    """The same weights in a model built with attn_implementation='eager' from the start."""
    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = "eager"
    ref = type(model)(cfg).eval()
    ref.load_state_dict(model.state_dict())
    return ref


def inputs(name, pad=True):
    g = torch.Generator().manual_seed(1)
    if name == "data2vec-vision":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    mask = torch.ones(2, 7, dtype=torch.long)
    if pad:
        mask[1, 5:] = 0
    return {"input_ids": torch.randint(3, 99, (2, 7), generator=g), "attention_mask": mask}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_public_path_equals_the_models_own_eager_attentions(name):
    model = build(name)
    assert not getattr(model, "_can_record_outputs", None)  # no recorder: the public path is taken
    inp = inputs(name)
    before = snapshot(model)
    rec = attnroll.capture(model, inp)
    assert snapshot(model) == before
    assert rec.family.endswith("(output_attentions)")
    with torch.no_grad():
        expect = eager_copy(model)(**inp, output_attentions=True).attentions
    assert len(rec.attentions) == len(expect) == 2
    mask = inp.get("attention_mask", torch.ones(2, rec.attentions[0].shape[-1]))
    for got, ref in zip(rec.attentions, expect):
        real = mask.bool()[:, None, :, None]  # padded query rows may differ in what they hold
        torch.testing.assert_close(got * real, ref * real, atol=1e-5, rtol=1e-5)
    info = rec.info["self"]
    assert info.causal == (name in CAUSAL)
    assert info.readout.kind == ("last" if name in CAUSAL else "mean" if name == "data2vec-vision" else "cls")
    if name == "data2vec-vision":
        assert info.prefix == 1 and info.grid == (4, 4)


@pytest.mark.parametrize("name", [n for n in BUILDERS if n != "data2vec-vision"])
def test_public_path_padded_batch_equals_cropped_examples_and_gradients_reach(name):
    model = build(name)
    inp = inputs(name)
    e = attnroll.explain(model, inp, "rollout")
    for b in range(2):
        keep = int(inp["attention_mask"][b].sum())
        one = {k: v[b : b + 1, :keep] for k, v in inp.items()}
        alone = attnroll.explain(model, one, "rollout")
        torch.testing.assert_close(alone.scores[0], e.scores[b, :keep], atol=1e-5, rtol=1e-4)
    g = attnroll.explain(model, inp, "gae", target=lambda o: o.last_hidden_state[:, 0].norm(dim=-1))
    assert float(g.scores.abs().sum()) > 0


def test_returned_scores_that_are_not_probabilities_are_refused(monkeypatch):
    """SqueezeBERT returns its pre-softmax scores as "attentions". Its registry obstacle names that before any
    forward pass (tests/capture/test_refusals.py); without it, the check of the returned tensors refuses them."""
    from dataclasses import replace

    from attnroll.capture import registry

    monkeypatch.setattr(registry, "FAMILIES", tuple(replace(f, obstacles=()) for f in registry.FAMILIES))
    torch.manual_seed(0)
    model = T.SqueezeBertModel(T.SqueezeBertConfig(**C, embedding_size=32)).eval()
    with pytest.raises(attnroll.UnsupportedModelError, match="not row-stochastic"):
        attnroll.capture(model, inputs("squeezebert"))


def test_a_stack_that_pools_between_layers_is_refused_with_the_reason():
    torch.manual_seed(0)
    funnel = T.FunnelModel(T.FunnelConfig(block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=37,
                                          vocab_size=99)).eval()
    before = snapshot(funnel)
    with pytest.raises(attnroll.UnsupportedModelError, match="different token counts"):
        attnroll.capture(funnel, {"input_ids": torch.randint(3, 99, (1, 7))})
    assert snapshot(funnel) == before


def test_a_reshaped_private_declaration_fails_naming_the_version(monkeypatch):
    """A transformers release that reshapes its private recorder declaration: a clear error naming the
    version (not a deep traceback, not a silently empty capture); the model is left as it was."""
    from attnroll.capture import hf

    def changed(pm):
        raise hf.PrivateChanged("test: a reshaped declaration")

    monkeypatch.setattr(hf, "_declared", changed)
    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(**C)).eval()
    before = snapshot(bert)
    with pytest.raises(attnroll.UnsupportedModelError, match=f"transformers {T.__version__} changed"):
        attnroll.capture(bert, inputs("bert"))
    assert snapshot(bert) == before


def test_bigbird_switching_to_full_attention_on_its_first_call_is_captured():
    """On a short input BigBird replaces its block-sparse attention modules by full ones inside its first
    forward; the capture finds the new modules and equals the eager attentions of that forward."""
    torch.manual_seed(0)
    cfg = T.BigBirdConfig(**C, attention_type="block_sparse", block_size=4, num_random_blocks=1)
    model = T.BigBirdModel(cfg).eval()
    inp = inputs("bigbird")
    rec = attnroll.capture(model, inp)
    assert model.attention_type == "original_full"  # transformers' own switch
    with torch.no_grad():
        expect = eager_copy(model)(**inp, output_attentions=True).attentions
    for got, ref in zip(rec.attentions, expect):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
