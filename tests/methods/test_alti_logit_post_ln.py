"""``alti_logit`` on post-LN encoders (BERT family, DistilBERT, RoBERTa) against an independent computation
from the weights: state_dict names (``value_aware_reference``), the model's own eager attention and hidden
states, every LayerNorm / MLP / pooler written as an explicit d×d (or d×f) Jacobian matrix and the per-layer
directions obtained by multiplying those matrices (not by the method's vector recursion); exactness against
the model's own logits; padding, targets and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll
from attnroll._checks import UnsupportedModelError

from . import value_aware_reference as R

T = pytest.importorskip("transformers")
RULES = ["linearised", "update"]


# ----------------------------------------------------------------------------------------- naive reference
def _naive_post_ln(S, xs, alphas, b, row, cls, rule):
    """(score (n,), per-layer Σ_j Δ^l_j (L,), embedding share, MLP terms) of example b for logit ``cls``."""
    hd = S["head"]
    Ls = S["layers"]
    fwd = [R.layer_forward(L, xs[l][b], alphas[l][b]) for l, L in enumerate(Ls)]  # (r1, out, h1, r2)
    top = fwd[-1][1][row]
    # the head: ω^L = J_poolerᵀ w_c with the tanh linearised at its actual pre-activation
    Wp, bp = hd["pooler"]
    zp = Wp @ top + bp
    omega_top = (np.diag(np.tanh(zp) / zp) @ Wp).T @ hd["W"][cls]
    # each block's linear part P^l (d, d) at the row, and the direction on a^l = x^l + Attn_l by products
    P, G2s = [], []
    for l, L in enumerate(Ls):
        r1, _, h1, r2 = (f[row] for f in fwd[l])
        G1, G2 = R.norm_matrix(L["ln1"], r1), R.norm_matrix(L["ln2"], r2)
        m = L["mlp"]
        M = m["W2"] @ np.diag(R.mlp_slopes(L, h1)) @ m["W1"]
        P.append(G2 @ ((np.eye(len(r1)) + M) if rule == "linearised" else np.eye(len(r1))) @ G1)
        G2s.append(G2)
    omegas, K = [None] * len(Ls), np.eye(len(top))
    for l in reversed(range(len(Ls))):
        after = K.T @ omega_top  # direction on the block's output x^{l+1}
        K = K @ P[l]
        omegas[l] = (K.T @ omega_top, after)
    Cs = [R.normalise(C) for C in R.matrices("alti", S, xs, alphas, b)]
    n = xs[0].shape[1]
    score, per_layer, mlp_terms, below = np.zeros(n), [], 0.0, np.eye(n)
    for l, L in enumerate(Ls):
        x, alpha = xs[l][b], alphas[l][b]
        delta = np.array([omegas[l][0] @ sum(alpha[h, row, j] * R.f_vec(L, h, x[j]) for h in range(len(L["heads"])))
                          for j in range(n)])
        score += delta @ below
        per_layer.append(delta.sum())
        below = Cs[l] @ below
        if rule == "update":
            mlp_terms += omegas[l][1] @ G2s[l] @ R.mlp(L, fwd[l][2][row])
    return score, np.array(per_layer), omegas[0][0] @ xs[0][b][row], mlp_terms


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("layers", [1, 3])
def test_post_ln_alti_logit_equals_the_naive_computation(rule, layers):
    m, x = R.build("bert", layers=layers), R.inputs_for("bert")
    S = R.spec(m, "bert")
    xs, alphas, logits = R.model_states(m, x)
    for b in range(2):  # the naive forward stands on the model: it reproduces its logits
        np.testing.assert_allclose(R.head_forward(S, R.layer_forward(S["layers"][-1], xs[-1][b], alphas[-1][b])[1][0]),
                                   logits[b], atol=1e-10)
    e = attnroll.explain(m, x, "alti_logit", target=[2, 1], mlp=rule)
    assert e.options["mlp"] == rule
    for b in range(2):
        score, per_layer, embed, mlp_terms = _naive_post_ln(S, xs, alphas, b, 0, e.target[b], rule)
        np.testing.assert_allclose(e.full_row[b].double().numpy(), score, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(e.extra["layer_logit"][b].numpy(), per_layer, atol=1e-9, rtol=1e-9)
        np.testing.assert_allclose(float(e.extra["embedding_logit"][b]), embed, atol=1e-9, rtol=1e-9)
        np.testing.assert_allclose(float(e.extra["mlp_logit"][b]), mlp_terms, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ["bert", "distilbert", "roberta", "electra"])
def test_post_ln_terms_add_up_to_the_models_logit(kind, rule):
    """Σ_l (per-layer logit updates) + the embedding's share + the bias terms + the MLP terms = the model's own
    target logit, float64, for every class (each term computed on its own, none as a remainder)."""
    m, x = R.build(kind), R.inputs_for("bert", n=6)
    with torch.no_grad():
        logits = m(**x).logits
    for c in range(3):
        e = attnroll.explain(m, x, "alti_logit", target=c, mlp=rule)
        ex = e.extra
        total = ex["layer_logit"].sum(-1) + ex["embedding_logit"] + ex["bias_logit"] + ex["mlp_logit"]
        assert torch.allclose(total, logits[:, c], atol=1e-10, rtol=0), (total, logits[:, c])
        torch.testing.assert_close(ex["direct_logit"], ex["layer_logit"].sum(-1))
        torch.testing.assert_close(e.full_row.double().sum(-1), ex["direct_logit"], atol=1e-6, rtol=1e-6)
        if rule == "linearised":
            assert torch.all(ex["mlp_logit"] == 0)
        else:
            assert float(ex["mlp_logit"].abs().min()) > 1e-3  # a real term, not a zero placeholder


@pytest.mark.parametrize("rule", RULES)
def test_padded_batch_equals_the_cropped_inputs(rule):
    m = R.build("bert", layers=3)
    ids = torch.tensor([[3, 7, 2, 9, 4, 6], [5, 8, 1, 11, 0, 0], [2, 4, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    both = attnroll.explain(m, {"input_ids": ids, "attention_mask": mask}, "alti_logit", target=[1, 2, 0], mlp=rule)
    for b, c in enumerate([1, 2, 0]):
        k = int(mask[b].sum())
        alone = attnroll.explain(m, {"input_ids": ids[b:b + 1, :k]}, "alti_logit", target=c, mlp=rule)
        torch.testing.assert_close(both.full_row[b, :k], alone.full_row[0], atol=1e-9, rtol=1e-9)
        assert torch.all(both.full_row[b, k:] == 0)
        for key in ("embedding_logit", "bias_logit", "mlp_logit", "direct_logit"):
            torch.testing.assert_close(both.extra[key][b], alone.extra[key][0], atol=1e-9, rtol=1e-9)


def test_target_changes_the_map_and_the_scores_are_linear_in_the_classifier_row():
    m, x = R.build("bert"), R.inputs_for("bert")
    rows = [attnroll.explain(m, x, "alti_logit", target=c).full_row.double() for c in range(3)]
    assert not torch.allclose(rows[0], rows[1], atol=1e-3) and not torch.allclose(rows[1], rows[2], atol=1e-3)
    W = m.classifier.weight.detach().clone()  # ω^L = J_poolerᵀ w_c is linear in w_c, and so is every Δ
    with torch.no_grad():
        m.classifier.weight[2] = W[0] + W[1]
    summed = attnroll.explain(m, x, "alti_logit", target=2).full_row.double()
    torch.testing.assert_close(summed, rows[0] + rows[1], atol=1e-6, rtol=1e-5)


def test_the_mlp_rule_changes_the_map_and_the_default_is_linearised():
    m, x = R.build("bert"), R.inputs_for("bert")
    d = attnroll.explain(m, x, "alti_logit", target=0)
    lin = attnroll.explain(m, x, "alti_logit", target=0, mlp="linearised")
    upd = attnroll.explain(m, x, "alti_logit", target=0, mlp="update")
    assert d.options["mlp"] == "linearised"
    torch.testing.assert_close(d.full_row, lin.full_row, atol=0, rtol=0)
    assert not torch.allclose(lin.full_row, upd.full_row, atol=1e-3)


def test_post_ln_refusals_name_the_reason():
    bert, x = R.build("bert"), R.inputs_for("bert")
    with pytest.raises(ValueError, match=r"mlp.*'linearised', 'update'.*'gelu'"):
        attnroll.explain(bert, x, "alti_logit", mlp="gelu")
    with pytest.raises(ValueError, match="not a callable"):
        attnroll.explain(bert, x, "alti_logit", target=lambda out: out.logits[:, 0])
    with pytest.raises(ValueError, match="end_layer"):
        attnroll.explain(bert, x, "alti_logit", end_layer=1)
    bare = R._randomise(T.BertModel(bert.config), 0)  # no classifier: nothing gives the target logit
    with pytest.raises(UnsupportedModelError, match="head"):
        attnroll.explain(bare, x, "alti_logit")


@pytest.mark.parametrize("method", ["alti_logit", "decompx"])
def test_a_readout_other_than_the_heads_row_is_refused_not_ignored(method):
    bert, x = R.build("bert"), R.inputs_for("bert")
    plain = attnroll.explain(bert, x, method, target=0)
    for ro in ("mean", "last", 2):
        with pytest.raises(ValueError, match=r"readout: .*row\(s\) \[0, 0\]"):
            attnroll.explain(bert, x, method, target=0, readout=ro)
    same = attnroll.explain(bert, x, method, target=0, readout="cls")  # the head's own row: accepted
    torch.testing.assert_close(same.full_row, plain.full_row, atol=0, rtol=0)
