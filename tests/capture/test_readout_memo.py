"""``Readout.positions`` remembered per weights tensor and version (an in-place change or a new tensor is seen),
and ``resolve_readout`` building the real-token mask only where it weights by it (a caller's float mask is
never written)."""

from __future__ import annotations

import torch

from attnroll.capture.readout import Readout, resolve_readout


def _naive_positions(w: torch.Tensor):
    rows = [[i for i, v in enumerate(r) if v != 0] for r in w.tolist()]
    return [r[0] for r in rows] if all(len(r) == 1 for r in rows) else None


def test_positions_follow_in_place_changes_and_new_tensors():
    w = torch.zeros(3, 5)
    w[torch.arange(3), torch.tensor([0, 2, 4])] = 1
    ro = Readout("position", w)
    got = ro.positions()
    assert got == _naive_positions(w) == [0, 2, 4]
    got.append(99)  # the caller's list is its own
    assert ro.positions() == [0, 2, 4]
    w[1] = 0.2  # in place: example 1 is no longer one-hot
    assert ro.positions() is None is _naive_positions(w)
    ro.weights = torch.eye(5)[[3, 3, 1]]
    assert ro.positions() == [3, 3, 1] == _naive_positions(ro.weights)
    assert ro.describe()["positions"] == [3, 3, 1]


def test_mean_readout_leaves_a_float_mask_as_it_was():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])
    kept = mask.clone()
    ro = resolve_readout("mean", batch=2, n=4, mask=mask, prefix=1)
    assert torch.equal(mask, kept)
    assert torch.allclose(ro.weights, torch.tensor([[0, 0.5, 0.5, 0], [0, 1 / 3, 1 / 3, 1 / 3]]))
    cls = resolve_readout("cls", batch=2, n=4, mask=mask)
    assert torch.equal(cls.weights, torch.tensor([[1.0, 0, 0, 0], [1, 0, 0, 0]])) and cls.positions() == [0, 0]


def test_positions_of_inference_tensors_are_computed_each_time():
    with torch.inference_mode():
        ro = resolve_readout([1, 3], batch=2, n=4, mask=None)
        assert ro.positions() == [1, 3]
        ro.weights[0] = 0.25  # in place, still inside inference mode: no version counter to see it by
        assert ro.positions() is None
