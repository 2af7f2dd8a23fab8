"""core.sinks: the measured sink rule on hand-made attention, column dropping, the top share."""

from __future__ import annotations

import torch

from attnroll.core import sinks


def _uniform_causal(L: int, n: int) -> torch.Tensor:
    """(L, n, n) causal attention spread evenly over the visible keys."""
    A = torch.tril(torch.ones(n, n))
    return (A / A.sum(-1, keepdim=True)).expand(L, n, n).clone()


def _with_sink(A: torch.Tensor, j: int, share: float, layers) -> torch.Tensor:
    """``share`` of every row after ``j`` moved onto key ``j`` in ``layers``, the rest scaled down."""
    A = A.clone()
    for layer in layers:
        rows = A[layer, j + 1:]
        rest = rows.clone()
        rest[:, j] = 0
        rest = rest / rest.sum(-1, keepdim=True) * (1 - share)
        rest[:, j] = share
        A[layer, j + 1:] = rest
    return A


def test_sample_queries_skips_short_rows_and_padding():
    real = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])
    q = sinks.sample_queries(real)
    assert q.tolist() == [5, 6, 7]  # the 4th real token on
    long = sinks.sample_queries(torch.ones(200))
    assert long.numel() == sinks.DEFAULT_RULE.max_queries and long[0] == 3 and long[-1] == 199


def test_first_token_sink_found_in_most_layers():
    n, L = 12, 5
    A = _with_sink(_uniform_causal(L, n), 0, 0.7, layers=range(1, L))  # 4 of 5 layers
    q = sinks.sample_queries(torch.ones(n))
    found, held = sinks.find_sinks(A[:, q], q, torch.ones(n))
    assert found.tolist() == [True] + [False] * (n - 1)
    assert abs(float(held[0]) - 0.8) < 1e-6


def test_a_middle_sink_is_found_and_a_token_held_in_few_layers_is_not():
    n, L = 16, 6
    A = _with_sink(_uniform_causal(L, n), 4, 0.5, layers=range(L))
    A = _with_sink(A, 2, 0.9, layers=range(2))  # 2 of 6 layers: content, not a sink
    q = sinks.sample_queries(torch.ones(n))
    found, held = sinks.find_sinks(A[:, q], q, torch.ones(n))
    assert torch.nonzero(found).reshape(-1).tolist() == [4]
    assert abs(float(held[2]) - 2 / 6) < 1e-6


def test_uniform_attention_and_few_judges_give_no_sink():
    n = 12
    q = sinks.sample_queries(torch.ones(n))
    found, _ = sinks.find_sinks(_uniform_causal(4, n)[:, q], q, torch.ones(n))
    assert not found.any()  # 1/(i+1) <= 0.25 for every judged query
    A = _with_sink(_uniform_causal(4, n), n - 3, 0.9, layers=range(4))  # only 2 later queries judge it
    found, _ = sinks.find_sinks(A[:, q], q, torch.ones(n))
    assert not found.any()


def test_drop_columns_keeps_the_row_mass():
    row = torch.tensor([[0.9, 0.05, 0.03, 0.02], [0.1, -0.2, 0.3, 0.4]])
    drop = torch.tensor([[True, False, False, False], [False, False, False, True]])
    out, share = sinks.drop_columns(row, drop)
    assert torch.allclose(share, torch.tensor([0.9, 0.4]))
    assert torch.allclose(out[0], torch.tensor([0.0, 0.5, 0.3, 0.2]))
    assert torch.allclose(out[1], torch.tensor([0.1, -0.2, 0.3, 0.0]) / 0.6)
    assert torch.allclose(out.abs().sum(-1), row.abs().sum(-1))
    zero, s0 = sinks.drop_columns(torch.zeros(1, 3), torch.tensor([[True, False, False]]))
    assert not zero.any() and float(s0) == 0.0


def test_top_share():
    share, pos = sinks.top_share(torch.tensor([[0.1, 0.6, 0.3], [0.0, 0.0, 0.0]]))
    assert torch.allclose(share, torch.tensor([0.6, 0.0])) and pos[0] == 1
