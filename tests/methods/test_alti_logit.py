"""``alti_logit`` against an independent naive computation from the weights (``value_aware_reference``:
state_dict names, the model's own eager attention, loops over tokens and heads), on tiny float64 pre-norm
models (ViT, GPT-2, Llama with RMSNorm and grouped KV); its refusals. Post-LN encoders (BERT family):
``test_alti_logit_post_ln.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll

from . import value_aware_reference as R

T = pytest.importorskip("transformers")
PRE = ["vit", "gpt2", "llama"]


def _naive(S, xs, alphas, b, row, cls):
    """(score (n,), Σ_l Σ_j Δ^l_j): Δ^l_j = w_c · g_f(Σ_h α^h_rj f^h(x̃_j)) with the final norm's share map
    at the actual final vector, carried down by the naive row-normalised ALTI matrices of the layers below."""
    hd = S["head"]
    final_vec = R.layer_forward(S["layers"][-1], xs[-1][b], alphas[-1][b])[1][row]

    def logit_of(v):
        return hd["W"][cls] @ (R.ln(v, hd["final"], actual=final_vec) if hd["final"] is not None else v)

    Cs = [R.normalise(C) for C in R.matrices("alti", S, xs, alphas, b)]
    n = xs[0].shape[1]
    score, total, below = np.zeros(n), 0.0, np.eye(n)
    for l, L in enumerate(S["layers"]):
        x, alpha = xs[l][b], alphas[l][b]
        delta = np.zeros(n)
        for j in range(n):
            xv = R.ln(x[j], L["ln1"])
            v = sum(alpha[h, row, j] * R.f_vec(L, h, xv) for h in range(len(L["heads"])))
            delta[j] = logit_of(v)
        score += delta @ below
        total += delta.sum()
        below = Cs[l] @ below
    return score, total


@pytest.mark.parametrize("kind", PRE)
def test_alti_logit_equals_the_naive_computation(kind):
    m, x = R.build(kind), R.inputs_for(kind)
    S = R.spec(m, kind)
    xs, alphas, _ = R.model_states(m, x)
    row = 0 if S["readout"] == "first" else xs[0].shape[1] - 1
    e = attnroll.explain(m, x, "alti_logit", target=[2, 1])
    for b in range(2):
        want, total = _naive(S, xs, alphas, b, row, e.target[b])
        np.testing.assert_allclose(e.full_row[b].double().numpy(), want, atol=1e-6, rtol=1e-6)
        assert abs(float(e.extra["direct_logit"][b]) - total) <= 1e-5 * max(1.0, abs(total))


def _naive_linearised(S, xs, alphas, b, row, cls):
    """(score (n,), per-layer Σ_j Δ^l_j) with mlp="linearised" on a pre-norm stack: the direction on the stream
    after block l's attention is ω^l = (J_l ⋯ J_{L−1})ᵀ G_fᵀ w_c, J_k = I + W2 diag(θ) W1 G2 the Jacobian matrix
    of block k's MLP branch plus its skip (slopes, gates and the norms' divisors at their actual values)."""
    hd, Ls = S["head"], S["layers"]
    fwd = [R.layer_forward(L, xs[l][b], alphas[l][b]) for l, L in enumerate(Ls)]
    top = fwd[-1][1][row]
    omega = R.norm_matrix(hd["final"], top).T @ hd["W"][cls]
    omegas = [None] * len(Ls)
    for l in reversed(range(len(Ls))):
        s_ = fwd[l][0][row]  # the stream after the attention sub-block
        m = Ls[l]["mlp"]
        J = np.eye(len(s_)) + m["W2"] @ np.diag(R.mlp_slopes(Ls[l], R.ln(s_, Ls[l]["ln2"]))) @ m["W1"] \
            @ R.norm_matrix(Ls[l]["ln2"], s_)
        omega = J.T @ omega
        omegas[l] = omega
    Cs = [R.normalise(C) for C in R.matrices("alti", S, xs, alphas, b)]
    n = xs[0].shape[1]
    score, per_layer, below = np.zeros(n), [], np.eye(n)
    for l, L in enumerate(Ls):
        x, alpha = xs[l][b], alphas[l][b]
        delta = np.array([omegas[l] @ sum(alpha[h, row, j] * R.f_vec(L, h, R.ln(x[j], L["ln1"]))
                                          for h in range(len(L["heads"]))) for j in range(n)])
        score += delta @ below
        per_layer.append(delta.sum())
        below = Cs[l] @ below
    return score, np.array(per_layer)


@pytest.mark.parametrize("kind", PRE)
def test_linearised_mlp_on_pre_norm_stacks_equals_the_naive_jacobian_products(kind):
    m, x = R.build(kind, layers=3), R.inputs_for(kind)
    S = R.spec(m, kind)
    xs, alphas, logits = R.model_states(m, x)
    row = 0 if S["readout"] == "first" else xs[0].shape[1] - 1
    e = attnroll.explain(m, x, "alti_logit", target=[2, 1], mlp="linearised")
    logits = logits[:, -1] if logits.ndim == 3 else logits
    tol = 1e-6 if kind == "llama" else 1e-9  # transformers' RMSNorm computes in float32
    for b in range(2):
        score, per_layer = _naive_linearised(S, xs, alphas, b, row, e.target[b])
        np.testing.assert_allclose(e.full_row[b].double().numpy(), score, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(e.extra["layer_logit"][b].numpy(), per_layer, atol=tol, rtol=tol)
    X = e.extra
    assert bool((X["mlp_logit"] == 0).all()) and e.options["mlp"] == "linearised"
    total = X["direct_logit"] + X["embedding_logit"] + X["bias_logit"]
    torch.testing.assert_close(total, torch.as_tensor(logits)[[0, 1], [2, 1]], atol=10 * tol, rtol=0)


def test_direct_logit_is_the_attention_updates_share_of_the_logit():
    """Σ_l (attention_l(r) − b_O) through the frozen final norm and the classifier row, from the model's own
    hidden states (no per-token split): what the scores of every token, CLS included, add up to."""
    m, x = R.build("vit"), R.inputs_for("vit")
    S = R.spec(m, "vit")
    xs, alphas, logits = R.model_states(m, x)
    e = attnroll.explain(m, x, "alti_logit")
    for b in range(2):
        final_vec = R.layer_forward(S["layers"][-1], xs[-1][b], alphas[-1][b])[1][0]
        upd = sum(R.attention_out(L, xs[l][b], alphas[l][b])[0] - L["bo"] for l, L in enumerate(S["layers"]))
        want = S["head"]["W"][e.target[b]] @ R.ln(upd, S["head"]["final"], actual=final_vec)
        np.testing.assert_allclose(float(e.extra["direct_logit"][b]), want, rtol=1e-5)
        np.testing.assert_allclose(float(e.full_row[b].double().sum()), want, rtol=1e-5)
        assert e.target[b] == int(np.argmax(logits[b]))


@pytest.mark.parametrize("kind", PRE)
def test_the_terms_add_up_to_the_models_logit(kind):
    """direct_logit + the embedding's share ω · x^0_r + the MLP updates' ω · MLP_l(r) + the biases (b_O, the final
    norm's β, the classifier's bias) = the model's own target logit (llama: transformers' RMSNorm in float32)."""
    m, x = R.build(kind), R.inputs_for(kind)
    with torch.no_grad():
        logits = (m(**x) if isinstance(x, dict) else m(x)).logits
    logits = logits[:, -1] if logits.ndim == 3 else logits
    e = attnroll.explain(m, x, "alti_logit", target=[2, 1])
    X = e.extra
    total = X["direct_logit"] + X["embedding_logit"] + X["bias_logit"] + X["mlp_logit"]
    torch.testing.assert_close(total, logits[[0, 1], [2, 1]], atol=1e-6 if kind == "llama" else 1e-12, rtol=0)
    assert float(X["mlp_logit"].abs().min()) > 1e-3 and e.options["mlp"] == "update"


def test_alti_logit_is_class_specific_and_linear_in_the_classifier_row():
    m, x = R.build("vit"), R.inputs_for("vit")
    rows = [attnroll.explain(m, x, "alti_logit", target=c).full_row.double() for c in range(3)]
    assert not torch.allclose(rows[0], rows[1])
    W = m.classifier.weight.detach().clone()  # a class whose row is the sum of two others' rows: scores add
    with torch.no_grad():
        m.classifier.weight[2] = W[0] + W[1]
    summed = attnroll.explain(m, x, "alti_logit", target=2).full_row.double()
    torch.testing.assert_close(summed, rows[0] + rows[1], atol=1e-6, rtol=1e-5)  # float32 scores


def test_padding_neither_gives_nor_receives():
    m = R.build("gpt2")
    ids = torch.tensor([[3, 7, 2, 9, 4], [5, 8, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    both = attnroll.explain(m, {"input_ids": ids, "attention_mask": mask}, "alti_logit", target=[4, 4])
    alone = attnroll.explain(m, {"input_ids": ids[1:, :3]}, "alti_logit", target=4)
    torch.testing.assert_close(both.full_row[1, :3], alone.full_row[0], atol=1e-9, rtol=1e-9)
    assert torch.all(both.full_row[1, 3:] == 0)


def test_refusals_name_the_reason():
    """(Heads that pool rows: ``test_alti_logit_pooled.py``.)"""
    vit, x = R.build("vit"), R.inputs_for("vit")
    with pytest.raises(ValueError, match="not a callable"):
        attnroll.explain(vit, x, "alti_logit", target=lambda out: out.logits[:, 0])
    with pytest.raises(ValueError, match="start_layer"):
        attnroll.explain(vit, x, "alti_logit", start_layer=1)
    with pytest.raises(ValueError, match="dtype"):
        attnroll.explain(vit, x, "alti_logit", dtype="int8")
