"""Command-line bad input, by class: every option checked before any model is loaded (exit 2),
Ctrl-C / SIGTERM exit codes, third-party warnings as one line, degenerate images."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("click")
pytest.importorskip("matplotlib")
pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from PIL import Image  # noqa: E402

import attnroll.models  # noqa: E402
from attnroll._io import Terminated  # noqa: E402
from attnroll.commands import cli  # noqa: E402

from .test_cli import one_line_error  # noqa: E402


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def picture(tmp_path):
    p = tmp_path / "pic.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(p)
    return p


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if any command loads a model."""
    def load_model(*a, **k):
        raise AssertionError("a model was loaded before the usage error")

    monkeypatch.setattr(attnroll.models, "load_model", load_model)


EARLY = [
    (["explain", "{pic}", "-o", "alpha=abc"], "alpha must be a real number"),
    (["explain", "{pic}", "-o", "alpha=2"], r"alpha must be in"),
    (["explain", "{pic}", "-o", "head_fusion=sum"], "head_fusion must be one of"),
    (["explain", "{pic}", "-o", "return_layers=maybe"], "return_layers must be True or False"),
    (["explain", "{pic}", "-o", "top_k=1.5"], "top_k must be an integer"),
    (["explain", "{pic}", "-m", "flow", "-o", "n_jobs=0"], "n_jobs must be a positive number"),
    (["explain", "{pic}", "--cmap", "nocmap"], "cmap must be a matplotlib colormap name"),
    (["audit", "shapes", "shapes-marker", "-o", "bogus=1"], "has no option 'bogus'"),
    (["audit", "shapes", "shapes-marker", "-o", "alpha=abc"], "alpha must be a real number"),
    (["audit", "shapes", "shapes-marker", "--data", "/no/such/folder"], "--data /no/such/folder: neither"),
    (["evaluate", "-o", "alpha=-1"], "alpha must be in"),
    (["evaluate", "--fill", "abc"], "--fill must be black, mean or a finite number"),
    (["evaluate", "--fill", "nan"], "--fill must be black, mean or a finite number"),
    (["evaluate", "--data", "/no/such/folder"], "neither a folder"),
    (["evaluate", "--data", "{dir}", "--metrics", "pointing"], "need object masks"),
    (["sanity", "-o", "rollout.alpha=x"], "alpha must be a real number"),
    (["sanity", "--data", "/no/such/folder"], "neither a folder"),
]


@pytest.mark.parametrize("args, words", EARLY, ids=[" ".join(a[:1] + a[-2:]) for a, _ in EARLY])
def test_usage_errors_come_before_any_model_is_loaded(no_model, picture, tmp_path, args, words):
    args = [a.format(pic=picture, dir=picture.parent) for a in args] + ["--out", tmp_path / "out"]
    line = one_line_error(run(*args), 2)
    assert words in line, line
    assert not (tmp_path / "out").exists()  # nothing prepared either


@pytest.mark.parametrize("exc, code, words", [(KeyboardInterrupt, 130, "error: interrupted"),
                                              (Terminated, 143, "error: terminated")])
def test_interrupts_have_their_exit_codes(monkeypatch, picture, tmp_path, exc, code, words):
    def load_model(*a, **k):
        raise exc()

    monkeypatch.setattr(attnroll.models, "load_model", load_model)
    line = one_line_error(run("explain", picture, "--out", tmp_path / "out"), code)
    assert line.startswith(words)


def test_a_warning_before_a_failure_is_folded_into_the_one_error_line(monkeypatch, picture, tmp_path):
    def load_model(*a, **k):
        warnings.warn("You are using torch.load with weights_only=True; this is a noisy third-party warning",
                      UserWarning)
        raise ValueError("weights w.pt: not a weights file")

    monkeypatch.setattr(attnroll.models, "load_model", load_model)
    line = one_line_error(run("explain", picture, "--out", tmp_path / "out"), 1)
    assert "not a weights file" in line and "(warnings: You are using torch.load" in line


def test_decompression_bomb_warning_is_one_line_on_success(monkeypatch, picture, tmp_path):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)  # 64x64 = 4096 pixels: above it, below twice it
    res = run("explain", picture, "--model", "shapes", "-m", "rollout", "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("warning: Image size (4096 pixels) exceeds limit") for ln in lines), lines
    assert len(lines) == 1  # the same warning (the image is read twice) is said once


def test_decompression_bomb_warning_joins_a_later_error(monkeypatch, picture, tmp_path):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)
    line = one_line_error(run("explain", picture, "--model", "shapes", "--target", "nope", "--out", tmp_path), 2)
    assert "--target must be" in line and "(warnings: Image size (4096 pixels)" in line


@pytest.mark.parametrize("shape, size, expect", [((1, 400), 16, (16, 1)), ((400, 1), 16, (1, 16)),
                                                 ((3, 2), 16, (11, 16)),
                                                 pytest.param((2, 2), 4096, (4096, 4096), marks=pytest.mark.slow)])
def test_degenerate_images_keep_at_least_one_pixel(tmp_path, shape, size, expect):
    p = tmp_path / "strip.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, shape + (3,), dtype=np.uint8)).save(p)
    res = run("explain", p, "--model", "shapes", "-m", "rollout", "--size", size, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    with Image.open(tmp_path / "out" / "strip.rollout.png") as im:
        assert im.size == expect  # (W, H): the long side is --size, the short one its share, at least 1
