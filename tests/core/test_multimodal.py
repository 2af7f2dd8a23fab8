"""core.multimodal: a hand-worked composition of a language row with a vision rollout, and the refusals."""

from __future__ import annotations

import pytest
import torch

from attnroll.core import multimodal as mm

# One prompt [t0, img0, img1, t3]; one image of 3 vision tokens [CLS, p1, p2]; img0 is p1, img1 is p2.
ROW = torch.tensor([[0.1, 0.3, 0.2, 0.4]])
LINK = dict(example=torch.tensor([0, 0]), position=torch.tensor([1, 2]), item=torch.tensor([0, 0]),
            token=torch.tensor([1, 2]))
R_V = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6]])


def test_hand_worked_composition():
    W = mm.source_weights(ROW, **LINK, n_items=1, n_source=3)
    assert torch.allclose(W, torch.tensor([[0.0, 0.3, 0.2]]))
    weights, totals = mm.split_mass(W)
    assert torch.allclose(weights, torch.tensor([[0.0, 0.6, 0.4]])) and torch.allclose(totals, torch.tensor([0.5]))
    # weights @ R_v = 0.6·[.2, .5, .3] + 0.4·[.1, .3, .6] = [.16, .42, .42]; times the image share 0.5:
    M = mm.push_through(weights @ R_V, totals)
    assert torch.allclose(M, torch.tensor([[0.08, 0.21, 0.21]]))
    text = mm.unlinked(ROW, LINK["example"], LINK["position"])
    assert torch.allclose(text, torch.tensor([[0.1, 0.0, 0.0, 0.4]]))
    assert torch.allclose(M.sum() + text.sum(), ROW.sum())  # image share + text share = the row's total


def test_push_through_reads_relevance_rows_as_distributions():
    # A gradient relevance row summing to 0.8 is rescaled to the image's share 0.4; a zero row stays zero.
    M = mm.push_through(torch.tensor([[0.2, 0.6], [0.0, 0.0]]), torch.tensor([0.4, 0.3]))
    assert torch.allclose(M, torch.tensor([[0.1, 0.3], [0.0, 0.0]]))


def test_an_image_without_share_gets_uniform_weights_and_total_zero():
    weights, totals = mm.split_mass(torch.tensor([[0.0, 0.0], [1.0, 3.0]]))
    assert torch.allclose(weights, torch.tensor([[0.5, 0.5], [0.25, 0.75]]))
    assert torch.allclose(totals, torch.tensor([0.0, 4.0]))


def test_repeated_image_tokens_accumulate():
    W = mm.source_weights(torch.tensor([[0.5, 0.25, 0.25]]), torch.tensor([0, 0]), torch.tensor([1, 2]),
                          torch.tensor([0, 0]), torch.tensor([0, 0]), 1, 2)
    assert torch.allclose(W, torch.tensor([[0.5, 0.0]]))


def test_images_are_assigned_to_their_prompts():
    owners = mm.item_examples(torch.tensor([1, 1, 0]), torch.tensor([0, 0, 2]), 3)
    assert owners == [1, None, 0]
    out = mm.per_example(torch.tensor([[1.0, 2.0], [5.0, 5.0], [3.0, 4.0]]), owners, 3)
    assert torch.equal(out, torch.tensor([[3.0, 4.0], [1.0, 2.0], [0.0, 0.0]]))


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="prompts 0 and 1"):
        mm.item_examples(torch.tensor([0, 1]), torch.tensor([0, 0]), 1)
    with pytest.raises(ValueError, match="prompt 0 holds images 0 and 1"):
        mm.per_example(torch.zeros(2, 3), [0, 0], 1)
    with pytest.raises(ValueError, match="inside the row"):
        mm.source_weights(ROW, torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), torch.tensor([0]), 1, 3)
    with pytest.raises(ValueError, match=r"inside \(1, 3\)"):
        mm.source_weights(ROW, torch.tensor([0]), torch.tensor([1]), torch.tensor([0]), torch.tensor([3]), 1, 3)
    with pytest.raises(ValueError, match="one length"):
        mm.source_weights(ROW, torch.tensor([0, 0]), torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), 1, 3)
    with pytest.raises(ValueError, match="row must be"):
        mm.source_weights(ROW[0], **LINK, n_items=1, n_source=3)
