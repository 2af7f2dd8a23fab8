"""Bad input to the core, by class: each class is one shared rule, tried on every function it
applies to. References are independent: the float32 computation of the same numbers, a linearity identity
of max flow, hand-built inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import attnroll
from attnroll import add_residual, attention_flow, fuse_heads, per_head_rollout, rollout, sparsify
from attnroll import _checks
from attnroll.core import flow as flow_mod


def softmax(B=2, H=3, n=6, L=2, seed=0, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax((scale * torch.randn(B, H, n, n, generator=g)).to(dtype), dim=-1) for _ in range(L)]


# ------------------------------------------------------------------ one tolerance rule, scaled to the dtype
@pytest.mark.slow
@settings(max_examples=25)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 40), scale=st.floats(0.1, 8.0),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_low_precision_softmax_is_accepted_and_rolled_out_as_its_float32_values(seed, n, scale, dtype):
    atts = softmax(n=n, seed=seed, dtype=dtype, scale=scale)
    got = rollout(atts, rows=[0])
    # The same numbers upcast and accepted without the row-sum check: what the product must be.
    ref = rollout([a.float() for a in atts], rows=[0], check_stochastic=False)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    per_head_rollout(atts)  # same rule everywhere
    attention_flow([a.float().numpy().astype(np.float64) for a in atts[:1]], check_stochastic=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_tolerance_is_four_epsilons_of_the_input_dtype_but_never_below_1e3(dtype):
    eps = torch.finfo(dtype).eps
    tol = _checks.stochastic_atol(dtype)
    assert tol == max(1e-3, 4 * eps)
    base = softmax(B=1, H=1, n=4, L=1, dtype=torch.float64)[0]
    inside, outside = base * (1 + 0.5 * tol), base * (1 + 2 * tol)
    # Row sums 1 + tol/2 pass, 1 + 2 tol are refused (values built in float64, then cast: the cast keeps
    # the sum within a rounding of 1 + k·tol, far from the limit for these k).
    rollout([inside.to(dtype)], head_fusion="mean")
    with pytest.raises(ValueError, match=r"rows must sum to 1 within"):
        rollout([outside.to(dtype)], head_fusion="mean")


def test_float32_tolerance_unchanged_and_message_says_how_to_accept():
    a = softmax(L=1)[0] * 1.002
    with pytest.raises(ValueError, match=r"within 0\.001 .*check_stochastic=False"):
        rollout([a])
    rollout([a.half()])  # float16's tolerance (0.0039) covers a 0.2 % deviation


# ------------------------------------------------------------------ integer-like arguments: never truncated
@settings(max_examples=30)
@given(v=st.floats(-5, 5).filter(lambda x: not float(x).is_integer()))
def test_fractional_rows_are_refused_in_every_container(v):
    atts = softmax(n=6)
    for rows in (np.array([v]), torch.tensor([v]), [v], (0, v), v, np.float64(v)):
        with pytest.raises(TypeError, match=r"rows(\[\d\])? must be an int"):
            rollout(atts, rows=rows)
        with pytest.raises(TypeError, match=r"rows(\[\d\])? must be an int"):
            attention_flow(atts, rows=rows)


@settings(max_examples=20)
@given(rows=st.lists(st.integers(-6, 5), min_size=1, max_size=4))
def test_integer_rows_give_the_same_result_in_every_container(rows):
    atts = softmax(n=6)
    ref = rollout(atts, rows=rows)
    for given_rows in (np.array(rows), torch.tensor(rows), tuple(rows), np.array(rows, dtype=np.int32)):
        torch.testing.assert_close(rollout(atts, rows=given_rows), ref, rtol=0, atol=0)
    full = rollout(atts)
    torch.testing.assert_close(ref, full[:, [r % 6 for r in rows]], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [1.0, True, np.array([1.0]), np.array([True]), "1", None])
def test_integer_options_refuse_floats_and_bools(bad):
    atts = softmax(n=6)
    for kw in ("start_layer", "top_k", "protect_prefix"):
        if bad is None and kw != "start_layer":
            continue  # None means "off" for these
        with pytest.raises(TypeError, match=kw):
            rollout(atts, **{kw: bad})


def test_zero_dimensional_integer_tensors_are_integers():
    atts = softmax(n=6)
    torch.testing.assert_close(rollout(atts, rows=torch.tensor(2)), rollout(atts, rows=2), rtol=0, atol=0)
    torch.testing.assert_close(rollout(atts, start_layer=np.int64(1)), rollout(atts, start_layer=1), rtol=0, atol=0)


# ------------------------------------------------------------------ booleans: only True / False
BOOL_ARGS = [
    (rollout, "return_layers"), (rollout, "check_stochastic"), (rollout, "validate"),
    (per_head_rollout, "return_layers"), (per_head_rollout, "check_stochastic"), (per_head_rollout, "validate"),
    (attention_flow, "normalize"), (attention_flow, "progress"), (attention_flow, "check_stochastic"),
]


@pytest.mark.parametrize("fn, name", BOOL_ARGS, ids=[f"{f.__name__}-{n}" for f, n in BOOL_ARGS])
@pytest.mark.parametrize("bad", ["False", "True", 0, 1, None, 0.0, np.array([True]), torch.tensor(True)])
def test_boolean_flags_refuse_everything_but_booleans(fn, name, bad):
    with pytest.raises(TypeError, match=rf"{name} must be True or False, got"):
        fn(softmax(n=5), **{name: bad})


@pytest.mark.parametrize("fn, name", BOOL_ARGS, ids=[f"{f.__name__}-{n}" for f, n in BOOL_ARGS])
def test_numpy_booleans_count_as_booleans(fn, name):
    atts = softmax(n=5)
    out_np = fn(atts, **{name: np.bool_(False)})
    out_py = fn(atts, **{name: False})
    torch.testing.assert_close(out_np, out_py, rtol=0, atol=0)


def test_string_false_hint():
    with pytest.raises(TypeError, match=r"pass False, not 'False'"):
        rollout(softmax(), return_layers="False")


# ------------------------------------------------------------------ NaN / Inf: refused by every reader
READERS = {
    "fuse_heads": lambda a: fuse_heads(a),
    "add_residual": lambda a: add_residual(a),
    "sparsify": lambda a: sparsify(a, discard_ratio=0.5),
    "rollout": lambda a: rollout([a]),
    "rollout rows": lambda a: rollout([a], rows=[0]),
    "rollout masked": lambda a: rollout([a], attention_mask=np.ones((a.shape[0], a.shape[-1]))),
    "per_head_rollout": lambda a: per_head_rollout([a]),
    "attention_flow": lambda a: attention_flow([a]),
}


@pytest.mark.parametrize("reader", list(READERS))
@settings(max_examples=10)
@given(where=st.tuples(st.integers(0, 1), st.integers(0, 2), st.integers(0, 4), st.integers(0, 4)),
       bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_non_finite_attention_is_refused_wherever_it_is(reader, where, bad):
    a = softmax(B=2, H=3, n=5, L=1, dtype=torch.float64)[0].numpy().copy()
    a[where] = bad
    with pytest.raises(ValueError, match=r"NaN|infinite|negative"):
        READERS[reader](a)


def test_fuse_heads_keeps_signed_finite_values():
    a = np.array([[[1.0, -2.0], [0.5, 0.0]], [[3.0, 2.0], [-0.5, 1.0]]])
    np.testing.assert_allclose(fuse_heads(a), a.mean(axis=0))


@pytest.mark.parametrize("reader", list(READERS))
def test_meta_device_tensors_are_refused_clearly(reader):
    a = torch.empty(2, 3, 5, 5, device="meta")
    with pytest.raises(ValueError, match=r"'meta' device .* no data"):
        READERS[reader](a)


def test_meta_device_mask_is_refused():
    with pytest.raises(ValueError, match=r"attention_mask is on the 'meta' device"):
        rollout(softmax(n=5), attention_mask=torch.ones(2, 5, device="meta"))


# ------------------------------------------------------------------ head weights: one checker everywhere
@settings(max_examples=20)
@given(w=st.lists(st.floats(0.0, 10.0), min_size=3, max_size=3).filter(lambda w: sum(w) > 1e-3))
def test_head_weights_in_any_container_match_the_weighted_mean(w):
    atts = softmax(B=1, H=3, n=4, L=2, dtype=torch.float64)
    weights = np.array(w) / sum(w)
    ref = [torch.einsum("bhij,h->bij", a, torch.from_numpy(weights)) for a in atts]
    expect = rollout(ref, head_fusion=None)
    for given_w in (w, tuple(w), np.array(w), torch.tensor(w), np.array(w, dtype=np.float32)):
        torch.testing.assert_close(rollout(atts, head_fusion=given_w), expect, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fuse_heads(atts[0], given_w), ref[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad, exc, pattern", [
    ([1.0, float("nan"), 1.0], ValueError, "finite, non-negative"),
    ([1.0, -1.0, 1.0], ValueError, "finite, non-negative"),
    ([0.0, 0.0, 0.0], ValueError, "not all zero"),
    ([1.0, 1.0], ValueError, "length H=3"),
    (np.ones((3, 1)), ValueError, "1-D vector"),
    (["a", "b", "c"], TypeError, "numbers"),
    (3, TypeError, "head_fusion must be"),
])
def test_bad_head_weights_are_refused_by_every_function(bad, exc, pattern):
    atts = softmax(B=1, H=3, n=4)
    with pytest.raises(exc, match=pattern):
        rollout(atts, head_fusion=bad)
    with pytest.raises(exc, match=pattern):
        fuse_heads(atts[0], bad)
    with pytest.raises(exc, match=pattern):
        attention_flow(atts, head_fusion=bad)


# ------------------------------------------------------------------ flow: capacities of any magnitude
@pytest.mark.parametrize("c", [1e-310, 1e-300, 1e-30, 1e-5, 1e5, 1e30, 1e300])
def test_flow_is_linear_in_the_capacities_at_any_magnitude(c):
    rng = np.random.default_rng(1)
    # Non-stochastic non-negative matrices (some zeros), no residual: capacities are exactly c·M.
    M = [np.where(rng.random((2, 5, 5)) < 0.3, 0.0, rng.random((2, 5, 5))) for _ in range(3)]
    base = attention_flow(M, head_fusion=None, alpha=0.0, check_stochastic=False, normalize=False, rows=[0, 3])
    scaled = attention_flow([c * m for m in M], head_fusion=None, alpha=0.0, check_stochastic=False,
                            normalize=False, rows=[0, 3])
    assert np.all(np.isfinite(scaled))
    # Tolerance: the certified bound (5e-7 of the largest capacity), scaled like the capacities.
    np.testing.assert_allclose(scaled, c * base, rtol=1e-6, atol=c * 1e-6 if c > 1e-300 else 0)
    normed = attention_flow([c * m for m in M], head_fusion=None, alpha=0.0, check_stochastic=False, rows=[0, 3])
    ref = attention_flow(M, head_fusion=None, alpha=0.0, check_stochastic=False, rows=[0, 3])
    np.testing.assert_allclose(normed, ref, rtol=1e-5, atol=1e-6)


def test_flow_of_subnormal_single_layer_is_the_capacity():
    # One layer: the max flow from r to j is the edge itself (the only path).
    A = np.array([[[3e-310, 1e-310], [2e-310, 2e-310]]])
    out = attention_flow([A], head_fusion=None, alpha=0.0, check_stochastic=False, normalize=False, rows=[0, 1])
    np.testing.assert_array_equal(out[0], A[0])


def test_row_sums_that_overflow_are_refused_clearly():
    big = np.full((1, 1, 3, 3), 1e308)
    with pytest.raises(ValueError, match=r"so large .* overflow torch.float64"):
        rollout([big], check_stochastic=False)
    with pytest.raises(ValueError, match=r"contains infinite values"):
        rollout([np.where(np.eye(3) > 0, np.inf, 0.0)[None, None]], check_stochastic=False)


# ------------------------------------------------------------------ memory: checked before allocating
def test_flow_memory_guard_fires_before_the_dense_capacities_are_built(monkeypatch):
    built = []

    def augmented_layers(*a, **k):
        built.append(1)
        raise AssertionError("dense capacities built before the memory check")

    monkeypatch.setattr(flow_mod, "augmented_layers", augmented_layers)
    # A stacked float16 array keeps the test input small; the estimate uses the shapes only.
    atts = torch.full((4, 1, 1, 30, 30), 1 / 30, dtype=torch.float16)
    with pytest.raises(MemoryError, match=r"4 layers x 30 tokens"):
        flow_mod.attention_flow(atts, available_memory=10_000)
    assert built == []


def test_memory_estimate_counts_the_batch_of_dense_capacities():
    assert flow_mod.estimate_memory(3, 10, 2, batch=5) == 2 * 3 * 100 * 62 + 5 * 3 * 100 * 16
