"""The matrix-free route through token mixers (core/mixers.py ``MixerRows``: Mamba-2, Mamba, short convolutions,
gated DeltaNet; capture/recompute.py): ``rollout`` sweeps rows through each mixer's gates, one block of output
tokens at a time, and equals the dense route."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.core import mixers as ops

from ..zoo import decoder

# Sweeps of many row blocks through tiny mixers (and models): left out of `make test-fast`.
pytestmark = pytest.mark.slow


def _inputs(n: int, pad: int = 3) -> dict:
    ids = torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, n - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("model_type", ["mamba2", "bamba"])
@pytest.mark.parametrize("opts", [{}, {"residual_mode": "renorm"}, {"alpha": 0.8, "head_fusion": "max"}])
def test_rollout_rows_only_through_mamba2_mixers_equals_dense(model_type, opts, monkeypatch):
    monkeypatch.setattr(ops.MixerRows, "__init__", _small_blocks(ops.MixerRows.__init__))  # several row blocks
    model, inputs = decoder(model_type), _inputs(70)
    dense = attnroll.explain(model, inputs, method="rollout", attention="dense", sinks="keep", **opts)
    rows = attnroll.explain(model, inputs, method="rollout", sinks="keep", **opts)
    assert rows.options["attention"] == "recompute" and dense.options["attention"] == "dense"
    torch.testing.assert_close(rows.full_row, dense.full_row, atol=1e-6, rtol=0)
    assert rows.full_row[1, -3:].abs().max() == 0
    if not opts:  # row-stochastic layers, blended with the identity: the row keeps its sum
        assert float(rows.full_row[0].sum()) == pytest.approx(1, abs=1e-5)
    layers = attnroll.explain(model, inputs, method="rollout", sinks="keep", return_layers=True, **opts)
    want = attnroll.explain(model, inputs, method="rollout", attention="dense", sinks="keep", return_layers=True,
                            **opts)
    torch.testing.assert_close(layers.extra.get("layers", layers.full_row), want.extra.get("layers", want.full_row),
                               atol=1e-6, rtol=0)


def _small_blocks(init):
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.rows = 16
    return wrapped


def test_other_row_methods_keep_the_dense_route_for_mixers():
    model, inputs = decoder("mamba2"), _inputs(8)
    for method in ("raw", "grad_rollout"):
        assert attnroll.explain(model, inputs, method=method).options["attention"] == "dense"
        with pytest.raises(ValueError, match="rows-only"):
            attnroll.explain(model, inputs, method=method, attention="recompute")


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba", "lfm2", "qwen3_next", "qwen3_5_text",
                                        "olmo_hybrid", "kimi_linear", "recurrent_gemma"])
def test_rollout_rows_only_through_other_mixers_equals_dense(model_type, monkeypatch):
    """Mamba's selective scan (Mamba, Falcon-Mamba, Jamba), LFM2's gated short convolution, the gated DeltaNets
    (Qwen3-Next, Qwen3.5, OLMo-Hybrid), Kimi Linear's KDA and RecurrentGemma's RG-LRU: the rows-only sweep (blocks of 16 rows over 70 tokens, padding in the batch) gives the dense route's
    row, and its layers."""
    monkeypatch.setattr(ops.MixerRows, "__init__", _small_blocks(ops.MixerRows.__init__))
    model, inputs = decoder(model_type), _inputs(70)
    for opts in ({}, {"residual_mode": "renorm", "return_layers": True}):
        dense = attnroll.explain(model, inputs, method="rollout", attention="dense", sinks="keep", **opts)
        rows = attnroll.explain(model, inputs, method="rollout", sinks="keep", **opts)
        assert rows.options["attention"] == "recompute" and dense.options["attention"] == "dense"
        torch.testing.assert_close(rows.full_row, dense.full_row, atol=1e-6, rtol=0)
        torch.testing.assert_close(rows.extra.get("layers", rows.full_row), dense.extra.get("layers", dense.full_row),
                                   atol=1e-6, rtol=0)
        assert rows.full_row[1, -3:].abs().max() == 0


def test_layers_joining_a_mixer_and_attention_take_the_rows_only_route():
    """Falcon-H1's Mamba-2 mixer runs in parallel with attention in one layer (capture/hybrids.py Wiring): rollout
    takes its rows-only form (core.joined, tests/capture/test_wired_rows.py); a method that reads attention rows
    keeps the dense route, attention="recompute" says why."""
    model, inputs = decoder("falcon_h1"), _inputs(8)
    assert attnroll.explain(model, inputs, method="rollout").options["attention"] == "recompute"
    with pytest.raises(ValueError, match="method 'raw'.*token mixers"):
        attnroll.explain(model, inputs, method="raw", attention="recompute")
