"""DiffLlama's differential attention (Ye et al., ICLR 2025): the record holds, per head pair, the signed matrix
D = softmax₁ − λ·softmax₂ that multiplies the values. Checked against the model's own computation on a tiny
float64 random-weight model: D from transformers' own returned softmax maps and λ recomputed here from the
parameters, and D times the values (read from the model's own v_proj on its actual input) through the per-pair
group norm and (1 − λ_init) equal to what the model feeds its o_proj."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

import attnroll
from attnroll._checks import UnsupportedModelError

T = pytest.importorskip("transformers")
H, K, D_HEAD = 4, 2, 8


@functools.lru_cache(maxsize=None)
def _built() -> torch.nn.Module:
    cfg = T.DiffLlamaConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=H,
                            num_key_value_heads=K, head_dim=D_HEAD, intermediate_size=24, max_position_embeddings=32,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    m = T.DiffLlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():  # λ vectors of a size that makes λ differ between layers and from 0
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) + (1.0 if name.endswith("norm.weight")
                                                                              else 0.0))
    return m.double().eval()


def _model() -> torch.nn.Module:
    return copy.deepcopy(_built())


def _inputs() -> dict:
    ids = torch.randint(1, 30, (2, 6), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])}


def _model_states(m: torch.nn.Module, x: dict) -> tuple[list, list, list, torch.Tensor]:
    """Without attnroll: each attention module's input, what its o_proj reads, transformers' own returned
    softmax maps (output_attentions=True), and the logits."""
    inputs, o_in, hooks = [], [], []
    for layer in m.model.layers:
        att = layer.self_attn
        hooks.append(att.register_forward_pre_hook(lambda mod, a, k: inputs.append(k["hidden_states"]),
                                                   with_kwargs=True))
        hooks.append(att.o_proj.register_forward_pre_hook(lambda mod, a: o_in.append(a[0])))
    with torch.no_grad():
        out = m(**x, output_attentions=True)
    for h in hooks:
        h.remove()
    return inputs, o_in, list(out.attentions), out.logits


def _lambda(att: torch.nn.Module, layer: int) -> float:
    init = 0.8 - 0.6 * math.exp(-0.3 * layer)  # the paper's λ_init schedule, as transformers' DiffLlama
    assert att.lambda_init == pytest.approx(init)
    q1, k1, q2, k2 = (getattr(att, f"lambda_{n}").detach() for n in ("q1", "k1", "q2", "k2"))
    return math.exp(float((q1 * k1).sum())) - math.exp(float((q2 * k2).sum())) + init


def test_the_record_is_softmax1_minus_lambda_softmax2_per_head_pair():
    m, x = _model(), _inputs()
    _, _, soft, _ = _model_states(m, x)
    rec = attnroll.capture(m, x)
    assert len(rec.attentions) == 2
    for l, (got, A) in enumerate(zip(rec.attentions, soft)):
        lam = _lambda(m.model.layers[l].self_attn, l)
        assert got.shape == (2, H // 2, 6, 6)
        # (the model sums λ's dot products in float32: ~1e-7 from this float64 λ)
        torch.testing.assert_close(got, A[:, :H // 2] - lam * A[:, H // 2:], atol=1e-6, rtol=0)
        torch.testing.assert_close(got.sum(-1), torch.full((2, H // 2, 6), 1 - lam, dtype=got.dtype), atol=1e-6,
                                   rtol=0)  # rows sum to 1 − λ: not probabilities


def test_the_matrix_times_the_values_is_what_o_proj_reads():
    m, x = _model(), _inputs()
    h_in, o_in, _, _ = _model_states(m, x)
    rec = attnroll.capture(m, x)
    for l, Dm in enumerate(rec.attentions):
        att = m.model.layers[l].self_attn
        v = att.v_proj(h_in[l]).detach().view(2, 6, K, D_HEAD)  # (B, n, K, d) from the model's own projection
        want = o_in[l].view(2, 6, H // 2, 2 * D_HEAD)
        for p in range(H // 2):
            a = p // (H // K)  # pair p reads kv heads a and a + K/2 (the model's two value halves)
            vp = torch.cat([v[:, :, a], v[:, :, a + K // 2]], dim=-1)  # (B, n, 2d)
            mixed = Dm[:, p] @ vp
            normed = mixed / mixed.pow(2).mean(-1, keepdim=True).add(att.groupnorm.eps or 1e-6).sqrt()
            torch.testing.assert_close((1 - att.lambda_init) * normed, want[:, :, p], atol=1e-5, rtol=0)


def test_the_capture_leaves_the_model_and_its_outputs_as_they_were():
    m, x = _model(), _inputs()
    *_, logits = _model_states(m, x)
    rec = attnroll.capture(m, x)
    torch.testing.assert_close(rec.outputs.logits, logits, atol=1e-10, rtol=0)
    assert all("forward" not in layer.self_attn.__dict__ for layer in m.model.layers)  # the switch was undone
    info = rec.info["self"]
    assert info.nonstochastic == (0, 1) and "softmax₁ − λ·softmax₂" in info.stochastic_reason


@pytest.mark.parametrize("method", ["raw", "grad_rollout", "gae"])
def test_the_methods_that_read_signed_matrices_explain_it(method):
    m, x = _model(), _inputs()
    e = attnroll.explain(m, x, method)
    assert torch.isfinite(e.full_row).all()
    assert float(e.full_row[1, 4:].abs().max()) == 0  # nothing on padding
    if method == "raw":  # the explained row of the head-pair mean of D
        rec = attnroll.capture(m, x)
        want = rec.attentions[-1].mean(1)[torch.arange(2), torch.tensor([5, 3])]
        torch.testing.assert_close(e.full_row.double(), want, atol=1e-6, rtol=0)


def test_gradients_reach_the_recorded_matrices():
    # the record is the tensor the output is computed from (the gradient methods read ∂y/∂D)
    m, x = _model(), {"input_ids": _inputs()["input_ids"][:1]}
    rec = attnroll.capture(m, x, keep_grad=True)
    D = rec.attentions[0]  # autograd raises if the output was not computed from it
    (g,) = torch.autograd.grad(rec.outputs.logits[0, -1, 3], D)
    assert float(g.abs().max()) > 0


@pytest.mark.parametrize("method,match", [
    ("rollout", "hold no attention probabilities: differential attention"),
    ("per_head_rollout", "hold no attention probabilities: differential attention"),
    ("flow", "differential attention"),
])
def test_methods_needing_probabilities_refuse_naming_the_reason(method, match):
    with pytest.raises(ValueError, match=match):
        attnroll.explain(_model(), _inputs(), method)


@pytest.mark.parametrize("method", ["alti", "decompx", "norm", "value_zeroing", "measured_rollout"])
def test_the_value_aware_methods_refuse_naming_differential_attention(method):
    with pytest.raises(UnsupportedModelError, match="differential attention: each head pair mixes its values"):
        attnroll.explain(_model(), _inputs(), method)


def test_the_matrix_free_route_is_refused_naming_why():
    with pytest.raises(ValueError, match="attention='recompute' cannot be used .*differential attention"):
        attnroll.explain(_model(), _inputs(), "raw", attention="recompute")


@pytest.mark.parametrize("method", ["raw", "gae"])
def test_each_example_of_a_padded_batch_reads_as_when_alone(method):
    m, x = _model(), _inputs()
    e = attnroll.explain(m, x, method, target=1)
    for b, keep in ((0, 6), (1, 4)):
        alone = attnroll.explain(m, {k: v[b:b + 1, :keep] for k, v in x.items()}, method, target=1)
        torch.testing.assert_close(e.full_row[b, :keep], alone.full_row[0], atol=1e-5, rtol=1e-4)
