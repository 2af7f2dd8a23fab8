"""A Mamba-2 mixer's SSD gates read off its own in_proj output (capture/mixers.py ``InProjTap``) equal the gates
recomputed from its input (``mamba2_gates`` without ``projected``), for every Mamba-2 family the rows-only route
takes; where the projection's input is not what the gates project (padding the mixer leaves unmasked) the tap
gives nothing and the gates are recomputed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnroll
from attnroll.capture import mixers as cm

from ..zoo import decoder

FAMILIES = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid")


def _mixer(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if type(m).__name__ in cm.MAMBA2_MIXERS)


def _both(model, inputs) -> tuple[list, list, list]:
    """(gates from the tap, gates recomputed, the taken projection or None) on each pass of the first mixer."""
    mixer, tapped, again, taken = _mixer(model), [], [], []
    tap = cm.InProjTap(mixer)

    def hook(m, a, k, o):
        hidden, mask = cm._hook_inputs(a, k)
        projected = tap.take(hidden, mask)
        taken.append(projected)
        tapped.append(cm.mamba2_gates(m, hidden, mask, projected))
        again.append(cm.mamba2_gates(m, hidden, mask))

    handle = mixer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
        tap.remove()
    return tapped, again, taken


def _inputs(b: int, n: int, pad: int) -> dict:
    ids = torch.randint(3, 99, (b, n), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if pad:
        mask[-1, n - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tapped_gates_equal_the_recomputed_ones(family, dtype):
    if family == "granitemoehybrid" and dtype == torch.float64:
        pytest.skip("its experts' grouped product takes no float64")
    model = decoder(family).to(dtype)
    for inputs in (_inputs(1, 19, 0), _inputs(2, 19, 4)):  # one row; a padded batch (the forward masks it)
        tapped, again, taken = _both(model, inputs)
        assert tapped and all(p is not None for p in taken), "the tap kept no projection"
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        for g, want, p in zip(tapped, again, taken):
            assert g.z.data_ptr() == p.data_ptr()  # read off the kept projection, not recomputed
            for f in dataclasses.fields(cm.SSDGates):
                got, ref = getattr(g, f.name), getattr(want, f.name)
                assert got.shape == ref.shape, f.name
                torch.testing.assert_close(got, ref, atol=tol, rtol=tol, msg=f.name)


def test_unmasked_padding_falls_back_to_recomputing(monkeypatch):
    """A mixer that leaves the padding unmasked before its in_proj (the gates mask it): the tap declines."""
    import importlib

    mod = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    monkeypatch.setattr(mod, "apply_mask_to_padding_states", lambda h, mask: h)
    model = decoder("mamba2").double()
    tapped, again, taken = _both(model, _inputs(1, 15, 5))
    assert taken == [None]
    for f in dataclasses.fields(cm.SSDGates):
        assert torch.equal(getattr(tapped[0], f.name), getattr(again[0], f.name)), f.name
    _, _, taken = _both(model, _inputs(1, 15, 0))  # nothing padded: the unmasked projection is the one wanted
    assert taken[0] is not None


def test_tap_refuses_mixers_outside_the_mamba2_layout():
    model = decoder("falcon_h1")  # its in_proj output is scaled by μP multipliers after the projection
    mixer = next(m for m in model.modules() if type(m).__name__ == "FalconH1Mixer")
    tap = cm.InProjTap(mixer)
    with torch.no_grad():
        model(**_inputs(1, 9, 0))
    assert tap.take(torch.zeros(1, 9, model.config.hidden_size), None) is None
    tap.remove()


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_rows_only_rollout_is_unchanged_by_the_tap(family, monkeypatch):
    model, inputs = decoder(family), _inputs(2, 40, 3)
    used = []
    take = cm.InProjTap.take
    monkeypatch.setattr(cm.InProjTap, "take", lambda self, h, m: used.append(take(self, h, m)) or used[-1])
    got = attnroll.explain(model, inputs, method="rollout", sinks="keep")
    assert got.options["attention"] == "recompute" and used and all(p is not None for p in used)
    monkeypatch.setattr(cm.InProjTap, "take", lambda self, h, m: None)  # the recomputing fallback
    want = attnroll.explain(model, inputs, method="rollout", sinks="keep")
    torch.testing.assert_close(got.full_row, want.full_row, atol=1e-7, rtol=0)
