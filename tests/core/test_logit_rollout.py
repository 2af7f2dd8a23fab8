"""core.logit_rollout against naive products and the linear-head identity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnroll.core.logit_rollout import head_direction, logit_rollout
from attnroll.core.value_aware import Norm, apply_norm


def test_logit_rollout_is_the_sum_of_rows_times_the_products_below():
    g = torch.Generator().manual_seed(0)
    L, B, n = 4, 2, 5
    deltas = [torch.randn(B, n, generator=g, dtype=torch.float64) for _ in range(L)]
    mixing = [torch.rand(B, n, n, generator=g, dtype=torch.float64) for _ in range(L)]
    got = logit_rollout(deltas, mixing).numpy()
    for b in range(B):
        want, below = np.zeros(n), np.eye(n)
        for l in range(L):
            want += deltas[l][b].numpy() @ below
            below = mixing[l][b].numpy() @ below
        np.testing.assert_allclose(got[b], want, rtol=1e-12)
    with pytest.raises(ValueError, match="one entry per layer"):
        logit_rollout(deltas, mixing[:2])


@pytest.mark.parametrize("rms", [False, True])
def test_head_direction_reproduces_the_linearised_norm_and_classifier(rms):
    g = torch.Generator().manual_seed(1)
    d = 6
    norm = Norm(1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64),
                None if rms else torch.randn(d, generator=g, dtype=torch.float64), 1e-6, rms)
    actual, w = torch.randn(3, d, generator=g, dtype=torch.float64), torch.randn(3, d, generator=g, dtype=torch.float64)
    parts = torch.randn(4, 3, d, generator=g, dtype=torch.float64)
    parts[-1] = actual - parts[:-1].sum(0)  # shares of the actual vector
    omega = head_direction(w, norm, actual)
    beta = 0 if norm.bias is None else norm.bias
    # the shares' projections add up to the head applied to the actual vector (β's projection apart)
    torch.testing.assert_close((parts * omega).sum(-1).sum(0),
                               ((apply_norm(actual, norm) - beta) * w).sum(-1))
    torch.testing.assert_close(head_direction(w, None, actual), w)
