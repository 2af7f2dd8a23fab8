"""Context attribution's "attn_grad": Σ over layers of mean over heads of (A ⊙ ∂y/∂A)^+ at the answer's
predicting rows, against an independent computation from eager attention weights and their autograd
gradients (y = the answer span's total log-probability)."""

from __future__ import annotations

import pytest
import torch

import attnroll

from .test_context import PROMPT, llama, word_tokenizer

T = pytest.importorskip("transformers")

ANSWER = "paris is capital"


def naive_attn_grad(model, tok, prompt, answer, layers=None):
    """(n_prompt,) Σ_t Σ_layers mean_h relu(A ⊙ dy/dA)[row_t] from output_attentions + retain_grad."""
    model.config._attn_implementation = "eager"
    p = tok(prompt, return_tensors="pt")["input_ids"]
    a = tok(answer, add_special_tokens=False)["input_ids"]
    ids = torch.cat([p, torch.tensor([a])], dim=1)
    rows = [p.shape[1] - 1 + t for t in range(len(a))]
    out = model(input_ids=ids, output_attentions=True)
    for att in out.attentions:
        att.retain_grad()
    logp = out.logits[0, rows].log_softmax(dim=-1)
    logp[torch.arange(len(a)), torch.tensor(a)].sum().backward()
    chosen = out.attentions if layers is None else [out.attentions[i] for i in layers]
    R = sum((att[0] * att.grad[0]).clamp(min=0).mean(dim=0)[rows] for att in chosen)
    return R.sum(dim=0)[: p.shape[1]].detach()


def test_attn_grad_matches_an_eager_autograd_computation():
    m, tok = llama(), word_tokenizer()
    ca = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, unit="token", method="attn_grad",
                                      sinks="keep")
    ref = naive_attn_grad(llama(), tok, PROMPT, ANSWER)
    assert float(ref.abs().max()) > 0
    torch.testing.assert_close(ca.token_scores, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-4)


def test_attn_grad_layer_range_and_sink_drop():
    m, tok = llama(), word_tokenizer()
    last = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, unit="token", method="attn_grad",
                                        sinks="keep", start_layer=1)
    ref = naive_attn_grad(llama(), tok, PROMPT, ANSWER, layers=[1])
    torch.testing.assert_close(last.token_scores, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-4)
    dropped = attnroll.context_attribution(m, tok, PROMPT, answer=ANSWER, unit="token", method="attn_grad")
    assert all(float(dropped.token_scores[s]) == 0.0 for s in dropped.sinks)
    assert abs(sum(u["share"] for u in dropped.units) - 1.0) < 1e-5


def test_attn_grad_refuses_rollout_options():
    with pytest.raises(ValueError, match="residual_mode"):
        attnroll.context_attribution(llama(), word_tokenizer(), PROMPT, answer=ANSWER, method="attn_grad",
                                     residual_mode="add")
