"""tools/value_aware_validation/attnlrp_paired.py (AttnLRP paired with attnroll's maps): its own logic, without lxt (never imported here):
the paired differences against scipy's paired t statistic, the exact McNemar test against a binomial sum
written here, and the per-instance patching / relevance read-out against autograd on an unpatched tiny ViT
(with plain, non-LRP forwards put in the rules' places)."""
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F

from attnroll.models.shapes import build_model, shapes_config

_PATH = Path(__file__).resolve().parents[1] / "attnlrp_paired.py"
_spec = importlib.util.spec_from_file_location("attnlrp_paired", _PATH)
ap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ap)


# ------------------------------------------------------------------------------------------ paired, McNemar
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paired_matches_scipy(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=40)
    b = a + rng.normal(0.3, 0.5, size=40)
    a[[3, 17]] = np.nan  # mass is NaN where a map has no positive relevance
    b[[17, 30]] = np.nan
    r = ap.paired(a, b)
    both = ~np.isnan(a) & ~np.isnan(b)
    t = scipy.stats.ttest_rel(b, a, nan_policy="omit")
    assert r["n"] == both.sum() == 37
    assert r["diff"] == pytest.approx(np.mean(b[both] - a[both]), rel=1e-12)
    assert r["diff_se"] == pytest.approx(r["diff"] / t.statistic, rel=1e-10)
    assert r["ref"] == pytest.approx(np.nanmean(a)) and r["cand"] == pytest.approx(np.nanmean(b))
    assert r["ref_se"] == pytest.approx(scipy.stats.sem(a, nan_policy="omit"), rel=1e-12)
    assert r["cand_se"] == pytest.approx(scipy.stats.sem(b, nan_policy="omit"), rel=1e-12)
    assert (r["ref_n"], r["cand_n"]) == (38, 38)


def test_paired_rejects_bad_input():
    with pytest.raises(ValueError, match="one length"):
        ap.paired(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="fewer than 2"):
        ap.paired(np.array([1.0, np.nan]), np.array([np.nan, 2.0]))


def _mcnemar_by_hand(ref, cand):
    b = sum(1 for r, c in zip(ref, cand) if c and not r)
    c = sum(1 for r, c_ in zip(ref, cand) if r and not c_)
    n = b + c
    if n == 0:
        return b, c, 1.0
    k = min(b, c)
    return b, c, min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


@pytest.mark.parametrize("seed", range(6))
def test_mcnemar_matches_a_binomial_sum(seed):
    rng = np.random.default_rng(seed)
    ref = rng.random(60) < 0.9
    cand = np.where(rng.random(60) < 0.15, ~ref, ref)
    b, c, p = ap.mcnemar(ref.astype(float), cand.astype(float))
    hb, hc, hp = _mcnemar_by_hand(ref, cand)
    assert (b, c) == (hb, hc)
    assert p == pytest.approx(hp, rel=1e-9)


def test_mcnemar_worked_examples():
    ref = np.array([1, 1, 1, 1, 1, 1, 0, 0])
    assert ap.mcnemar(ref, np.zeros(8)) == (0, 6, pytest.approx(2 / 64))  # 2 * (1/2)^6
    assert ap.mcnemar(ref, ref) == (0, 0, 1.0)
    assert ap.mcnemar(np.zeros(8), ref)[:2] == (6, 0)  # b counts the candidate's extra hits
    with pytest.raises(ValueError, match="0/1"):
        ap.mcnemar(np.array([0, 2]), np.array([0, 1]))


# ------------------------------------------------------------------------------------------ patching plumbing
def _tiny():
    torch.manual_seed(0)
    m = build_model(shapes_config(hidden_size=16, num_layers=2, num_heads=2)).eval()
    x = torch.randn(5, 3, 64, 64)
    return m, x


def _plain_ln(self, x):  # torch's own layer norm: no rule, the unpatched function
    return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def _plain_act(self, x):
    return self.original_forward(x)


def test_plain_forwards_give_gradient_times_input_at_the_embeddings():
    m, x = _tiny()
    with torch.no_grad():
        before = m(pixel_values=x).logits
    target = before.argmax(1)
    p = ap.patch_vit(m, layer_norm=_plain_ln, act=_plain_act, qkv=None)
    R = ap.token_relevance(p, x, target, chunk=2)
    # independent: autograd on the unpatched model (float64 copy), at the embeddings' output
    ref = m.double()
    store = {}
    h = ref.vit.embeddings.register_forward_hook(lambda mod, i, o: store.__setitem__("e", o))
    logits = ref(pixel_values=x.double()).logits
    h.remove()
    y = logits.gather(1, target[:, None])[:, 0]
    g, = torch.autograd.grad(y.sum(), store["e"])
    want = (store["e"] * g).sum(-1).detach()
    assert R["emb"].shape == (5, 65) and R["proj"].shape == (5, 64)
    torch.testing.assert_close(R["emb"], want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(R["y"], y.detach(), rtol=1e-12, atol=1e-12)
    # the projection's relevance: the embeddings' patch tokens minus the position embeddings' share
    pos = ref.vit.embeddings.position_embeddings[0, 1:].detach()
    torch.testing.assert_close(R["proj"], want[:, 1:] - (pos * g[:, 1:]).sum(-1), rtol=1e-9, atol=1e-10)
    m.float()
    with torch.no_grad():  # the model given is not patched
        torch.testing.assert_close(m(pixel_values=x).logits, before)


def test_qkv_functions_reach_every_block():
    m, x = _tiny()
    target = torch.zeros(5, dtype=torch.long)
    p = ap.patch_vit(m, layer_norm=_plain_ln, act=_plain_act, qkv=lambda n: (lambda o: 2 * o) if n == "v" else (lambda o: o))
    got = ap.token_relevance(p, x, target)["logits"]
    # independent: every block's value projection doubled in the weights
    ref = m.double()
    with torch.no_grad():
        for layer in ref.vit.layers:
            layer.attention.v_proj.weight.mul_(2)
            layer.attention.v_proj.bias.mul_(2)
        want = ref(pixel_values=x.double()).logits
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
