"""One array of attention is either a list's worth of layers stacked WITH the batch axis, or refused: a 4-D
(B, H, n, n) batch of one layer reads the same as (L, H, n, n) layers of one example. An empty or missing
``outputs.attentions`` (a transformers model under SDPA) is refused with the fix named."""

import numpy as np
import pytest
import torch

import attnroll
from attnroll.core.flow import attention_flow as core_flow


def _softmax_layers(L, B, H, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(L, B, H, n, n))
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


FUNCS = {
    "rollout": lambda a, **k: attnroll.rollout(a, **k),
    "per_head_rollout": lambda a, **k: attnroll.per_head_rollout(a, **k),
    "attention_flow": lambda a, **k: core_flow(a, **k),
}


@pytest.mark.parametrize("name", FUNCS)
def test_one_4d_array_is_refused_with_both_readings_named(name):
    a = _softmax_layers(1, 3, 2, 5)[0]  # one layer's batch: (B=3, H=2, n, n)
    with pytest.raises(ValueError, match=r"4-D array \(3, 2, 5, 5\).*list of per-layer arrays.*\(L, B, H, n, n\)"):
        FUNCS[name](a)
    with pytest.raises(ValueError, match=r"4-D array"):
        FUNCS[name](torch.from_numpy(a))


@pytest.mark.parametrize("name", FUNCS)
def test_the_two_spelled_out_readings_still_work(name):
    """[a] is one layer of B examples; a[:, None] is L layers of one example; the 5-D stack equals the list."""
    stack = _softmax_layers(3, 2, 2, 5, seed=1)
    f = FUNCS[name]
    np.testing.assert_allclose(f(stack), f(list(stack)), atol=1e-6)
    one_layer = f([stack[0]])
    per_example = [f([stack[0, b]]) for b in range(2)]  # unbatched (H, n, n) per example
    for b in range(2):
        np.testing.assert_allclose(one_layer[b], per_example[b], atol=1e-6)
    layers_of_one = f(stack[:, :1])  # (L, 1, H, n, n)
    np.testing.assert_allclose(layers_of_one[0], f([s[0] for s in stack]), atol=1e-6)


def test_fused_3d_array_is_refused_too():
    fused = _softmax_layers(1, 3, 1, 4)[0, :, 0]  # (B, n, n) of one layer, heads fused
    with pytest.raises(ValueError, match=r"3-D array \(3, 4, 4\).*\(L, B, n, n\)"):
        attnroll.rollout(fused, head_fusion=None)
    want = attnroll.rollout([fused], head_fusion=None)
    np.testing.assert_allclose(attnroll.rollout(fused[None], head_fusion=None), want)


@pytest.mark.parametrize("empty,exc", [((), ValueError), ([], ValueError), (None, TypeError)])
def test_empty_outputs_attentions_names_the_fix(empty, exc):
    with pytest.raises(exc, match=r'attn_implementation="eager".*attnroll.explain / attnroll.capture'):
        attnroll.rollout(empty)
