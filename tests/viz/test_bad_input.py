"""The figure functions validate their integer, boolean and weight arguments through the shared checkers:
a float where an index or a size belongs, a string for a flag, an alpha outside [0, 1]."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
from attnroll import viz  # noqa: E402
from attnroll.explain.explanation import Explanation  # noqa: E402


def expl(B=2, h=2, w=2, L=2):
    g = torch.Generator().manual_seed(0)
    s = torch.rand(B, h * w, generator=g)
    return Explanation(scores=s, full_row=torch.cat([torch.zeros(B, 1), s], 1), grid=(h, w), prefix=1,
                       method="rollout", layers=torch.rand(L, B, 1 + h * w, generator=g),
                       extra={"heads": torch.rand(B, 3, 1 + h * w, generator=g)})


IMG = np.zeros((2, 16, 16, 3), np.uint8)
CASES = [
    (lambda: viz.panel(expl(), IMG, indices=[1.5]), TypeError, r"indices\[0\] must be an integer"),
    (lambda: viz.panel(expl(), IMG, indices=[2]), ValueError, r"indices\[0\]=2 is out of range for 2 images"),
    (lambda: viz.panel(expl(), IMG, show_input="no"), TypeError, "show_input must be True or False"),
    (lambda: viz.panel(expl(), IMG, cell=0), ValueError, r"cell must be in \[1, inf\]"),
    (lambda: viz.panel(expl(), IMG, alpha=1.5), ValueError, "alpha must be in"),
    (lambda: viz.plot_layers(expl(), IMG[0], cell=12.5), TypeError, "cell must be an integer"),
    (lambda: viz.plot_layers(expl(), IMG[0], max_cols=0), ValueError, "max_cols must be in"),
    (lambda: viz.plot_heads(expl(), IMG[0], dpi="100"), TypeError, "dpi must be an integer"),
    (lambda: viz.plot_heads(expl(), IMG[0], alpha=-0.5), ValueError, "alpha must be in"),
    (lambda: viz.overlay(expl(), IMG[0], size=0), ValueError, r"size must be in \[1, inf\]"),
    (lambda: viz.overlay(expl(), IMG[0], size=(16, 1.5)), TypeError, r"size\[1\] must be an integer"),
    (lambda: viz.overlay(expl(), IMG[0], index=2), ValueError, r"index=2 is out of range for 2 examples"),
    (lambda: viz.tokens_html(expl(), index=0.0), TypeError, "index must be an integer"),
]


@pytest.mark.parametrize("call, exc, pattern", CASES, ids=[p for _, _, p in CASES])
def test_figure_arguments_are_checked(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_integer_like_values_are_accepted_as_ints():
    a = viz.overlay(expl(), IMG[0], index=np.int64(1), size=(np.int32(8), 8))
    b = viz.overlay(expl(), IMG[0], index=1, size=(8, 8))
    assert np.array_equal(np.asarray(a), np.asarray(b)) and a.size == (8, 8)
    p1 = viz.panel(expl(), IMG, indices=np.array([1, 0]), show_input=np.bool_(False), cell=32)
    p2 = viz.panel(expl(), IMG, indices=[1, 0], show_input=False, cell=32)
    assert np.array_equal(np.asarray(p1), np.asarray(p2))
