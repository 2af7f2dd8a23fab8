"""attnroll.viz: sizes, that pixels follow the map, self-contained HTML, atomic writes, missing-extra errors."""

import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("PIL")
T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll import viz  # noqa: E402
from attnroll.explain.explanation import Explanation  # noqa: E402


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, num_labels=3, initializer_range=0.3)
    return T.ViTForImageClassification(cfg).eval()


@pytest.fixture(scope="module")
def images():
    return torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def grid_expl(grid):
    g = torch.as_tensor(grid, dtype=torch.float32)[None]
    h, w = g.shape[-2:]
    s = g.reshape(1, h * w)
    return Explanation(scores=s, full_row=torch.cat([torch.zeros(1, 1), s], 1), grid=(h, w), prefix=1, method="m")


def text_expl(tokens, scores, layers=None, heads=None):
    s = torch.tensor([scores], dtype=torch.float32)
    return Explanation(scores=s, full_row=s.clone(), tokens=[tokens], prefix=0, method="rollout", layers=layers,
                       extra={} if heads is None else {"heads": heads})


# ----------------------------------------------------------------------------------------------- overlay
def test_overlay_size_and_hot_patch_is_redder():
    grid = np.zeros((4, 4))
    grid[0, 0] = 1.0
    grey = np.full((32, 32, 3), 128, np.uint8)
    im = viz.overlay(grid_expl(grid), grey, cmap="jet", alpha=0.6, resample="nearest")
    assert im.size == (32, 32) and im.mode == "RGB"
    a = np.asarray(im).astype(int)
    hot, cold = a[:8, :8], a[16:, 16:]
    assert hot[..., 0].mean() > cold[..., 0].mean() + 40
    assert cold[..., 2].mean() > hot[..., 2].mean() + 40
    big = viz.overlay(grid, grey, size=(100, 60))
    assert big.size == (100, 60)


def test_overlay_follows_the_map_and_alpha_zero_is_the_image():
    img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    g1, g2 = np.eye(4), np.fliplr(np.eye(4))
    a1, a2 = (np.asarray(viz.overlay(g, img)) for g in (g1, g2))
    assert np.abs(a1.astype(int) - a2).sum() > 0
    assert np.array_equal(np.asarray(viz.overlay(g1, img, alpha=0.0)), img)
    # channels-first float images (as make_dataset gives) are accepted
    chw = torch.from_numpy(img).permute(2, 0, 1).float() / 255
    assert np.abs(np.asarray(viz.overlay(g1, chw, alpha=0.0)).astype(int) - img).max() <= 1


def test_overlay_outline_drawn_in_colour():
    mask = np.zeros((32, 32), bool)
    mask[8:24, 8:24] = True
    im = np.asarray(viz.overlay(np.zeros((4, 4)), np.zeros((32, 32, 3)), outline=mask, outline_color=(0, 255, 0)))
    assert (im[8, 8:24] == [0, 255, 0]).all() and (im[16, 16] != [0, 255, 0]).any()


def test_overlay_rejects_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        viz.overlay(np.eye(4), np.zeros((8, 8, 3)), alpha=2)
    with pytest.raises(ValueError, match="cmap"):
        viz.overlay(np.eye(4), np.zeros((8, 8, 3)), cmap="no-such-map")
    with pytest.raises(ValueError, match="image"):
        viz.overlay(np.eye(4), np.zeros((8, 8, 5, 2)))


# ------------------------------------------------------------------------------------------------- panel
def test_panel_size_and_content(vit, images):
    E = {k: attnroll.explain(vit, images, method=k) for k in ("rollout", "raw")}
    p = viz.panel(E, images, cell=100, dpi=100)
    assert p.mode == "RGB"
    assert 300 <= p.width <= 320 and 200 <= p.height <= 250  # 3 columns x 2 rows of 100 px + titles
    flipped = {k: Explanation(**{**e.__dict__, "scores": e.scores.flip(-1)}) for k, e in E.items()}
    q = viz.panel(flipped, images, cell=100, dpi=100)
    assert q.size == p.size and np.abs(np.asarray(p).astype(int) - np.asarray(q)).sum() > 0
    one = viz.panel([E["rollout"]], images, indices=[1], outlines=torch.ones(2, 32, 32), row_labels=["x"])
    assert one.height < p.height


# ----------------------------------------------------------------------------------------- layers, heads
def test_plot_layers_image_and_text(vit, images):
    e = attnroll.explain(vit, images, method="rollout", return_layers=True)
    a = viz.plot_layers(e, images[0], index=0, cell=100, dpi=100)
    b = viz.plot_layers(e, images[0], index=1, cell=100, dpi=100)
    assert a.size == b.size and a.width >= 200 and np.abs(np.asarray(a).astype(int) - np.asarray(b)).sum() > 0
    assert viz.plot_layers(e).width >= 200  # no image: plain maps
    t = text_expl(["[CLS]", "a", "b", "[SEP]"], [0.1, 0.5, 0.3, 0.1], layers=torch.rand(3, 1, 4))
    assert viz.plot_layers(t).width > 100
    with pytest.raises(ValueError, match="return_layers=True"):
        viz.plot_layers(attnroll.explain(vit, images, method="rollout"))


def test_plot_heads_from_per_head_rollout_and_raw_attention(vit, images):
    e = attnroll.explain(vit, images, method="per_head_rollout")
    im = viz.plot_heads(e, images[0], index=0, cell=100, dpi=100)
    assert im.width >= 4 * 100 - 10
    rec = attnroll.capture(vit, images)
    raw = viz.plot_heads(rec.attentions[-1], grid=(4, 4), cell=100, dpi=100)
    assert raw.size == im.size
    t = text_expl(["a", "b", "c"], [1, 2, 3], heads=torch.rand(1, 4, 3))
    assert viz.plot_heads(t).height > 50
    with pytest.raises(ValueError, match="per_head_rollout"):
        viz.plot_heads(attnroll.explain(vit, images, method="rollout"))


# -------------------------------------------------------------------------------------------------- text
TOKENS = ["[CLS]", "the", "<b>cat</b>", "&", "naïve", "##ly", "[SEP]"]


def test_tokens_html_is_self_contained_and_holds_every_token():
    import html

    e = text_expl(TOKENS, [0.05, 0.2, 1.0, -0.5, 0.3, 0.1, 0.05])
    page = viz.tokens_html({"first": e, "second": e.normalized("sum")}, title="t")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    low = page.lower()
    for bad in ("http:", "https:", "//", "<script", "src=", "url(", "@import", "<link"):
        assert bad not in low.replace("<!doctype html>", ""), bad
    for tok in TOKENS:
        assert f">{html.escape(tok)}</span>" in page
    assert "<b>cat</b>" not in page  # escaped, not markup
    assert "rgba(49,104,212" in page  # the negative score is blue


def test_tokens_html_drops_padding():
    s = torch.tensor([[0.5, 0.5, 0.0]])
    e = Explanation(scores=s, full_row=s, tokens=[["a", "b", "[PAD]"]], attention_mask=torch.tensor([[1, 1, 0]]))
    assert "[PAD]" not in viz.tokens_html(e)


def test_terminal_tokens():
    from rich.console import Console

    e = text_expl(TOKENS, [0.05, 0.2, 1.0, -0.5, 0.3, 0.1, 0.05])
    t = viz.tokens_text(e)
    assert t.plain == " ".join(TOKENS)
    styles = {str(s.style) for s in t.spans}
    assert len(styles) >= 4
    console = Console(record=True, width=120, color_system="truecolor", force_terminal=True)
    viz.print_tokens(e, console=console)
    assert "naïve" in console.export_text()


# ------------------------------------------------------------------------------------------ files, deps
def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.png"

    def boom(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        viz.atomic_write(target, boom)
    assert list(tmp_path.iterdir()) == []
    viz.atomic_write(target, b"ok")
    assert target.read_bytes() == b"ok" and [p.name for p in tmp_path.iterdir()] == ["out.png"]
    with pytest.raises(OSError):
        viz.atomic_write(target, boom)
    assert target.read_bytes() == b"ok" and [p.name for p in tmp_path.iterdir()] == ["out.png"]


def test_save_image_roundtrip(tmp_path):
    from PIL import Image

    im = viz.overlay(np.eye(4), np.zeros((16, 16, 3)))
    p = viz.save_image(im, tmp_path / "a.png")
    assert Image.open(p).size == (16, 16) and os.listdir(tmp_path) == ["a.png"]


def test_missing_extra_names_viz(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"'viz' extra"):
        viz.plot_heads(torch.rand(2, 5), grid=(2, 2))


def test_grid_map_kinds_on_raw_maps():
    from attnroll.viz.overlay import grid_map

    g = np.array([[0.1, 0.4], [-0.2, 1.5]])
    assert np.allclose(grid_map(g, kind="none"), [[0.1, 0.4], [0.0, 1.0]])  # clipped only: maps can share a scale
    assert np.allclose(grid_map(g, kind="max"), [[0.1 / 1.5, 0.4 / 1.5], [0.0, 1.0]])
    assert np.allclose(grid_map(g, kind="minmax"), (g + 0.2) / 1.7)
    with pytest.raises(ValueError, match="'minmax', 'max' or 'none'"):
        grid_map(g, kind="sum")


# ------------------------------------------------------------------ the Explanation draws through viz
def test_explanation_overlay_and_html_are_the_viz_ones():
    """One colour map, one renderer: Explanation.overlay / to_html give exactly what viz gives."""
    g = torch.tensor([[0.0, 1.0], [0.5, 0.25]])
    e = Explanation(scores=g.reshape(1, 4), full_row=torch.cat([torch.zeros(1, 1), g.reshape(1, 4)], 1), grid=(2, 2),
                    prefix=1, method="m")
    img = np.zeros((16, 16, 3), dtype=np.uint8)
    assert np.array_equal(np.asarray(e.overlay(img, cmap="viridis")), np.asarray(viz.overlay(e, img, cmap="viridis")))
    page = e.to_html(0)
    assert page == viz.explanation_html(e, 0)
    assert page.count("<td") == 4 and f"background:{viz.score_color(1.0)}" in page  # the top cell, full red
