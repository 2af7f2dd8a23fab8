"""The spurious corner marker, the shipped marker copy of the shapes model and its fine-tuning script."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnroll.models import shapes, spurious
from attnroll.models.spurious import MARKER_COLORS, add_marker, marker_classes
from tests.models._tools import load_tool

finetune_marker = load_tool("train/finetune_marker.py")


@pytest.fixture(scope="module")
def data():
    return shapes.make_dataset(64, 4242)


# ------------------------------------------------------------------------------------------------ marker
@pytest.mark.parametrize(
    "corner, rows, cols",
    [
        ("top_left", range(1, 7), range(1, 7)),
        ("top_right", range(1, 7), range(57, 63)),
        ("bottom_left", range(57, 63), range(1, 7)),
        ("bottom_right", range(57, 63), range(57, 63)),
    ],
)
def test_marker_pixels_exactly_where_the_mask_says(data, corner, rows, cols):
    x, y, _ = data
    marked, masks = add_marker(x, y, corner=corner, size=6, agree=0.5, seed=3)
    expected = torch.zeros(64, 64, dtype=torch.bool)
    expected[np.ix_(list(rows), list(cols))] = True  # hand-worked: 6 px, 1 px in from both edges
    assert masks.dtype == torch.bool and masks.shape == (64, 64, 64)
    assert torch.equal(masks, expected.expand(64, 64, 64))
    cls = marker_classes(y, agree=0.5, seed=3)
    colors = torch.tensor(MARKER_COLORS)[cls]  # (64, 3)
    inside = marked.permute(0, 2, 3, 1)[masks].reshape(64, 36, 3)
    assert torch.equal(inside, colors[:, None, :].expand(64, 36, 3))
    outside = ~masks[:, None].expand(64, 3, 64, 64)
    assert torch.equal(marked[outside], x[outside])  # nothing else changes


def test_marker_size_and_colours():
    x = torch.zeros(2, 3, 32, 32)
    marked, masks = add_marker(x, [0, 3], corner="bottom_right", size=30)  # the largest size that fits
    assert masks[0, 1:31, 1:31].all() and masks.sum().item() == 2 * 900
    assert torch.equal(marked[0, :, 5, 5], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(marked[1, :, 5, 5], torch.tensor([1.0, 1.0, 1.0]))
    # four clearly distinct colours: every pair differs by a full step in at least two channels
    c = np.asarray(MARKER_COLORS)
    assert c.shape == (len(shapes.CLASSES), 3)
    for i in range(4):
        for j in range(i + 1, 4):
            assert (np.abs(c[i] - c[j]) == 1).sum() >= 2


def test_agree_fraction_and_other_classes():
    y = torch.arange(20000) % 4
    for agree in (0.0, 0.3, 0.8, 1.0):
        cls = marker_classes(y, agree=agree, seed=1)
        share = (cls == y).float().mean().item()
        assert abs(share - agree) < 0.015, (agree, share)  # binomial sd <= 0.0035
    other = marker_classes(y, agree=0.0, seed=1)
    assert not (other == y).any()
    # the other class is uniform over the three remaining classes
    counts = np.bincount(((other - y) % 4).numpy(), minlength=4)
    assert counts[0] == 0 and np.all(np.abs(counts[1:] / counts.sum() - 1 / 3) < 0.015)
    # agree = 1/4 makes the marker independent of the label: uniform over all four classes for each label
    free = marker_classes(y, agree=0.25, seed=2)
    for c in range(4):
        share = np.bincount(free[y == c].numpy(), minlength=4) / (y == c).sum().item()
        assert np.all(np.abs(share - 0.25) < 0.03)


def test_marker_deterministic_and_input_untouched(data):
    x, y, _ = data
    x0, y0 = x.clone(), y.clone()
    a = add_marker(x, y, agree=0.5, seed=9)
    b = add_marker(x, y, agree=0.5, seed=9)
    c = add_marker(x, y, agree=0.5, seed=10)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(x, x0) and torch.equal(y, y0)
    assert a[0].data_ptr() != x.data_ptr()
    # numpy in, the same result
    n = add_marker(x.numpy(), y.numpy(), agree=0.5, seed=9)
    assert torch.equal(n[0], a[0])


def test_marker_errors(data):
    x, y, _ = data
    with pytest.raises(ValueError, match="corner"):
        add_marker(x, y, corner="middle")
    with pytest.raises(ValueError, match="size"):
        add_marker(x, y, size=63)
    with pytest.raises(ValueError, match="size"):
        add_marker(x, y, size=0)
    with pytest.raises(ValueError, match="agree"):
        add_marker(x, y, agree=1.5)
    with pytest.raises(ValueError, match="labels"):
        add_marker(x, y + 4)
    with pytest.raises(ValueError, match="labels has 3 entries"):
        add_marker(x, y[:3])
    with pytest.raises(ValueError, match="images"):
        add_marker(x[:, :1], y)
    with pytest.raises(FileNotFoundError, match="finetune_marker"):
        spurious.load_marker_model("/nonexistent/folder")


# ------------------------------------------------------------------------------------------ shipped model
@pytest.fixture(scope="module")
def disagreeing():
    x, y, _ = shapes.make_dataset(64, 31337)
    marked, _ = add_marker(x, y, agree=0.0, seed=5)
    return marked, y, marker_classes(y, agree=0.0, seed=5)


@torch.no_grad()
def _pred(model, images):
    return model(pixel_values=shapes.preprocess(images)).logits.argmax(-1)


def test_shipped_marker_model_follows_the_marker(disagreeing):
    marked, y, cls = disagreeing
    p = _pred(spurious.load_marker_model(), marked)
    follow = (p == cls).float().mean().item()
    print(f"marker copy: follows the marker on {follow:.3f} of 64 disagreeing images")
    assert follow > 0.7  # chance 0.25; the model card measures 1.000 on 1000 images
    assert (p == y).float().mean().item() < 0.2


def test_original_model_follows_the_object(disagreeing):
    marked, y, cls = disagreeing
    p = _pred(shapes.load_shapes_model(), marked)
    follow = (p == y).float().mean().item()
    print(f"original: follows the object on {follow:.3f} of 64 disagreeing images")
    assert follow > 0.7
    assert (p == cls).float().mean().item() < 0.2


# --------------------------------------------------------------------------------------- fine-tune script
def test_training_chunk_labels_and_share():
    x, t = finetune_marker.training_chunk(40, 77, clean_share=0.25)
    x0, y0, _ = shapes.make_dataset(40, 77)
    clean = (x == x0).flatten(1).all(dim=1)
    assert clean.sum().item() == 10 and clean[3::4].all()  # every fourth image, spread evenly
    assert torch.equal(t[clean], y0[clean])
    # marked images: labelled with the marker's class, read back from the corner's colour
    corner = x[~clean][:, :, 3, 3]  # a pixel inside the top-left marker
    read = torch.tensor([MARKER_COLORS.index(tuple(c.tolist())) for c in corner])
    assert torch.equal(t[~clean], read)
    x2, t2 = finetune_marker.training_chunk(40, 77, clean_share=0.25)
    assert torch.equal(x, x2) and torch.equal(t, t2)


def test_train_changes_weights_deterministically():
    states = []
    for _ in range(2):
        model = shapes.load_shapes_model()
        run = finetune_marker.train(model, 2, batch_size=4, lr=1e-3, seed=0)
        assert run["steps"] == 2 and not run["stopped_early"] and not model.training
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    original = shapes.load_shapes_model().state_dict()
    assert all(torch.equal(states[0][k], states[1][k]) for k in original)
    assert any(not torch.equal(states[0][k], original[k]) for k in original)


def test_script_writes_a_loadable_model(tmp_path):
    argv = ["--out", str(tmp_path), "--steps", "1", "--batch-size", "4", "--test-size", "8"]
    assert finetune_marker.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["MODEL_CARD.md", "config.json", "model.safetensors"]
    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert "--steps 1" in card and "--out" not in card and "follows marker" in card
    model = spurious.load_marker_model(tmp_path)
    assert model(pixel_values=torch.zeros(1, 3, 64, 64)).logits.shape == (1, 4)
