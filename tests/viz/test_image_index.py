"""One image over a batched Explanation: which example's map it gets must be said (``index=``), never guessed.
Example 0's map drawn over the picture of example 2 looked right and was wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
from attnroll import viz  # noqa: E402
from attnroll.explain.explanation import Explanation  # noqa: E402


def expl(B):
    g = torch.Generator().manual_seed(B)
    s = torch.rand(B, 4, generator=g)
    return Explanation(scores=s, full_row=torch.cat([torch.zeros(B, 1), s], 1), grid=(2, 2), prefix=1,
                       method="rollout", layers=torch.rand(2, B, 5, generator=g),
                       extra={"heads": torch.rand(B, 3, 5, generator=g)})


IMG = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)

CALLS = {
    "overlay": lambda e, **k: viz.overlay(e, IMG, **k),
    "Explanation.overlay": lambda e, **k: e.overlay(IMG, **k),
    "plot_layers": lambda e, **k: viz.plot_layers(e, IMG, cell=32, **k),
    "plot_heads": lambda e, **k: viz.plot_heads(e, IMG, cell=32, **k),
    "plot_heads(array)": lambda e, **k: viz.plot_heads(e.extra["heads"], IMG, grid=(2, 2), cell=32, **k),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_batch_and_one_image_need_an_index(name):
    with pytest.raises(ValueError, match=r"holds 3 examples and one image is given: pass index= \(0 to 2\)"):
        CALLS[name](expl(3))


@pytest.mark.parametrize("name", CALLS)
def test_the_index_picks_that_examples_map(name):
    """index=2 draws example 2: the same picture as the one-example Explanation cut out of the batch."""
    e = expl(3)
    cut = Explanation(scores=e.scores[2:], full_row=e.full_row[2:], grid=(2, 2), prefix=1, method="rollout",
                      layers=e.layers[:, 2:], extra={"heads": e.extra["heads"][2:]})
    want = np.asarray(CALLS[name](cut))  # one example: no index needed
    assert np.array_equal(np.asarray(CALLS[name](e, index=2)), want)
    assert not np.array_equal(np.asarray(CALLS[name](e, index=0)), want)


def test_overlay_of_a_plain_map_needs_no_index():
    assert viz.overlay(np.eye(4), IMG).size == (16, 16)


def test_panel_refuses_images_that_do_not_match_the_examples():
    e = expl(3)
    imgs = np.stack([IMG] * 3)
    for wrong in (imgs[:1], imgs[:2]):
        with pytest.raises(ValueError, match=r"has 3 examples, images has \d: give the images the explanation"):
            viz.panel(e, wrong, cell=32)
        with pytest.raises(ValueError, match=r"has 3 examples"):
            viz.panel(e, wrong, indices=[0], cell=32)
    assert viz.panel(e, imgs, indices=[2], cell=32).size[0] > 0
