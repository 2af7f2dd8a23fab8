"""The readout policy of ``attnroll.capture.readout`` on hand-made records: which rows an explanation reads
(the readout= option, then position=, then the adapter's readout for pooled outputs, then the explained
token's row for token-level outputs), the explained positions, and the size the rows are picked from.
Expectations are written out from the masks here, not from attnroll."""

from __future__ import annotations

import pytest
import torch

from attnroll.capture.readout import (explained_positions, explained_readout, readout_size, resolve_readout,
                                      token_level)
from attnroll.capture.record import AttentionRecord, StreamInfo

B, N, H = 2, 5, 2
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])


def probs(causal: bool = False, n: int = N) -> torch.Tensor:
    torch.manual_seed(0)
    s = torch.randn(B, H, n, n)
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1)


def record(outputs, *, causal=False, readout="mean", reason="", layers=None, merges=None) -> AttentionRecord:
    info = StreamInfo(kind="text", mask=MASK, prefix=1, merges=merges or {}, readout_reason=reason)
    if readout is not None:
        info.readout = resolve_readout(readout, batch=B, n=N, mask=MASK, prefix=1, source="adapter")
    return AttentionRecord(streams={"self": layers or [probs(causal)] * 2}, outputs=outputs, info={"self": info})


def last_real_by_hand() -> list[int]:
    return [max(i for i in range(N) if MASK[b, i]) for b in range(B)]


def test_pooled_outputs_read_the_adapters_readout():
    rec = record(torch.randn(B, 3))
    assert not token_level(rec.outputs, N)
    assert explained_readout(rec, "self") is rec.info["self"].readout
    want = MASK.float().clone()
    want[:, 0] = 0
    assert torch.allclose(explained_readout(rec, "self").weights, want / want.sum(-1, keepdim=True))


def test_token_level_outputs_read_the_last_real_token():
    rec = record(torch.randn(B, N, 7), causal=True)
    assert token_level(rec.outputs, N) and not token_level(rec.outputs, N + 1)
    assert explained_positions(rec, "self") == last_real_by_hand()
    ro = explained_readout(rec, "self")
    assert ro.positions() == last_real_by_hand() and ro.source == "the explained token's position"


def test_the_options_come_first():
    rec = record(torch.randn(B, 3))
    assert explained_readout(rec, "self", spec="cls").positions() == [0, 0]
    assert explained_readout(rec, "self", spec="cls", position=[2, 3]).kind == "cls"
    ro = explained_readout(rec, "self", position=[2, 3])
    assert (ro.kind, ro.positions(), ro.source) == ("position", [2, 3], "position= option")
    assert explained_positions(rec, "self", 4) == [4, 4]
    with pytest.raises(ValueError):
        explained_positions(rec, "self", N)


def test_positions_without_causal_attention_or_token_outputs():
    assert explained_positions(record(torch.randn(B, 3), readout="cls"), "self") == [0, 0]
    assert explained_positions(record(torch.randn(B, 3), readout=None), "self") == [0, 0]
    assert explained_positions(record(torch.randn(B, 3), causal=True), "self") == last_real_by_hand()


def test_a_stream_without_default_readout_names_the_reason():
    rec = record(torch.randn(B, 3), readout=None, reason="max pooling")
    with pytest.raises(ValueError, match="ToyModel has no default readout: max pooling"):
        explained_readout(rec, "self", model="ToyModel")
    assert explained_readout(rec, "self", spec="mean").kind == "mean"


def test_a_stage_chain_reads_its_last_layers_tokens():
    first, last = probs(n=N), probs(n=3)
    info_merges = {1: torch.full((3, N), 1 / N)}
    rec = record(torch.randn(B, 3), readout=None, layers=[first, last], merges=info_merges)
    assert readout_size(rec, "self") == (B, 3)
    assert readout_size(record(torch.randn(B, 3)), "self") == (B, N)
