"""Every validation error of the core names the argument, what came in and what was expected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnroll import add_residual, fuse_heads, per_head_rollout, rollout, sparsify


def layers(L=2, B=1, H=2, n=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(L):
        x = rng.random((B, H, n, n)) + 0.1
        out.append(x / x.sum(-1, keepdims=True))
    return out


GOOD = layers()


@pytest.mark.parametrize(
    "attentions, kwargs, exc, pattern",
    [
        ([], {}, ValueError, r"attentions is empty"),
        (np.zeros((0, 1, 2, 4, 4)), {}, ValueError, r"attentions is empty"),
        ("abc", {}, TypeError, r"attentions must be a list/tuple .* got str"),
        ([[1, 2]], {}, TypeError, r"attentions\[0\] must be a torch.Tensor or numpy.ndarray, got list"),
        ([np.ones((4, 4))], {}, ValueError, r"attentions\[0\] must have shape \(B, H, n, n\) or \(H, n, n\), got \(4, 4\).*head_fusion=None"),
        ([np.ones((1, 2, 4, 4))], {"head_fusion": None}, ValueError, r"attentions\[0\] must have shape \(B, n, n\) or \(n, n\), got \(1, 2, 4, 4\).*needs a head_fusion"),
        (np.ones((2, 4, 4)), {}, ValueError, r"one stacked array must have shape \(L, B, H, n, n\), got \(2, 4, 4\)"),
        ([np.ones((1, 2, 4, 5)) / 5], {}, ValueError, r"attentions\[0\] must be square .* got shape \(1, 2, 4, 5\)"),
        ([GOOD[0], layers(n=5)[0]], {}, ValueError, r"layers differ in number of tokens n: layer 0 has shape \(1, 2, 4, 4\), layer 1 has \(1, 2, 5, 5\)"),
        ([GOOD[0], layers(H=3)[0]], {}, ValueError, r"layers differ in number of heads H"),
        ([GOOD[0], layers(B=2)[0]], {}, ValueError, r"layers differ in batch size B"),
        ([GOOD[0], GOOD[1][0]], {}, ValueError, r"mix batched and unbatched"),
        ([GOOD[0], torch.from_numpy(GOOD[1])], {}, TypeError, r"mixes numpy arrays and torch tensors"),
        ([np.where(np.arange(4) == 1, np.nan, GOOD[0])], {}, ValueError, r"attentions\[0\] contains NaN values"),
        ([np.where(np.arange(4) == 1, np.inf, GOOD[0])], {}, ValueError, r"attentions\[0\] contains infinite values"),
        ([GOOD[0], GOOD[1] - 0.5], {}, ValueError, r"attentions\[1\] contains negative entries .*Clamp"),
        ([GOOD[0] * 1.2], {}, ValueError, r"attentions\[0\]: rows must sum to 1 .* range from 1\.2 to 1\.2\. Pass check_stochastic=False"),
        ([np.ones((1, 2, 2, 2), dtype=complex)], {}, TypeError, r"must hold real numbers"),
    ],
)
def test_input_errors(attentions, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        rollout(attentions, **kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"alpha": 1.5}, ValueError, r"alpha must be in \[0.0, 1.0\], got 1.5"),
        ({"alpha": -0.1}, ValueError, r"alpha must be in \[0.0, 1.0\], got -0.1"),
        ({"alpha": "half"}, TypeError, r"alpha must be a real number, got str"),
        ({"alpha": 1.0, "residual_mode": "add"}, ValueError, r"alpha must be < 1 with residual_mode='add'"),
        ({"residual_mode": "sum"}, ValueError, r"residual_mode must be one of 'blend', 'renorm', 'add'; got 'sum'"),
        ({"head_fusion": "median"}, ValueError, r"head_fusion must be one of 'mean', 'max', 'min'; got 'median'"),
        ({"head_fusion": [1.0, 2.0, 3.0]}, ValueError, r"head_fusion weights must be a vector of length H=2 .* got shape \(3,\)"),
        ({"head_fusion": [0.0, 0.0]}, ValueError, r"head_fusion weights must be finite, non-negative and not all zero"),
        ({"head_fusion": 3}, TypeError, r"head_fusion must be 'mean', 'max', 'min' or a length-H weight vector, got int"),
        ({"discard_ratio": 1.0}, ValueError, r"discard_ratio must be in \[0.0, 1.0\), got 1.0"),
        ({"discard_ratio": -0.2}, ValueError, r"discard_ratio must be in \[0.0, 1.0\), got -0.2"),
        ({"discard_scope": "global"}, ValueError, r"discard_scope must be one of 'layer', 'row'; got 'global'"),
        ({"top_k": 0}, ValueError, r"top_k must be in \[1, n\] = \[1, 4\] .* got 0"),
        ({"top_k": 5}, ValueError, r"top_k must be in \[1, n\] = \[1, 4\] .* got 5"),
        ({"top_k": 2.5}, TypeError, r"top_k must be an integer, got float"),
        ({"threshold": -1.0}, ValueError, r"threshold must be >= 0.0, got -1.0"),
        ({"protect_prefix": 5}, ValueError, r"protect_prefix must be in \[0, n\] = \[0, 4\]"),
        ({"rows": [0, 4]}, ValueError, r"rows\[1\]=4 is out of range for 4 tokens: expected an index in \[-4, 3\]"),
        ({"rows": [-5]}, ValueError, r"rows\[0\]=-5 is out of range for 4 tokens"),
        ({"rows": []}, ValueError, r"rows is empty"),
        ({"rows": "0"}, TypeError, r"rows must be an int or a sequence of token indices, got str"),
        ({"start_layer": 1, "end_layer": 1}, ValueError, r"start_layer \(1\) must be < end_layer \(1\)"),
        ({"start_layer": 2}, ValueError, r"start_layer=2 is out of range for 2 layers"),
        ({"end_layer": 3}, ValueError, r"end_layer=3 is out of range for 2 layers"),
        ({"start_layer": -1, "end_layer": -1}, ValueError, r"start_layer \(1\) must be < end_layer \(1\)"),
        ({"attention_mask": np.ones((1, 5))}, ValueError, r"attention_mask must have shape \(1, 4\) .* got \(1, 5\)"),
        ({"attention_mask": np.array([[1, 0, 2, 1]])}, ValueError, r"attention_mask must hold only 0 and 1 .* got values \[0, 1, 2\]"),
        ({"attention_mask": [[1, 1, 1, 1]]}, TypeError, r"attention_mask must be a torch.Tensor or numpy.ndarray, got list"),
        ({"dtype": "float16"}, ValueError, r"dtype must be float32 or float64"),
    ],
)
def test_option_errors(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        rollout(GOOD, **kwargs)


def test_unbatched_mask_shape_and_padded_rows_not_checked():
    one = [a[0] for a in GOOD]
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(4,\)"):
        rollout(one, attention_mask=np.ones((1, 4)))
    # Padded query rows may be all-zero (some implementations) without tripping the stochastic check...
    padded = [a.copy() for a in GOOD]
    for a in padded:
        a[:, :, 3, :] = 0.0
    rollout(padded, attention_mask=np.array([[1, 1, 1, 0]]))
    # ...but a real token's row may not.
    with pytest.raises(ValueError, match=r"rows must sum to 1"):
        rollout(padded)


def test_per_head_and_building_block_errors():
    with pytest.raises(ValueError, match=r"attentions\[0\] must have shape \(B, H, n, n\)"):
        per_head_rollout([np.eye(3)])
    with pytest.raises(ValueError, match=r"attn must have shape \(\.\.\., H, n, n\)"):
        fuse_heads(np.eye(3))
    with pytest.raises(ValueError, match=r"attn must be square"):
        fuse_heads(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match=r"A contains negative entries"):
        add_residual(-np.eye(3))
    with pytest.raises(ValueError, match=r"A must be square"):
        sparsify(np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"top_k must be in \[1, n\] = \[1, 3\]"):
        sparsify(np.eye(3), top_k=4)
