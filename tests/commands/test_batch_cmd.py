"""``attnroll batch`` through click's runner: the summary and exit codes, failures, refusing to mix runs,
overlays, and one-line usage errors."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("click")
pytest.importorskip("pyarrow")
from PIL import Image  # noqa: E402

from attnroll.batch import read_batch, read_failures, row_explanation  # noqa: E402

from ..batch.helpers import write_shapes  # noqa: E402
from .test_cli import one_line_error, run  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    write_shapes(root, 6)
    (root / "deeper" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    return root


def test_summary_failures_exit_code_and_resume(folder, tmp_path):
    out = tmp_path / "o"
    res = run("batch", folder, "--out", out, "-m", "rollout,raw", "--batch-size", "4")
    assert res.exit_code == 3, res.output  # completed, one input failed
    line = res.stdout.strip().splitlines()[-1]
    assert line.startswith("7 inputs: 7 explained now") and "1 failed, 12 rows" in line
    assert list(read_failures(out)["id"]) == ["deeper/corrupt.jpg"]
    assert sorted(set(read_batch(out)["method"])) == ["raw", "rollout"]
    again = run("batch", folder, "--out", out, "-m", "rollout,raw", "--batch-size", "4")
    assert again.exit_code == 3 and "(7 done before): 0 explained now" in again.stdout
    assert len(read_batch(out)) == 12


def test_a_different_run_is_refused_then_overwritten(folder, tmp_path):
    out = tmp_path / "o"
    assert run("batch", folder, "--out", out).exit_code == 3
    msg = one_line_error(run("batch", folder, "--out", out, "-o", "alpha=0.8"), 2)
    assert "different run (options:" in msg and "--overwrite" in msg
    res = run("batch", folder, "--out", out, "-o", "alpha=0.8", "--overwrite")
    assert res.exit_code == 3 and '"alpha": 0.8' in read_batch(out)["options"][0]


def test_png_overlays_are_each_rows_map_over_its_image(folder, tmp_path):
    from attnroll import viz

    out = tmp_path / "o"
    assert run("batch", folder, "--out", out, "-m", "gae", "--png").exit_code == 3
    df = read_batch(out)
    assert len(df) == 6
    for _, row in df.iterrows():
        png = out / "png" / f"{row['id']}.gae.png"
        want = viz.overlay(row_explanation(row), Image.open(folder / row["id"]).convert("RGB"))
        assert np.array_equal(np.asarray(Image.open(png)), np.asarray(want))


def test_usage_errors_are_one_line(folder, tmp_path):
    assert "unknown ['nope']" in one_line_error(run("batch", folder, "--out", tmp_path / "o", "-m", "nope"), 2)
    msg = one_line_error(run("batch", folder, "--out", tmp_path / "o", "--num-workers", "2"), 2)
    assert "for --engine ray" in msg
    (tmp_path / "notes.docx").write_text("x")
    assert "unsupported file type '.docx'" in one_line_error(run("batch", tmp_path / "notes.docx", "--out", tmp_path / "o"), 2)
    msg = one_line_error(run("batch", folder, "--out", tmp_path / "o", "-o", "alpah=1"), 2)
    assert "none of the methods ['rollout'] takes alpah" in msg
    assert not (tmp_path / "o").exists()


def test_ray_engine_without_ray_says_how_to_install(folder, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    msg = one_line_error(run("batch", folder, "--out", tmp_path / "o", "--engine", "ray"), 1)
    assert "pip install 'attnroll[ray]'" in msg
