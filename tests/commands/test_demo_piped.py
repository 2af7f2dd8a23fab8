"""``attnroll demo`` with its output piped (not a terminal): the token maps are written with their numbers."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("click")
pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402

from attnroll.commands import cli  # noqa: E402


@pytest.mark.slow
def test_piped_demo_writes_tokens_with_their_scores(tmp_path, monkeypatch):
    from attnroll.models import shapes

    torch.manual_seed(0)
    model = shapes.build_model(shapes.shapes_config(hidden_size=32, num_layers=2, num_heads=4)).eval()
    monkeypatch.setattr(shapes, "load_shapes_model", lambda *a, **k: model)
    res = CliRunner().invoke(cli, ["demo", "--out", str(tmp_path), "--images", "1", "--methods", "rollout"])
    assert res.exit_code == 0, res.output
    if "skipped the text page" in res.output:
        pytest.skip("the text extra's MiniLM is not installed")
    lines = [ln for ln in res.output.splitlines() if re.search(r"\S\(-?\d\.\d\d\)", ln)]
    assert len(lines) == 2  # both sentences of the pair, every token with its score
    for ln in lines:
        scores = [float(v) for v in re.findall(r"\((-?\d\.\d\d)\)", ln)]
        assert len(scores) >= 5 and max(abs(s) for s in scores) == 1.0  # scaled to the largest |score|
