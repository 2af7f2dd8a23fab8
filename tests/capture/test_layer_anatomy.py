"""The layer anatomy (``model_facts(model).anatomy``) against the modules it describes: every block of each
supported family recomputed in the test from the anatomy's arrays alone (q / k / v / o, heads and KV
grouping, the norms where the anatomy says they sit, the MLP, layer scales) equals the block's real output;
sanity's randomisation re-draws exactly the tensors a hand-written table names; unknown families refused
with their name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import attnroll
from attnroll._checks import UnsupportedModelError
from attnroll.capture import model_facts
from attnroll.capture.anatomy import anatomy
from attnroll.capture.layers import ModelAnatomy, norm_params
from attnroll.evaluate.sanity import _reinitialise, cascading_randomization

from ..methods import value_aware_reference as R

T = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
F64 = torch.float64


# ------------------------------------------------------------------------------------------- tiny models
def build(family: str) -> tuple[nn.Module, object]:
    """A 2-block float64 random-weight model of ``family`` and inputs for it."""
    g = torch.Generator().manual_seed(3)
    img = lambda s: torch.randn(2, 3, s, s, generator=g, dtype=F64)  # noqa: E731
    eager = dict(attn_implementation="eager")
    if family in ("bert", "vit", "gpt2", "llama"):
        return R.build(family), R.inputs_for(family)
    if family == "distilbert":
        cfg = T.DistilBertConfig(vocab_size=30, dim=8, n_layers=2, n_heads=2, hidden_dim=12,
                                 max_position_embeddings=16, num_labels=3, **eager)
        return R._randomise(T.DistilBertForSequenceClassification(cfg), 1), R.inputs_for("bert")
    if family == "dinov2":
        cfg = T.Dinov2Config(image_size=16, patch_size=8, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                             mlp_ratio=2, num_labels=3, layerscale_value=0.5, **eager)
        return R._randomise(T.Dinov2ForImageClassification(cfg), 2), img(16)
    if family == "timm":
        m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, depth=2, img_size=32,
                              patch_size=16, embed_dim=16, num_heads=2, init_values=0.5)
        return R._randomise(m, 4), img(32)
    if family == "qwen2":  # biased q / k / v projections, grouped KV
        cfg = T.Qwen2Config(vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=12, head_dim=2, **eager)
        return R._randomise(T.Qwen2ForCausalLM(cfg), 6), R.inputs_for("llama")
    if family == "torch":
        layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True, norm_first=False)
        enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        return R._randomise(enc, 5), torch.randn(2, 5, 8, generator=g, dtype=F64)
    raise ValueError(family)


def run(model, x):
    with torch.no_grad():
        return model(**x) if isinstance(x, dict) else model(x)


FAMILIES = ["bert", "distilbert", "vit", "dinov2", "timm", "gpt2", "llama", "qwen2", "torch"]
CAUSAL = {"gpt2", "llama", "qwen2"}


# ------------------------------------------------------------------------------------------- naive block
def _norm(x, mod):
    p = norm_params(mod, F64)
    if p.rms:
        y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + p.eps)
    else:
        mu = x.mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt((x - mu).pow(2).mean(-1, keepdim=True) + p.eps)
    y = y if p.weight is None else y * p.weight
    return y if p.bias is None else y + p.bias


def _lin(x, proj):
    w, b = proj.arrays(F64)
    return x @ w.T if b is None else x @ w.T + b


def _rotate(t, cos, sin):
    half = t.shape[-1] // 2
    rot = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos[:, None] + rot * sin[:, None]


def _attention(layer, h, causal, rope):
    B, n, _ = h.shape
    H, Hkv = layer.heads, layer.kv_heads
    dh = layer.q.arrays()[0].shape[0] // H
    q = _lin(h, layer.q).view(B, n, H, dh).transpose(1, 2)
    k = _lin(h, layer.k).view(B, n, Hkv, dh).transpose(1, 2)
    v = _lin(h, layer.v).view(B, n, Hkv, dh).transpose(1, 2)
    if rope is not None:
        q, k = _rotate(q, *rope), _rotate(k, *rope)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(dh)
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, n, H * dh)
    return _lin(o, layer.o)


def _block(layer, x, causal, rope):
    scale = lambda mod, y: y if mod is None else mod(y)  # noqa: E731
    act = layer.act

    def mlp(u):
        inner = act(_lin(u, layer.gate)) * _lin(u, layer.fc1) if layer.gate is not None else act(_lin(u, layer.fc1))
        return _lin(inner, layer.fc2)

    if layer.pre_norm:
        h = x + scale(layer.ls1, _attention(layer, _norm(x, layer.norm1), causal, rope))
        return h + scale(layer.ls2, mlp(_norm(h, layer.norm2)))
    h = _norm(x + _attention(layer, x, causal, rope), layer.norm1)
    return _norm(h + mlp(h), layer.norm2)


def _block_io(model, x, anat):
    """(input, output, rotary (cos, sin) or None) of every block in one forward pass."""
    seen = {}
    handles = []
    for layer in anat.layers:
        def pre(m, a, k, i=layer.index):
            seen[i] = [a[0] if a else k.get("hidden_states", k.get("src")), k.get("position_embeddings")]

        def post(m, a, k, o, i=layer.index):
            seen[i].append(o[0] if isinstance(o, (tuple, list)) else o)

        handles += [layer.module.register_forward_pre_hook(pre, with_kwargs=True),
                    layer.module.register_forward_hook(post, with_kwargs=True)]
    try:
        run(model, x)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(anat.layers))]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_block_recomputed_from_the_anatomy_equals_its_real_output(family):
    model, x = build(family)
    anat = model_facts(model).anatomy
    builder = {"dinov2": "vit", "qwen2": "llama"}.get(family, family)  # DINOv2 blocks are the ViT builder's (with layer scales)
    assert isinstance(anat, ModelAnatomy) and anat.family == builder and len(anat.layers) == 2
    modules = dict(model.named_modules())
    for layer in anat.layers:
        assert modules[layer.path] is layer.module
        inside = dict(layer.module.named_modules())
        for proj in (layer.q, layer.k, layer.v, layer.o, layer.fc1, layer.fc2):
            assert inside[proj.path] is proj.module
        assert all(inside[p] is m for p, m in layer.norms)
    for layer, (inp, rope, out) in zip(anat.layers, _block_io(model, x, anat)):
        with torch.no_grad():
            mine = _block(layer, inp, family in CAUSAL, rope)
        torch.testing.assert_close(mine, out, atol=1e-6, rtol=0)


def test_grouped_kv_and_norm_positions_are_what_the_modules_hold():
    llama = model_facts(R.build("llama")).anatomy
    assert [(L.heads, L.kv_heads, L.residual) for L in llama.layers] == [(4, 2, "pre-norm")] * 2
    assert llama.layers[0].v.arrays()[0].shape == (4, 8)  # 2 kv heads of dimension 2
    bert = model_facts(R.build("bert")).anatomy
    assert bert.layers[0].residual == "post-norm" and bert.pooler is not None
    gpt2 = model_facts(R.build("gpt2")).anatomy.layers[0]
    w = gpt2.module.attn.c_attn.weight  # Conv1D: (in, 3 out); V is its last third of columns
    torch.testing.assert_close(gpt2.v.arrays()[0], w[:, 16:24].T.detach())


# ------------------------------------------------------------------------------------------- unknown families
def _gpt_neo():
    cfg = T.GPTNeoConfig(vocab_size=30, hidden_size=8, num_layers=2, num_heads=2, max_position_embeddings=16,
                         attention_types=[[["global"], 2]], intermediate_size=12)
    return R._randomise(T.GPTNeoForCausalLM(cfg), 0)


def test_an_unknown_family_is_refused_naming_it():
    m, x = _gpt_neo(), R.inputs_for("gpt2")
    facts = model_facts(m)
    assert facts.anatomy is None and "GPTNeoBlock" in facts.anatomy_reason
    with pytest.raises(UnsupportedModelError, match="GPTNeoBlock.*looked for"):
        anatomy(m)
    with pytest.raises(UnsupportedModelError, match="value-aware methods cannot explain GPTNeoForCausalLM: .*GPTNeoBlock"):
        attnroll.explain(m, x, "alti")
    with pytest.raises(ValueError, match="GPTNeoBlock"):
        cascading_randomization(m, x, ("rollout",))
    attnroll.explain(m, x, "rollout")  # the capture itself still knows the model


def _lookalike(kind):
    small = dict(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12)
    if kind == "gemma":  # RMSNorm computing x ⊙ (1 + γ)
        return T.GemmaForCausalLM(T.GemmaConfig(**small, num_key_value_heads=1, head_dim=4))
    if kind == "gemma2":  # norms around the MLP branch the Llama layout does not have
        return T.Gemma2ForCausalLM(T.Gemma2Config(**small, num_key_value_heads=1, head_dim=4))
    if kind == "convbert":  # a span-convolution branch inside self-attention
        return T.ConvBertForSequenceClassification(T.ConvBertConfig(**small, embedding_size=8))
    if kind == "gpt_bigcode":  # GPT-2 names, but a multi-query Linear c_attn instead of GPT-2's (in, 3d) Conv1D
        return T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(vocab_size=30, n_embd=8, n_layer=1, n_head=2))
    return T.CohereForCausalLM(T.CohereConfig(**small, num_key_value_heads=1, head_dim=4))  # parallel branches


@pytest.mark.parametrize("kind,reason", [
    ("gemma", "GemmaRMSNorm.*does not compute a LayerNorm / RMSNorm"),
    ("gemma2", "does not place: pre_feedforward_layernorm.weight, post_feedforward_layernorm.weight"),
    ("convbert", "does not place: attention.self.key_conv_attn_layer"),
    ("cohere", "CohereDecoderLayer looks like a llama block but lacks .*post_attention_layernorm"),
    ("gpt_bigcode", "knows no block like GPTBigCodeBlock"),
])
def test_a_lookalike_block_the_anatomy_would_misdescribe_is_refused(kind, reason):
    m = _lookalike(kind)
    with pytest.raises(UnsupportedModelError, match=reason):
        anatomy(m)
    assert model_facts(m).anatomy is None
    with pytest.raises(ValueError, match=reason):
        cascading_randomization(m, {"input_ids": torch.ones(1, 3, dtype=torch.long)}, ("rollout",))


def test_a_model_without_blocks_names_what_was_looked_for():
    facts = model_facts(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert facts.anatomy is None and facts.anatomy_reason.startswith("cannot find the transformer blocks")


# ------------------------------------------------------------------------------------------- sanity
A = slice(None)
#: family -> component -> {block-relative parameter: the part re-drawn}, written from the modules' layouts.
EXPECTED = {
    "gpt2": {
        "qk": {"attn.c_attn.weight": (A, slice(0, 16)), "attn.c_attn.bias": slice(0, 16)},
        "value": {"attn.c_attn.weight": (A, slice(16, 24)), "attn.c_attn.bias": slice(16, 24),
                  "attn.c_proj.weight": A, "attn.c_proj.bias": A},
        "mlp": {"mlp.c_fc.weight": A, "mlp.c_fc.bias": A, "mlp.c_proj.weight": A, "mlp.c_proj.bias": A},
    },
    "llama": {
        "qk": {"self_attn.q_proj.weight": A, "self_attn.k_proj.weight": A},
        "value": {"self_attn.v_proj.weight": A, "self_attn.o_proj.weight": A},
        "mlp": {"mlp.gate_proj.weight": A, "mlp.up_proj.weight": A, "mlp.down_proj.weight": A},
    },
    "distilbert": {
        "qk": {f"attention.{n}_lin.{p}": A for n in "qk" for p in ("weight", "bias")},
        "value": {f"attention.{n}_lin.{p}": A for n in ("v", "out") for p in ("weight", "bias")},
        "mlp": {f"ffn.lin{n}.{p}": A for n in "12" for p in ("weight", "bias")},
    },
    "torch": {
        "qk": {"self_attn.in_proj_weight": slice(0, 16), "self_attn.in_proj_bias": slice(0, 16)},
        "value": {"self_attn.in_proj_weight": slice(16, 24), "self_attn.in_proj_bias": slice(16, 24),
                  "self_attn.out_proj.weight": A, "self_attn.out_proj.bias": A},
        "mlp": {f"linear{n}.{p}": A for n in "12" for p in ("weight", "bias")},
    },
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
@pytest.mark.parametrize("component", ["qk", "value", "mlp", "all"])
def test_sanity_redraws_exactly_the_tensors_the_anatomy_names(family, component):
    model, _ = build(family)
    layer = model_facts(model).anatomy.layers[-1]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _reinitialise(layer.targets(component), torch.Generator().manual_seed(0))
    after = dict(model.named_parameters())
    prefix = layer.path + "."
    norms = {f"{prefix}{p}.{q}" for p, m in layer.norms for q, _ in m.named_parameters()}
    for name, old in before.items():
        new = after[name].detach()
        want = torch.zeros_like(old, dtype=torch.bool)
        if name.startswith(prefix) and component == "all":
            want[...] = True  # drawn, or (norms) reset from their random values to 1 / 0
        elif name.startswith(prefix) and name[len(prefix):] in EXPECTED[family][component]:
            want[EXPECTED[family][component][name[len(prefix):]]] = True
        assert torch.equal(old != new, want), name
        if component == "all" and name in norms:
            assert torch.all(new == (0.0 if name.endswith("bias") else 1.0)), name


@pytest.mark.slow
def test_cascading_randomisation_on_a_decoder_reads_its_anatomy():
    cfg = T.LlamaConfig(vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=12, max_position_embeddings=16, num_labels=3,
                        pad_token_id=0, attn_implementation="eager")
    m = R._randomise(T.LlamaForSequenceClassification(cfg), 7)
    x = {"input_ids": torch.randint(1, 30, (3, 6), generator=torch.Generator().manual_seed(2))}
    r = cascading_randomization(m, x, ("rollout", "alti"), component="value")
    assert (r.head, r.blocks, r.steps) == ("score", "model.layers", ["classifier", "layer 1", "layer 0"])
    # the head and the top block's value path do not enter any attention: rollout's map stays exactly the same
    assert r.per_example["rollout"][:2] == pytest.approx(np.ones((2, 3)), abs=1e-12)
    assert r.correlations["alti"][1] < 0.999  # ALTI reads the values it lost


# ------------------------------------------------------------------------------------------- DecompX heads
def _pooled(kind):
    g = torch.Generator().manual_seed(9)
    if kind.startswith("dinov2"):
        regs = dict(num_register_tokens=2) if kind == "dinov2_registers" else {}
        Config = T.Dinov2WithRegistersConfig if regs else T.Dinov2Config
        Model = T.Dinov2WithRegistersForImageClassification if regs else T.Dinov2ForImageClassification
        cfg = Config(image_size=16, patch_size=8, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                     mlp_ratio=2, num_labels=3, layerscale_value=0.5, attn_implementation="eager", **regs)
        return R._randomise(Model(cfg), 11), torch.randn(2, 3, 16, 16, generator=g, dtype=F64)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, depth=2, img_size=32,
                          patch_size=16, embed_dim=16, num_heads=2, init_values=0.5,
                          global_pool="token" if kind == "timm_token_fc_norm" else "avg",
                          fc_norm=kind != "timm_avg", reg_tokens=1)
    return R._randomise(m, 12), torch.randn(2, 3, 32, 32, generator=g, dtype=F64)


POOLED = ["dinov2", "dinov2_registers", "timm_avg_fc_norm", "timm_avg", "timm_token_fc_norm"]


@pytest.mark.parametrize("kind", POOLED)
@pytest.mark.parametrize("bias", ["absdot", "separate"])
def test_decompx_of_a_pooling_head_adds_up_to_the_models_own_logit(kind, bias):
    m, x = _pooled(kind)
    assert model_facts(m).anatomy.pooled
    out = run(m, x)
    logits = out.logits if hasattr(out, "logits") else out
    for target in (0, 2):
        e = attnroll.explain(m, x, "decompx", target=target, bias=bias)
        total = e.full_row.double().sum(-1) + e.extra["bias_share"].double()
        torch.testing.assert_close(total, logits[:, target], atol=1e-5, rtol=0)
    carried = _carried_pooled(m, x, 2, bias)  # a second algorithm for the same numbers (separate: no backward)
    torch.testing.assert_close(carried[:, :-1], e.full_row.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(carried[:, -1], e.extra["bias_share"].double(), atol=1e-5, rtol=1e-5)


def _carried_pooled(m, x, target, bias, start=0):
    """Every token's shares carried through the blocks by the core kernels, pooled at CLS (row 0) and the
    patch mean as the anatomy says, then the head: (B, n + 1) shares of logit ``target``; ``start`` = the
    shares of the tokens entering that block (carried from there up)."""
    from attnroll.capture.value_path import record_states
    from attnroll.core.decompx import block_shares, head_shares, initial_shares, pool_shares

    rec, st, anat = record_states(m, x)
    S = initial_shares(st.inputs[start])
    for i, blk in enumerate(anat.blocks(F64)[start:], start):
        S = block_shares(S, rec.attentions[i], blk, bias=bias)
    B, n = S.shape[:2]
    pools = anat.pool_weights(n, torch.zeros(B, dtype=torch.long), F64)
    read = pool_shares(S, pools, token_norm=anat.token_norm_params(F64), bias=bias)
    return head_shares(read, bias=bias, classes=torch.full((B,), target), **anat.head(F64))


@pytest.mark.parametrize("kind", POOLED)
def test_decompx_shares_of_a_pooled_model_add_up_to_every_layer_output(kind):
    from attnroll.capture.value_path import record_states
    from attnroll.core.decompx import block_shares, initial_shares

    m, x = _pooled(kind)
    rec, st, anat = record_states(m, x)
    S = initial_shares(st.inputs[0])
    for i, blk in enumerate(anat.blocks(F64)):
        S = block_shares(S, rec.attentions[i], blk)
        torch.testing.assert_close(S.sum(2), st.outputs[i], atol=1e-9, rtol=0)


def test_decompx_refuses_a_head_it_cannot_decompose_naming_it():
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, depth=1, img_size=32,
                          patch_size=16, embed_dim=16, num_heads=2, global_pool="max")
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(UnsupportedModelError, match="global_pool='max'"):
        attnroll.explain(m, x, "decompx", readout="cls")


# ------------------------------------------------------------------------------------------- special tokens
def test_model_facts_give_the_end_of_sequence_id_generation_pads_with():
    gpt2 = R.build("gpt2")
    facts = model_facts(gpt2)
    assert (facts.pad_token_id, facts.eos_token_id) == (None, gpt2.config.eos_token_id)
    cfg = T.LlamaConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=12, eos_token_id=[7, 9], pad_token_id=None)
    assert model_facts(T.LlamaForCausalLM(cfg)).eos_token_id == 7  # a list of ids: the first one


@pytest.mark.parametrize("bias", ["absdot", "separate"])
def test_decompx_through_distilberts_pre_classifier_adds_up_to_its_logit(bias):
    m, x = build("distilbert")
    logits = run(m, x).logits
    e = attnroll.explain(m, x, "decompx", target=1, bias=bias)
    torch.testing.assert_close(e.full_row.double().sum(-1) + e.extra["bias_share"].double(), logits[:, 1],
                               atol=1e-5, rtol=0)


def test_distilbert_attention_shares_add_up_to_what_its_first_norm_reads():
    from attnroll.capture.value_path import record_states
    from attnroll.core.value_aware import head_mix, value_outputs

    m, x = build("distilbert")
    rec, st, anat = record_states(m, x)
    for i, blk in enumerate(anat.blocks(F64)):
        z = head_mix(rec.attentions[i], value_outputs(st.inputs[i], blk), st.inputs[i])
        torch.testing.assert_close(z.sum(2) + blk.bo, st.norm1_in[i], atol=1e-9, rtol=0)


def test_two_stacks_of_one_family_are_described_but_refused_by_the_value_aware_methods():
    class Towers(nn.Module):
        def __init__(self):
            super().__init__()
            self.left, self.right = R.build("bert").bert, R.build("bert", seed=1).bert

    anat = anatomy(Towers())
    assert [L.path for L in anat.layers] == [f"{s}.encoder.layer.{i}" for s in ("left", "right") for i in (0, 1)]
    assert "several stacks (left.encoder.layer, right.encoder.layer)" in anat.value_aware


def test_a_known_language_model_beside_an_unknown_vision_tower_is_refused_not_half_described():
    from .test_vlm import llava

    m = llava()
    # LLaVA's CLIP tower is a known family since the CLIP builder: the mix of two stacks is what is refused
    with pytest.raises(UnsupportedModelError, match=r"LlavaForConditionalGeneration mixes block families "
                                                    r"\(clip, llama\)"):
        anatomy(m)
    assert model_facts(m).anatomy is None
