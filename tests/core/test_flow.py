"""Attention flow: against networkx's float max flow, properties, batching, padding, validation.

networkx (dev extra) is the independent reference: its preflow-push works on the real capacities directly,
so it shares nothing with attnroll's integer-scaled scipy solver or its certificates.
"""

from __future__ import annotations


import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy.sparse import csr_array
from scipy.sparse.csgraph import maximum_flow

import attnroll
from attnroll import attention_flow, rollout
from attnroll import _system as system_mod
from attnroll.core import flow as flow_mod
from attnroll.core.rollout import augmented_layers


# ----------------------------------------------------------------------------------------------- helpers
def softmax_layers(L, B, H, n, seed=0, sharp=1.0, zeros=0.0, sinks=0):
    """L per-head attention layers (B, H, n, n), rows summing to 1. ``zeros``: fraction of exact zeros;
    ``sinks``: that many "attention sink" columns get a large bonus, as real models put most of their
    attention on a few tokens (this is what gives non-trivial minimum cuts)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(L):
        logits = sharp * rng.normal(size=(B, H, n, n))
        if sinks:
            logits[..., rng.choice(n, size=min(sinks, n), replace=False)] += 3.0
        x = np.exp(logits)
        if zeros:
            x = x * (rng.random((B, H, n, n)) >= zeros)
            x[..., 0] += 1e-3  # keep every row non-empty
        out.append(x / x.sum(-1, keepdims=True))
    return out


def capacities(layers, **options):
    """The (L', B, n, n) float64 capacities exactly as rollout builds them (Ã per layer)."""
    mats, _, _ = augmented_layers(layers, dtype="float64", **options)
    return np.stack([m.numpy() for m in mats])


def nx_flows(caps, source):
    """Max-flow value from (L', source) to every (0, j), by networkx preflow-push on float capacities.
    ``caps`` (L', n, n) for one example: caps[l-1][i, k] is the edge (l, i) -> (l-1, k)."""
    L, n, _ = caps.shape
    G = nx.DiGraph()
    for l in range(1, L + 1):
        ii, kk = np.nonzero(caps[l - 1])
        G.add_edges_from(((l, i), (l - 1, k), {"capacity": float(caps[l - 1][i, k])}) for i, k in zip(ii, kk))
    out = np.zeros(n)
    for j in range(n):
        if (L, source) in G and (0, j) in G:
            out[j] = nx.maximum_flow_value(G, (L, source), (0, j))
    return out


def scipy_sandwich(caps, source, sinks, scale=2.0**30):
    """An independent two-sided bound on each max flow: the whole graph solved by scipy with capacities
    rounded down and rounded up (max flow is monotone in the capacities): lo <= F <= hi."""
    L, n, _ = caps.shape
    N = (L + 1) * n
    ii, kk, ll = [], [], []
    for l in range(1, L + 1):
        i, k = np.nonzero(caps[l - 1])
        ii.append(l * n + i)
        kk.append((l - 1) * n + k)
        ll.append(caps[l - 1][i, k])
    r, c, v = np.concatenate(ii), np.concatenate(kk), np.concatenate(ll)
    lo_g = csr_array((np.floor(v * scale).astype(np.int32), (r, c)), shape=(N, N))
    hi_g = csr_array((np.ceil(v * scale).astype(np.int32), (r, c)), shape=(N, N))
    lo = np.array([maximum_flow(lo_g, L * n + source, j).flow_value / scale for j in sinks])
    hi = np.array([maximum_flow(hi_g, L * n + source, j).flow_value / scale for j in sinks])
    return lo, hi


# ----------------------------------------------------------------------------------------------- vs networkx
@pytest.mark.slow
@settings(max_examples=60)
@given(
    n=st.integers(1, 12),
    L=st.integers(1, 4),
    H=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    alpha=st.sampled_from([0.0, 0.2, 0.5, 0.9]),
    fusion=st.sampled_from(["mean", "max", "min"]),
    mode=st.sampled_from(["blend", "renorm", "add"]),
    sparsify=st.sampled_from(["none", "discard", "discard_row", "top_k", "threshold"]),
    sinks=st.integers(0, 2),
    sharp=st.sampled_from([1.0, 4.0, 8.0]),
    zeros=st.sampled_from([0.0, 0.6]),
)
def test_equals_networkx_on_random_small_graphs(n, L, H, seed, alpha, fusion, mode, sparsify, sinks, sharp, zeros):
    # Sharp, sparse and sink-heavy layers make bottlenecks inside the graph, so that the minimum cut is often
    # neither the source's nor the input's edges (the cases a wrong certificate would get wrong).
    if mode == "add" and alpha >= 0.9:
        alpha = 0.5
    layers = softmax_layers(L, 1, H, n, seed=seed, sharp=sharp, sinks=sinks, zeros=zeros)
    layers = [a[0] for a in layers]  # unbatched (H, n, n)
    options = dict(head_fusion=fusion, alpha=alpha, residual_mode=mode)
    options.update(
        {
            "none": {},
            "discard": {"discard_ratio": 0.5},
            "discard_row": {"discard_ratio": 0.4, "discard_scope": "row", "protect_prefix": 0},
            "top_k": {"top_k": max(1, n // 3)},
            "threshold": {"threshold": 0.05},
        }[sparsify]
    )
    rows = sorted({0, n - 1, seed % n})
    got = attention_flow(layers, rows=rows, normalize=False, dtype="float64", **options)
    assert isinstance(got, np.ndarray) and got.shape == (len(rows), n)
    caps = capacities(layers, **options)[:, 0]
    for q, r in enumerate(rows):
        np.testing.assert_allclose(got[q], nx_flows(caps, r), atol=1e-6, rtol=0)


def test_default_capacities_by_hand_and_normalised_rows():
    # Independent of rollout's pipeline: Ã = 0.5·mean_h(A) + 0.5·I written out here.
    layers = [a[0] for a in softmax_layers(3, 1, 2, 7, seed=3, sinks=1)]
    caps = np.stack([0.5 * a.mean(0) + 0.5 * np.eye(7) for a in layers])
    raw = nx_flows(caps, 0)
    got = attention_flow(layers, normalize=False, dtype="float64")
    np.testing.assert_allclose(got[0], raw, atol=1e-6)
    normed = attention_flow(layers, dtype="float64")
    np.testing.assert_allclose(normed[0], raw / raw.sum(), atol=1e-6)
    np.testing.assert_allclose(normed.sum(-1), 1.0, atol=1e-12)


@pytest.mark.parametrize("k_base", [1, 4])
def test_certificate_paths_on_attention_with_sinks(k_base):
    # Concentrated ("attention sink") layers give minimum cuts that are neither the source's nor the
    # sink's edges, which drives the cut pool, edge generation and whole-graph fallbacks; the values must
    # still be networkx's.
    layers = [a[0] for a in softmax_layers(4, 1, 3, 12, seed=11, sharp=3.0, sinks=2)]
    caps = capacities(layers, alpha=0.3)[:, 0]
    solver = flow_mod._RowSolver(caps, 0, k_base=k_base)
    values, gaps = solver.solve(range(12))
    np.testing.assert_allclose(values, nx_flows(caps, 0), atol=1e-6)
    assert solver.stats["cuts"] > 0, solver.stats  # not every sink was certified by a known cut alone
    assert gaps.max() <= flow_mod.GAP_TOL
    if k_base == 1:
        assert solver.stats["full"] + solver.stats["added"] > 0, solver.stats


@pytest.mark.filterwarnings("ignore:attention_flow")  # a target gap of 0 cannot be met: it warns
def test_refinement_path_matches_networkx(monkeypatch):
    # Force the second, finer solve for every value: it must land on the same max flow.
    monkeypatch.setattr(flow_mod, "GAP_TOL", 0.0)
    layers = [a[0] for a in softmax_layers(3, 1, 2, 9, seed=5, sharp=2.0, sinks=1)]
    caps = capacities(layers)[:, 0]
    values, gaps = flow_mod._RowSolver(caps, 4).solve(range(9))
    np.testing.assert_allclose(values, nx_flows(caps, 4), atol=1e-9)
    assert gaps.max() < 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("n,L,sinks", [(100, 12, 0), (100, 6, 2)])
def test_error_bound_against_networkx_at_benchmark_size(n, L, sinks):
    layers = [a[0] for a in softmax_layers(L, 1, 2, n, seed=n + L, sharp=2.0, sinks=sinks)]
    caps = capacities(layers)[:, 0]
    got = attention_flow(layers, normalize=False, dtype="float64")[0]
    picks = [0, n - 1] if L < 12 else [n // 2]  # networkx on all n inputs takes minutes: a sample
    L_, n_, _ = caps.shape
    G = nx.DiGraph()
    for l in range(1, L_ + 1):
        ii, kk = np.nonzero(caps[l - 1])
        G.add_edges_from(((l, i), (l - 1, k), {"capacity": float(caps[l - 1][i, k])}) for i, k in zip(ii, kk))
    ref = np.array([nx.maximum_flow_value(G, (L_, 0), (0, j)) for j in picks])
    assert np.abs(got[picks] - ref).max() <= 1e-6


@pytest.mark.parametrize("n", [197, pytest.param(577, marks=pytest.mark.slow)])
def test_error_bound_at_vit_sizes_by_independent_sandwich(n):
    # networkx is far too slow and large here (millions of edges); instead a plain scipy solve of the whole
    # graph with capacities rounded down and rounded up brackets each true max flow.
    L = 12
    layers = [a[0] for a in softmax_layers(L, 1, 1, n, seed=n, sharp=2.0, sinks=2)]
    caps = capacities(layers)[:, 0]
    picks = [0, n // 3, n - 1]
    got = np.asarray(flow_mod._RowSolver(caps, 0).solve(picks)[0])
    lo, hi = scipy_sandwich(caps, 0, picks)
    assert np.all(hi - lo <= 1e-6), hi - lo  # the bracket is tight enough to judge 1e-6
    assert np.all(got >= lo - 1e-12) and np.all(got <= hi + 1e-12)


# ----------------------------------------------------------------------------------------------- properties
def test_one_layer_flow_is_the_augmented_row():
    layers = softmax_layers(1, 2, 3, 8, seed=1, sharp=2.0)
    for options in [{}, {"head_fusion": "max", "residual_mode": "renorm"}, {"discard_ratio": 0.5, "alpha": 0.2}]:
        got = attention_flow(layers, rows=[0, 3, 7], normalize=False, dtype="float64", **options)
        want = rollout(layers, rows=[0, 3, 7], dtype="float64", **options)  # one layer: R = Ã
        np.testing.assert_allclose(got, want, atol=1e-12)


def test_raw_flows_lie_in_unit_interval_and_dominate_rollout():
    # Rollout's row is one feasible flow that reaches every input at once, so each input's max flow is at
    # least the rollout share; no flow exceeds the source's capacity 1.
    layers = softmax_layers(5, 2, 4, 15, seed=2, sharp=2.0, sinks=1)
    raw = attention_flow(layers, rows=[0, 5], normalize=False, dtype="float64")
    roll = rollout(layers, rows=[0, 5], dtype="float64")
    assert raw.min() >= 0.0 and raw.max() <= 1.0 + 1e-9
    assert np.all(raw >= roll - 1e-9)
    assert raw.max() > roll.max() + 1e-3  # and it is not simply rollout


def test_raising_one_capacity_never_lowers_a_flow():
    rng = np.random.default_rng(7)
    fused = [rng.random((10, 10)) * (rng.random((10, 10)) < 0.5) for _ in range(3)]
    opts = dict(head_fusion=None, alpha=0.0, check_stochastic=False, normalize=False, dtype="float64")
    base = attention_flow(fused, **opts)
    raised_any = False
    for trial in range(12):
        layer, i, k = rng.integers(3), rng.integers(10), rng.integers(10)
        bumped = [f.copy() for f in fused]
        bumped[layer][i, k] += rng.random() * 0.5
        more = attention_flow(bumped, **opts)
        assert np.all(more >= base - 1e-9)
        raised_any |= bool(np.any(more > base + 1e-6))
    assert raised_any  # some bump mattered, so the comparison had teeth


def test_identity_attention_sends_all_flow_to_the_same_token():
    n = 6
    eye = np.broadcast_to(np.eye(n), (2, n, n)).copy()  # (H, n, n)
    raw = attention_flow([eye] * 4, rows=[0, 2, 5], normalize=False)
    np.testing.assert_allclose(raw, np.eye(n)[[0, 2, 5]], atol=1e-7)
    np.testing.assert_allclose(attention_flow([eye] * 4, rows=[3]), np.eye(n)[[3]], atol=1e-7)


def test_batched_equals_per_example_and_rows_order():
    layers = softmax_layers(3, 3, 2, 9, seed=4, sharp=2.0, sinks=1)
    batched = attention_flow(layers, rows=[4, 0], dtype="float64")
    assert batched.shape == (3, 2, 9)
    for b in range(3):
        one = attention_flow([a[b] for a in layers], rows=[4, 0], dtype="float64")
        np.testing.assert_allclose(batched[b], one, atol=1e-12)
        np.testing.assert_allclose(batched[b, 1], attention_flow([a[b] for a in layers], rows=0, dtype="float64")[0])


def test_padded_batch_equals_cropped_sequences():
    n, lengths = 8, [8, 5, 3]
    layers = softmax_layers(3, 3, 2, n, seed=9, sharp=2.0)
    mask = np.zeros((3, n))
    padded = []
    for a in layers:
        a = a.copy()
        for b, m in enumerate(lengths):
            mask[b, :m] = 1
            a[b, :, :, m:] = 0.0  # real queries attend to real keys only, as a padding mask makes them
            a[b, :, :m, :m] /= a[b, :, :m, :m].sum(-1, keepdims=True)
            a[b, :, m:, :] = 1.0 / n  # padding rows: arbitrary
        padded.append(a)
    for normalize in (True, False):
        out = attention_flow(padded, rows=[0, 2, 6], attention_mask=mask, normalize=normalize, dtype="float64",
                             discard_ratio=0.3)
        for b, m in enumerate(lengths):
            cropped = [a[b, :, :m, :m] for a in padded]
            for q, r in enumerate([0, 2, 6]):
                if r < m:
                    want = attention_flow(cropped, rows=[r], normalize=normalize, dtype="float64", discard_ratio=0.3)
                    np.testing.assert_allclose(out[b, q, :m], want[0], atol=1e-12)
                else:
                    assert np.all(out[b, q] == 0)  # a padded output gives nothing
            assert np.all(out[b, :, m:] == 0)  # padded inputs receive nothing


def test_kind_dtype_and_shapes():
    layers = softmax_layers(2, 1, 2, 5, seed=0)
    np_out = attention_flow(layers)
    assert isinstance(np_out, np.ndarray) and np_out.dtype == np.float64 and np_out.shape == (1, 1, 5)
    assert attention_flow([a.astype(np.float32) for a in layers]).dtype == np.float32
    t_out = attention_flow([torch.from_numpy(a) for a in layers])
    assert isinstance(t_out, torch.Tensor) and t_out.dtype == torch.float64 and t_out.shape == (1, 1, 5)
    t32 = attention_flow([torch.from_numpy(a).float()[0] for a in layers], rows=[1, 2])
    assert t32.dtype == torch.float32 and t32.shape == (2, 5)
    np.testing.assert_allclose(t32.numpy(), attention_flow([a[0] for a in layers], rows=[1, 2]), atol=1e-6)
    stacked = attention_flow(np.stack(layers), dtype="float64")
    np.testing.assert_allclose(stacked, attention_flow(layers, dtype="float64"))
    assert attention_flow(layers, rows=None).shape == (1, 5, 5)
    assert attention_flow(layers, rows=-1, start_layer=1).shape == (1, 1, 5)
    assert attnroll.attention_flow is attention_flow


def test_layer_range_selects_the_same_graph():
    layers = softmax_layers(4, 1, 2, 6, seed=8, sharp=2.0)
    got = attention_flow(layers, start_layer=1, end_layer=3, dtype="float64")
    np.testing.assert_allclose(got, attention_flow(layers[1:3], dtype="float64"), atol=1e-12)


@pytest.mark.slow
def test_n_jobs_processes_give_the_same_values(monkeypatch):
    pools = []

    class CountingPool(flow_mod.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(kwargs.get("max_workers"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(flow_mod, "ProcessPoolExecutor", CountingPool)
    layers = softmax_layers(3, 2, 2, 10, seed=6, sharp=2.0, sinks=1)
    one = attention_flow(layers, rows=[0, 3], dtype="float64")
    assert pools == []  # n_jobs=1 never starts workers
    attention_flow(layers, rows=[0, 3], dtype="float64", n_jobs=2)
    assert pools == []  # nor does a problem this small: starting processes would cost more than it saves
    monkeypatch.setattr(flow_mod, "_PARALLEL_WORK", 0)
    np.testing.assert_allclose(attention_flow(layers, rows=[0, 3], dtype="float64", n_jobs=2), one, atol=1e-12)
    single = [a[:1] for a in layers]
    np.testing.assert_allclose(  # one problem split into blocks of inputs across workers
        attention_flow(single, dtype="float64", n_jobs=2), attention_flow(single, dtype="float64"), atol=1e-12
    )
    assert pools == [2, 2]


def test_progress_bar_is_opt_in(capsys):
    layers = softmax_layers(2, 1, 2, 6, seed=0)
    attention_flow(layers)
    assert capsys.readouterr().err == ""
    attention_flow(layers, progress=True)
    assert "attention flow" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- validation
def test_validation_errors_match_rollout():
    good = softmax_layers(2, 1, 2, 4, seed=0)
    bad_sums = [a * 2 for a in good]
    with pytest.raises(ValueError, match="rows must sum to 1") as flow_err:
        attention_flow(bad_sums)
    with pytest.raises(ValueError) as roll_err:
        rollout(bad_sums)
    assert str(flow_err.value) == str(roll_err.value)
    assert "check_stochastic=False" in str(flow_err.value)
    with pytest.raises(ValueError, match="negative entries"):
        attention_flow([-a for a in good])
    with pytest.raises(ValueError, match="head_fusion must be one of"):
        attention_flow(good, head_fusion="median")
    with pytest.raises(ValueError, match="alpha must be in"):
        attention_flow(good, alpha=1.5)
    with pytest.raises(ValueError, match="residual_mode must be one of"):
        attention_flow(good, residual_mode="sum")
    with pytest.raises(ValueError, match=r"rows\[0\]=4 is out of range for 4 tokens"):
        attention_flow(good, rows=[4])
    with pytest.raises(ValueError, match="rows is empty"):
        attention_flow(good, rows=[])
    with pytest.raises(TypeError, match="rows must be an int or a sequence"):
        attention_flow(good, rows="0")
    with pytest.raises(ValueError, match=r"start_layer \(1\) must be < end_layer \(1\)"):
        attention_flow(good, start_layer=1, end_layer=1)
    with pytest.raises(ValueError, match="must be square"):
        attention_flow([a[..., :3] for a in good])
    with pytest.raises(ValueError, match="attentions is empty"):
        attention_flow([])
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        attention_flow(good, attention_mask=np.ones((1, 5)))
    with pytest.raises(ValueError, match="discard_ratio"):
        attention_flow(good, discard_ratio=1.5)


def test_validation_of_flow_options():
    good = softmax_layers(2, 1, 2, 4, seed=0)
    with pytest.raises(TypeError, match="normalize must be True or False, got str"):
        attention_flow(good, normalize="yes")
    with pytest.raises(TypeError, match="progress must be True or False"):
        attention_flow(good, progress=1)
    with pytest.raises(ValueError, match="n_jobs must be a positive number of worker processes or -1 .*got 0"):
        attention_flow(good, n_jobs=0)
    with pytest.raises(TypeError, match="n_jobs must be an integer, got float"):
        attention_flow(good, n_jobs=1.5)


def test_memory_estimate_in_the_error(monkeypatch):
    monkeypatch.setattr(system_mod, "available_memory", lambda: 1_000_000)
    layers = softmax_layers(12, 1, 1, 60, seed=0)
    need = flow_mod.estimate_memory(12, 60)
    assert need == 12 * 60 * 60 * 62
    with pytest.raises(MemoryError, match=r"12 layers x 60 tokens \(721 nodes.*needs about 0\.00 GiB") as err:
        attention_flow(layers)
    assert "start_layer" in str(err.value) and "available" in str(err.value)
