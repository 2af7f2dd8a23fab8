"""``clip``'s pairing reads each tower's input key from the adapter contract (ModelFacts.stream_inputs), not
from fixed key names."""

from __future__ import annotations

import pytest
import torch

from attnroll.capture import model_facts
from attnroll.methods import explain

from ..zoo import sharp as M


def test_clip_pairs_use_the_towers_input_keys_from_the_adapter():
    m = M.model("clip")
    assert model_facts(m).stream_inputs == {"vision": "pixel_values", "text": "input_ids"}
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    one_image = explain(m, {"pixel_values": torch.randn(1, 3, 32, 32), "input_ids": ids}, "clip")
    assert one_image.scores.shape[0] == 2  # one image repeated for the two texts, under the adapter's key
    with pytest.raises(ValueError, match="needs inputs with pixel_values and input_ids"):
        explain(m, {"input_ids": ids}, "clip")


def test_clip_refuses_a_single_tower_model_naming_its_family():
    assert model_facts(M.model("bert")).stream_inputs == {}
    with pytest.raises(ValueError, match=r"dual-tower image-text model; this one \(hf:bert\)"):
        explain(M.model("bert"), M.inputs_for("bert"), "clip")
