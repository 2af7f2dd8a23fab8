"""``evaluate --maps`` and ``audit`` of batch outputs made from a CSV / Parquet table: the images are the
paths the batch recorded (the table's column, relative to the table), not ``source/id``; the scores equal
those of the same images explained again."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("click")
pytest.importorskip("pyarrow")
from PIL import Image  # noqa: E402

from ..batch.helpers import to_uint8  # noqa: E402
from .test_cli import run  # noqa: E402


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """8 shapes images listed by a CSV with ids that are no paths, batch outputs of two models from it."""
    from attnroll.models import shapes

    root = tmp_path_factory.mktemp("tab")
    (root / "imgs").mkdir()
    images, _, _ = shapes.make_dataset(8, 21)
    lines = ["id,path"]
    for i, im in enumerate(images):
        Image.fromarray(to_uint8(im)).save(root / "imgs" / f"x{i}.png")
        lines.append(f"Sample #{i},imgs/x{i}.png")
    (root / "t.csv").write_text("\n".join(lines) + "\n")
    for name, model in (("a", "shapes"), ("b", "shapes-marker")):
        res = run("batch", root / "t.csv", "--column", "path", "--out", root / name, "-m", "rollout,gae",
                  "--model", model)
        assert res.exit_code == 0, res.output
    return root


def _json(path):
    return json.loads(path.read_text())


@pytest.mark.slow  # over a second
def test_evaluate_maps_of_a_table_batch_reads_the_recorded_image_paths(tables, tmp_path):
    common = ["--metrics", "deletion,positive", "--steps", "8"]
    res = run("evaluate", "--maps", tables / "a", "--out", tmp_path / "m", *common)
    assert res.exit_code == 0, res.output
    ref = run("evaluate", "--data", tables / "imgs", "--methods", "rollout,gae", "--out", tmp_path / "r", *common)
    assert ref.exit_code == 0, ref.output
    got, want = _json(tmp_path / "m" / "evaluation.json"), _json(tmp_path / "r" / "evaluation.json")
    assert got["n"] == want["n"] == 8
    for a, b in zip(got["rows"], want["rows"]):
        for k in ("deletion", "positive"):
            assert a[k] == pytest.approx(b[k], abs=1e-6)


@pytest.mark.slow  # over a second
def test_audit_of_two_table_batches_reads_the_recorded_image_paths(tables, tmp_path):
    res = run("audit", tables / "a", tables / "b", "-m", "gae", "--format", "png", "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    ref = run("audit", "shapes", "shapes-marker", "--data", tables / "imgs", "-m", "gae", "--format", "png",
              "--out", tmp_path / "r")
    assert ref.exit_code == 0, ref.output
    got, want = _json(tmp_path / "m" / "audit.json"), _json(tmp_path / "r" / "audit.json")
    np.testing.assert_allclose(got["js"], want["js"], atol=1e-6)
