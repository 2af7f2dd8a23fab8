"""tools/value_aware_validation/oracle_bound.py (diagnostics of the two shapes goals): the greedy deletion
oracle against brute force over every order, its perturbations against the library's deletion curves, the
IoU allowance against the library's top-k IoU, the per-image mix against enumeration and scipy's LP, the
exact McNemar test against scipy's binomial test."""
import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attnroll.evaluate import deletion
from attnroll.evaluate._common import image_forward, relevance_order
from attnroll.evaluate.localisation import topk_iou

_PATH = Path(__file__).resolve().parents[1] / "oracle_bound.py"
_spec = importlib.util.spec_from_file_location("oracle_bound", _PATH)
ob = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ob)


# ------------------------------------------------------------------------------------------ brute force
def _table_prob(tables):
    """prob_fn over a random table per image: the probability of every subset of removed units (as bits)."""
    U = tables.shape[1].bit_length() - 1
    weights = 2 ** torch.arange(U)

    def prob(ex, removed):
        return tables[ex, (removed.long() * weights).sum(1)]

    return prob


def _feasible(order, in_mask, allow):
    m = int(in_mask.sum())
    return sum(1 for u in order[:m] if not in_mask[u]) <= allow


def _in_window(order, base, width):
    """Every pick is among the first ``width`` not-yet-removed units of ``base`` (a naive loop)."""
    for t, u in enumerate(order):
        remaining = [v for v in base if v not in order[:t]]
        if u not in remaining[:width]:
            return False
    return True


def _brute_greedy(table, in_mask, allow, window=None):
    """The greedy order is the lexicographic minimum of the prefix-probability sequence over every allowed
    order (distinct probabilities): enumerate all U! orders."""
    U = len(in_mask)
    best = None
    for order in itertools.permutations(range(U)):
        if not _feasible(order, in_mask, allow) or (window and not _in_window(order, *window)):
            continue
        bits = np.cumsum([2 ** u for u in order])
        seq = tuple(float(table[b]) for b in bits)
        if best is None or seq < best[0]:
            best = (seq, order)
    return list(best[1])


@pytest.mark.parametrize("constrained", [False, True])
def test_greedy_matches_brute_force_over_all_orders(constrained):
    g = torch.Generator().manual_seed(3)
    U, B = 6, 4
    tables = torch.rand(B, 2 ** U, generator=g, dtype=torch.float64)
    in_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 1, 1], [0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 1, 0]],
                           dtype=torch.bool)
    allow = torch.tensor([0, 1, 0, 0]) if constrained else None
    orders, probs = ob.greedy_orders(_table_prob(tables), in_mask, allow, chunk=5)  # chunks split images
    for b in range(B):
        a = int(allow[b]) if constrained else U
        assert orders[b].tolist() == _brute_greedy(tables[b], in_mask[b], a)
        bits = np.concatenate([[0], np.cumsum([2 ** int(u) for u in orders[b]])])
        assert torch.equal(probs[b], tables[b, bits])
        assert _feasible(orders[b].tolist(), in_mask[b], a)
    if constrained:  # the constraint changed at least one order (else the test would not test it)
        free, _ = ob.greedy_orders(_table_prob(tables), in_mask, None)
        assert not torch.equal(free, orders)


def test_stop_freezes_an_image_on_its_last_query():
    g = torch.Generator().manual_seed(5)
    U, B = 6, 3
    tables = torch.rand(B, 2 ** U, generator=g, dtype=torch.float64)
    tables[:, 0] = 1.0  # the clean image is above stop; every removal is below it: frozen after step 0
    in_mask = torch.ones(B, U, dtype=torch.bool)
    orders, _ = ob.greedy_orders(_table_prob(tables), in_mask, stop=0.999999)
    for b in range(B):
        single = tables[b, 2 ** torch.arange(U)]  # the one query: each unit removed alone
        assert orders[b].tolist() == torch.argsort(single, stable=True).tolist()
    full, _ = ob.greedy_orders(_table_prob(tables), in_mask)
    assert not torch.equal(full, orders)  # without stop the later steps are re-queried


# ----------------------------------------------------------------------------------- the model's side
def _tiny_model():
    """A nonlinear callable classifier on 8 x 8 images of a 2 x 2 grid (4 patches of 4 x 4 pixels)."""
    g = torch.Generator().manual_seed(0)
    W1, W2 = torch.randn(3 * 64, 16, generator=g), torch.randn(16, 3, generator=g)
    return lambda x: torch.tanh(x.flatten(1) @ W1) @ W2


def test_greedy_on_a_model_matches_brute_force_with_the_library_deletion():
    model = _tiny_model()
    x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    fill = torch.full((3, 1, 1), -1.0).expand(3, 8, 8)
    target = model(x).argmax(1)
    prob = ob.make_prob_fn(image_forward(model), x, fill, target, grid=(2, 2))
    orders, probs = ob.greedy_orders(prob, torch.ones(3, 4, dtype=torch.bool))
    curves = deletion(model, x, ob.order_to_scores(orders), fill=fill, target=target.tolist(), grid=(2, 2)).curves
    assert np.allclose(curves, probs.numpy(), atol=1e-12)  # the oracle's copies are the benchmark's copies
    for b in range(3):  # brute force: the library's deletion curve of every one of the 24 orders
        seqs = {}
        for order in itertools.permutations(range(4)):
            s = ob.order_to_scores(torch.tensor([order]))
            seqs[order] = tuple(deletion(model, x[b:b + 1], s, fill=fill, target=[int(target[b])],
                                         grid=(2, 2)).curves[0, 1:].round(12))
        assert tuple(orders[b].tolist()) == min(seqs, key=seqs.get)


def test_order_to_scores_reproduces_the_order_in_every_metric():
    order = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(i)) for i in range(5)])
    assert torch.equal(relevance_order(ob.order_to_scores(order)), order)


def test_iou_allowance_is_the_largest_background_count_with_iou_at_least_070():
    for m in range(1, 64):
        U = 2 * m + 1
        mask = torch.zeros(1, U, dtype=torch.bool)
        mask[0, :m] = True
        ok = []
        for bg in range(m + 1):  # a map whose top m holds bg background patches (units m .. m + bg - 1)
            s = torch.zeros(1, U, dtype=torch.float64)
            s[0, : m - bg] = 2.0
            s[0, m: m + bg] = 1.0
            ok.append(topk_iou(s, mask)[0] >= 0.7)
        assert int(ob.iou_allowance(torch.tensor(m))) == max(bg for bg, v in enumerate(ok) if v)


# ------------------------------------------------------------------------------------------ the mix
def _brute_mix(ca, ia, cb, ib, level):
    """The exact 0/1 optimum over all 2^B choices (None when no choice reaches the level)."""
    best = None
    for pick in itertools.product([False, True], repeat=len(ca)):
        p = np.array(pick)
        if np.where(p, ib, ia).mean() >= level - 1e-12:
            c = np.where(p, cb, ca).mean()
            best = c if best is None else min(best, c)
    return best


def test_mix_is_feasible_and_between_the_lp_and_the_exact_optimum():
    from scipy.optimize import linprog

    rng = np.random.default_rng(0)
    gaps = 0
    for trial in range(40):
        B = 9
        ia, ib = rng.uniform(0.70, 0.9, B), rng.uniform(0.2, 0.75, B)  # a: constrained-like, b: free-like
        ca, cb = rng.uniform(0.05, 0.3, B), rng.uniform(0.0, 0.2, B)
        if trial % 4 == 0:  # some images where b is better on both (a free switch)
            ib[:2], cb[:2] = ia[:2] + 0.01, ca[:2] - 0.01
        level = 0.70 if trial % 2 else 0.6
        use_b, lp = ob.mix_for_iou(ca, ia, cb, ib, level)
        assert np.where(use_b, ib, ia).mean() >= level - 1e-12
        got, exact = np.where(use_b, cb, ca).mean(), _brute_mix(ca, ia, cb, ib, level)
        res = linprog(cb - ca, A_ub=[-(ib - ia)], b_ub=[ia.sum() - level * B], bounds=[(0, 1)] * B)
        assert res.status == 0
        assert lp == pytest.approx(ca.mean() + res.fun / B, abs=1e-9)  # the LP relaxation, independently
        assert lp <= exact + 1e-12 and exact <= got + 1e-12
        gaps += got > exact + 1e-12
    assert gaps < 40  # the 0/1 choice is usually the exact optimum


def test_mix_hand_worked_and_refusal():
    # image 0: b saves 0.1 for 0.2 IoU; image 1: b saves 0.1 for 0.05 IoU; slack at 0.70: 0.1
    use_b, lp = ob.mix_for_iou([0.2, 0.2], [0.75, 0.75], [0.1, 0.1], [0.55, 0.70])
    assert use_b.tolist() == [False, True]
    assert lp == pytest.approx((0.4 - 0.1 - 0.1 * 0.05 / 0.2) / 2)
    with pytest.raises(ValueError, match="level=0.7"):
        ob.mix_for_iou([0.2], [0.6], [0.1], [0.5])


def test_mcnemar_exact_against_scipy():
    from scipy.stats import binomtest

    for b, c in [(3, 3), (4, 2), (6, 0), (1, 0), (10, 2), (0, 7)]:
        want = binomtest(b, b + c, 0.5).pvalue
        assert ob.mcnemar_exact(b, c) == pytest.approx(want, rel=1e-12)
    assert ob.mcnemar_exact(0, 0) == 1.0


def test_prefix_then_keeps_the_greedy_picks_until_tau_then_follows_the_map():
    g = torch.Generator().manual_seed(7)
    B, U = 5, 7
    orders = torch.stack([torch.randperm(U, generator=g) for _ in range(B)])
    probs = torch.rand(B, U + 1, generator=g, dtype=torch.float64) * 0.5 + 0.4
    probs[0, 3] = 0.01  # below tau after 3 picks
    probs[1, 1] = 0.0  # after the first pick
    probs[2, U] = 0.05  # only at the last step; images 3, 4 never
    scores = torch.rand(B, U, generator=g, dtype=torch.float64)
    scores[4] = 1.0  # a constant map: ties by position
    got = ob.prefix_then(orders, probs, 0.1, scores)
    for b, r in enumerate([3, 1, U, U, U]):  # naive reference
        head = orders[b, :r].tolist()
        ranked = sorted(range(U), key=lambda u: (-float(scores[b, u]), u))
        assert got[b].tolist() == head + [u for u in ranked if u not in head]


@pytest.mark.parametrize("width", [1, 2, 3])
def test_windowed_greedy_matches_brute_force(width):
    g = torch.Generator().manual_seed(11)
    U, B = 6, 3
    tables = torch.rand(B, 2 ** U, generator=g, dtype=torch.float64)
    base = torch.stack([torch.randperm(U, generator=g) for _ in range(B)])
    in_mask = torch.ones(B, U, dtype=torch.bool)
    orders, _ = ob.greedy_orders(_table_prob(tables), in_mask, window=(base, width), chunk=4)
    for b in range(B):
        want = _brute_greedy(tables[b], in_mask[b], U, (base[b].tolist(), width))
        assert orders[b].tolist() == want
    if width == 1:  # a window of one is the map's own order
        assert torch.equal(orders, base)
