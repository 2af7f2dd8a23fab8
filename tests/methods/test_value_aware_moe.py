"""The value-aware methods through mixture-of-experts MLPs (Mixtral, Qwen2-MoE with its gated shared expert,
Qwen3-MoE with a dense first layer, OLMoE, GPT-OSS with its clamped experts and biases), on tiny float64
random-weight models: the MLP is the routing-weighted sum of the chosen experts, the routing held at what the
forward pass chose. Every decomposition is checked against the model's own states (each layer's output, each
MoE module's output, the logits), never against attnroll's own arithmetic alone."""

from __future__ import annotations

import functools

import pytest
import torch

import attnroll
from attnroll._checks import UnsupportedModelError
from attnroll.capture.value_path import anatomy, record_states
from attnroll.core.decompx import block_shares, head_shares, initial_shares, mlp_shares, separate_bias_shares
from attnroll.core.residual_share import block_parts
from attnroll.core.value_aware import Routed, apply_norm

from . import value_aware_reference as R

# Tiny multi-part models (VLMs, hybrids, token mixers, mixtures of experts): left out of `make test-fast`.
pytestmark = pytest.mark.slow

T = pytest.importorskip("transformers")
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3"]
#: the families whose first layer is dense (one routed layer of two)
_ONE_ROUTED = ("qwen3_moe", "deepseek_v2", "deepseek_v3")
#: float64 models, but transformers' RMSNorm normalises in float32 (errors ~1e-7 of the vectors' size).
_TOL = 1e-6


@functools.lru_cache(maxsize=None)
def _built(kind: str) -> torch.nn.Module:
    base = dict(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                attn_implementation="eager", experts_implementation="eager")
    if kind == "mixtral":
        m = T.MixtralForCausalLM(T.MixtralConfig(**base, intermediate_size=12, num_local_experts=4,
                                                 num_experts_per_tok=2))
    elif kind == "qwen2_moe":  # a shared expert scaled by sigmoid(shared_expert_gate(h))
        m = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **base, intermediate_size=12, moe_intermediate_size=10, shared_expert_intermediate_size=14,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1))
    elif kind == "qwen3_moe":  # layer 0 dense, layer 1 routed: one stack of one block kind
        m = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **base, intermediate_size=12, moe_intermediate_size=10, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[0]))
    elif kind == "olmoe":
        m = T.OlmoeForCausalLM(T.OlmoeConfig(**base, intermediate_size=12, num_experts=4, num_experts_per_tok=2))
    elif kind.startswith("deepseek"):  # multi-head latent attention, a dense first layer, a shared expert
        version = "DeepseekV2" if kind == "deepseek_v2" else "DeepseekV3"
        cfg = getattr(T, f"{version}Config")(
            **{**base, "num_key_value_heads": 4}, intermediate_size=12, moe_intermediate_size=8, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=6, first_k_dense_replace=1, n_shared_experts=1)
        m = getattr(T, f"{version}ForCausalLM")(cfg)
    else:  # GPT-OSS: interleaved gate / up with biases; a low clamp limit so that the clamps act
        m = T.GptOssForCausalLM(T.GptOssConfig(**base, intermediate_size=12, num_local_experts=4,
                                               num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.5))
    m = R._randomise(m, 0)
    if kind == "gpt_oss":  # its attention sinks pushed out of the rows: the dense capture reads softmax rows
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.fill_(-30.0)
    return m


def _model(kind: str) -> torch.nn.Module:
    import copy

    return copy.deepcopy(_built(kind))


def _inputs(pad: bool = False) -> dict:
    ids = torch.randint(1, 30, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if pad:
        mask[1, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _moe_outputs(m: torch.nn.Module, x: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each MoE module's actual (input, output), read by hooks on the model's own modules."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(m.model.layers):
        if hasattr(layer.mlp, "experts"):
            hooks.append(layer.mlp.register_forward_hook(
                lambda mod, a, o, i=i: seen.__setitem__(i, (a[0].detach(), (o[0] if isinstance(o, tuple) else o)))))
    with torch.no_grad():
        m(**x)
    for h in hooks:
        h.remove()
    return seen


def _scale(t: torch.Tensor) -> float:
    return max(1.0, float(t.abs().max()))


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_anatomy_describes_every_expert(kind):
    anat = anatomy(_model(kind))
    routed = [layer for layer in anat.layers if layer.experts is not None]
    assert anat.family == "llama" and len(routed) == (1 if kind in _ONE_ROUTED else 2)
    assert all(len(layer.experts.routed) == 4 for layer in routed)
    shared = 1 if kind == "qwen2_moe" or kind.startswith("deepseek") else 0
    assert all(len(layer.experts.shared) == shared for layer in routed)
    assert all((layer.latent is not None) == kind.startswith("deepseek") for layer in anat.layers)


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_routed_mlp_equals_each_moe_modules_own_output(kind):
    m, x = _model(kind), _inputs()
    rec, st, anat = record_states(m, x)
    actual = _moe_outputs(m, x)
    assert sorted(actual) == [layer.index for layer in anat.layers if layer.experts is not None]
    for i, blk in enumerate(anat.blocks(torch.float64, st.routing)):
        if i not in actual:
            assert not isinstance(blk.mlp, Routed) and st.routing[i] is None
            continue
        h_in, out = actual[i]
        h = apply_norm(st.norm2_in[i], blk.norm2)
        torch.testing.assert_close(h, h_in, atol=_TOL * _scale(h), rtol=0)
        one = h.unsqueeze(2)  # one share per row: the MLP of the actual input, through the per-expert shares
        got = mlp_shares(one, blk.mlp, "separate").squeeze(2)
        torch.testing.assert_close(got, out, atol=_TOL * _scale(out), rtol=0)
        chosen = (st.routing[i][..., :4] != 0).sum(-1)
        assert bool((chosen == 2).all()), "two routed experts per token (top-2)"


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("bias", ["absdot", "separate"])
def test_decompx_shares_add_up_to_every_layer_output(kind, bias):
    m = _model(kind)
    rec, st, anat = record_states(m, _inputs())
    S = initial_shares(st.inputs[0])
    for i, blk in enumerate(anat.blocks(torch.float64, st.routing)):
        S = block_shares(S, rec.attentions[i], blk, bias=bias, chunk=2)  # rows in chunks: routing sliced too
        torch.testing.assert_close(S.sum(2), st.outputs[i], atol=_TOL * _scale(st.outputs[i]), rtol=0)


@pytest.mark.parametrize("kind", FAMILIES)
def test_decompx_fast_path_equals_the_carried_shares_and_the_logit(kind):
    m, x = _model(kind), _inputs()
    rec, st, anat = record_states(m, x)
    blocks, head = anat.blocks(torch.float64, st.routing), anat.head(torch.float64)
    S = initial_shares(st.inputs[0])
    for i, blk in enumerate(blocks):
        S = block_shares(S, rec.attentions[i], blk, bias="separate")
    n = S.shape[1]
    pos, classes = torch.tensor([n - 1, n - 1]), torch.tensor([1, 2])
    carried = head_shares(S[torch.arange(2), pos], bias="separate", classes=classes, **head)
    tok, y = separate_bias_shares(st.inputs[0], list(rec.attentions), blocks, positions=pos, classes=classes,
                                  **head)
    torch.testing.assert_close(tok, carried[:, :-1], atol=1e-9, rtol=1e-9)
    with torch.no_grad():
        logits = m(**x).logits[torch.arange(2), pos, classes]
    torch.testing.assert_close(y, logits, atol=_TOL * _scale(logits), rtol=0)


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("bias", ["separate", "absdot"])
def test_decompx_adds_up_to_the_logit_of_a_padded_batch(kind, bias):
    m, x = _model(kind), _inputs(pad=True)
    e = attnroll.explain(m, x, "decompx", target=1, bias=bias)
    with torch.no_grad():
        logits = m(**x).logits
    want = torch.stack([logits[0, 5, 1], logits[1, 3, 1]])  # each example's last real token
    total = e.full_row.double().sum(-1) + e.extra["bias_share"].double()
    torch.testing.assert_close(total, want, atol=1e-5 * _scale(want), rtol=0)
    alone = attnroll.explain(m, {k: v[1:, :4] for k, v in x.items()}, "decompx", target=1, bias=bias)
    torch.testing.assert_close(e.full_row[1, :4], alone.full_row[0], atol=1e-5 * _scale(want), rtol=0)
    assert float(e.full_row[1, 4:].abs().max()) == 0


@pytest.mark.parametrize("kind", FAMILIES)
def test_measured_parts_add_up_to_every_layer_output(kind):
    rec, st, anat = record_states(_model(kind), _inputs())
    for i, blk in enumerate(anat.blocks(torch.float64, st.routing)):
        x = st.inputs[i]
        mixed = st.norm2_in[i] - x - (0 if blk.bo is None else blk.bo)
        parts = block_parts(x, mixed, blk.bo, blk)
        torch.testing.assert_close(parts.sum(2), st.outputs[i], atol=_TOL * _scale(st.outputs[i]), rtol=0)


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("rule", ["update", "linearised"])
def test_alti_logit_terms_add_up_to_the_logit(kind, rule):
    m, x = _model(kind), _inputs()
    e = attnroll.explain(m, x, "alti_logit", target=1, mlp=rule)
    with torch.no_grad():
        want = m(**x).logits[:, -1, 1]
    total = sum(e.extra[k].double() for k in ("direct_logit", "embedding_logit", "bias_logit", "mlp_logit"))
    torch.testing.assert_close(total, want, atol=1e-5 * _scale(want), rtol=0)
    if rule == "linearised":
        assert float(e.extra["mlp_logit"].abs().max()) == 0


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_rolled_value_aware_methods_run_and_keep_their_rows(kind):
    m, x = _model(kind), _inputs(pad=True)
    for method in ("norm", "norm_rollout", "globenc", "alti", "value_zeroing", "measured_rollout"):
        e = attnroll.explain(m, x, method)
        assert torch.isfinite(e.full_row).all(), method
        assert float(e.full_row[1, 4:].abs().max()) == 0, method  # nothing on padding
        if method != "norm":
            torch.testing.assert_close(e.full_row.double().sum(-1), torch.ones(2, dtype=torch.float64),
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_value_zeroings_block_rerun_reproduces_the_layer_output(kind):
    # the MoE module re-run on the actual input (nothing zeroed) must give the layer's actual output
    m = _model(kind)
    rec, st, anat = record_states(m, _inputs())
    for i, layer in enumerate(anat.layers):
        attn = st.norm2_in[i] - st.inputs[i]
        with torch.no_grad():
            got = layer.finish(st.inputs[i].unsqueeze(1), attn.unsqueeze(1)).squeeze(1)  # 4-D, as value zeroing
        torch.testing.assert_close(got, st.outputs[i], atol=_TOL * _scale(got), rtol=0)


def test_experts_that_compute_something_else_are_refused():
    m = _model("mixtral")
    ex = m.model.layers[0].mlp.experts
    original = ex.forward

    def swapped(hidden, idx, w):  # gate and up halves exchanged: not what the stored rows say
        with torch.no_grad():
            ex.gate_up_proj.copy_(torch.cat(ex.gate_up_proj.chunk(2, dim=1)[::-1], dim=1))
        try:
            return original(hidden, idx, w)
        finally:
            with torch.no_grad():
                ex.gate_up_proj.copy_(torch.cat(ex.gate_up_proj.chunk(2, dim=1)[::-1], dim=1))

    ex.forward = swapped
    with pytest.raises(UnsupportedModelError, match="does not compute the experts its weights describe"):
        anatomy(m)


def test_sanity_redraws_every_expert_and_the_router():
    from attnroll.capture.anatomy import component_parameters

    layer = _model("qwen2_moe").model.layers[0]
    names = {n for n, _, _ in component_parameters(layer, "mlp")}
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight",
            "mlp.shared_expert_gate.weight", "mlp.shared_expert.up_proj.weight"} <= names


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_latent_value_vectors_are_the_models_own(kind):
    # multi-head latent attention: f^h(x_j) from the anatomy's arrays equals the model's own value states
    # (kv_b_proj of the normed latent, read by hooks) times its o_proj slice
    from attnroll.core.value_aware import value_outputs

    m, x = _model(kind), _inputs()
    rec, st, anat = record_states(m, x)
    seen = []
    hook = m.model.layers[0].self_attn.kv_b_proj.register_forward_hook(lambda mod, a, o: seen.append(o.detach()))
    with torch.no_grad():
        m(**x)
    hook.remove()
    blk = anat.blocks(torch.float64, st.routing)[0]
    F = value_outputs(apply_norm(st.inputs[0], blk.norm1), blk)  # (B, n, H, d)
    v = seen[0].view(2, 6, 4, 4 + 6)[..., 4:]  # per head: 4 key rows, then 6 value rows
    wo = m.model.layers[0].self_attn.o_proj.weight.view(16, 4, 6)
    want = torch.einsum("bnhe,dhe->bnhd", v, wo)
    torch.testing.assert_close(F, want, atol=_TOL * _scale(want), rtol=0)


def test_sanity_redraws_every_heads_latent_value_rows():
    # the value rows of kv_b_proj are one tensor index per head (not a slice): the re-draw must reach them
    from attnroll.capture.anatomy import component_parameters
    from attnroll.evaluate.sanity import _reinitialise

    layer = _model("deepseek_v3").model.layers[0]
    w = layer.self_attn.kv_b_proj.weight
    before = w.detach().clone()
    _reinitialise(component_parameters(layer, "value"), torch.Generator().manual_seed(0))
    changed = (w.detach() != before).any(-1).view(4, 4 + 6)  # per head: 4 key rows, 6 value rows
    assert bool(changed[:, 4:].all()) and not bool(changed[:, :4].any())
