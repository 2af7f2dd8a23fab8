"""Image splitting put back on the user's image (capture/vlm_split.py): Idefics3 / SmolVLM tiles (the image
processor's own rows / cols) and InternVL / Aya Vision crops (recomputed from image_sizes), on tiny random
configs and the processors' own tiles of an image whose pixels are their coordinates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll

from .test_vlm import eager_copy
from .test_vlm_families import IMG, build, dependence, naive_rollout, vision_call

# Tiny multi-part models (VLMs, hybrids, token mixers, mixtures of experts): left out of `make test-fast`.
pytestmark = pytest.mark.slow

T = pytest.importorskip("transformers")

H0, W0 = 45, 100
SPLIT = ["idefics3", "smolvlm", "internvl", "aya_vision"]


def coordinate_image():
    """(3, H0, W0): channel 0 = x, channel 1 = y (pixel centres, in [0, 1]), channel 2 = 1."""
    yy, xx = torch.meshgrid((torch.arange(H0) + 0.5) / H0, (torch.arange(W0) + 0.5) / W0, indexing="ij")
    return torch.stack([xx, yy, torch.ones(H0, W0)])


def split_inputs(name, image=None, extra=10):
    """The processor's own split of the image; the prompt holds 16 image tokens per view."""
    image = coordinate_image() if image is None else image
    if name in ("idefics3", "smolvlm"):
        proc = T.Idefics3ImageProcessor(size={"longest_edge": 96}, max_image_size={"longest_edge": 32},
                                        do_image_splitting=True, do_rescale=False, do_normalize=False)
        out = dict(proc(images=[[image]], return_tensors="pt", return_row_col_info=True))
        views = out["pixel_values"].shape[1]
    else:
        proc = T.GotOcr2ImageProcessor(size={"height": 32, "width": 32}, crop_to_patches=True, min_patches=1,
                                       max_patches=8, do_rescale=False, do_normalize=False)
        out = dict(proc(images=[image], return_tensors="pt"))
        views = int(out.pop("num_patches")[0])
        out["image_sizes"] = torch.tensor([[H0, W0]])
    n = 16 * views
    ids = torch.randint(3, 99, (1, n + extra), generator=torch.Generator().manual_seed(1))
    ids[0, 2:2 + n] = IMG
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **out}


def views_of(inp):
    px = inp["pixel_values"]
    return px.flatten(0, 1) if px.ndim == 5 else px


@pytest.mark.parametrize("name", SPLIT)
def test_split_tiles_round_trip_to_the_original_image(name):
    """Each tile patch lands on the one canvas cell that holds the original-image point its pixels came from;
    a global-view patch's largest share on the cell under its centre; CLS on slot 0."""
    model = build(name)
    inp = split_inputs(name)
    P = attnroll.capture(model, inp).info["language"].link.placement
    px = views_of(inp)
    first = 1 if name == "internvl" else 0
    k = px.shape[0]
    Hc, Wc = P.grid
    assert k > 2 and (Hc // 8) * (Wc // 8) == k - 1 and Wc > Hc
    for i in range(k):
        for r in range(8):
            for c in range(8):
                patch = px[i, :, 4 * r:4 * r + 4, 4 * c:4 * c + 4]
                sel = (P.item == i) & (P.token == first + r * 8 + c)
                cells, w = P.cell[sel], P.weight[sel]
                assert float(w.sum()) == pytest.approx(1.0, abs=1e-6)
                x, y = float(patch[0].mean()), float(patch[1].mean())
                want = 1 + min(int(y * Hc), Hc - 1) * Wc + min(int(x * Wc), Wc - 1)
                if i == k - 1:
                    assert float(w[cells == want].sum()) == pytest.approx(float(w.max()), abs=1e-6)
                else:
                    assert cells.tolist() == [want]
    if first:
        assert P.cell[P.token == 0].unique().tolist() == [0]


@pytest.mark.parametrize("name", SPLIT)
def test_split_streams_map_and_shares(name):
    """The vision stream is the views' own eager attention; the canvas map is the naive composition (language
    row -> image tokens -> the vision tokens each depends on, found by perturbing them -> per-view rollout) put through the placement;
    image + text shares add to 1; the map changes with the image."""
    model = build(name)
    inp = split_inputs(name)
    rec = attnroll.capture(model, inp)
    ref = eager_copy(model)
    with torch.no_grad():
        vision = vision_call(ref, inp).attentions
        lang = ref(**inp, output_attentions=True).attentions
    for a, b in zip(rec.streams["vision"], vision):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    for a, b in zip(rec.streams["language"], lang):
        assert torch.allclose(a, b, atol=1e-5)
    e = attnroll.explain(model, inp, "rollout")
    link = rec.info["language"].link
    row = naive_rollout([t[0].double().numpy() for t in lang])[-1]
    positions = [p for p in range(row.shape[0]) if int(inp["input_ids"][0, p]) == IMG]
    first = 1 if name == "internvl" else 0
    N, n_v = vision[0].shape[0], vision[0].shape[-1]
    dep = dependence(model, inp).double().numpy()  # the model's own: which vision tokens each feature reads
    M = np.zeros((N, n_v))
    for j, p in enumerate(positions):
        i = j // 16
        assert dep[j].sum() == 4 and dep[j, :first].sum() == 0
        R_v = naive_rollout([a[i].double().numpy() for a in vision])
        M[i] += row[p] * (dep[j] / 4 @ R_v)
    P = link.placement
    canvas = np.zeros(P.prefix + P.grid[0] * P.grid[1])
    np.add.at(canvas, P.cell.numpy(), M[P.item.numpy(), P.token.numpy()] * P.weight.double().numpy())
    assert np.allclose(e.full_row[0].numpy(), canvas, atol=1e-5)
    assert e.grid == P.grid and e.scores.shape == (1, P.grid[0] * P.grid[1])
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(1.0, abs=1e-5)
    other = split_inputs(name, image=torch.rand(3, H0, W0, generator=torch.Generator().manual_seed(3)))
    assert not torch.allclose(attnroll.explain(model, other, "rollout").scores, e.scores, atol=1e-4)


@pytest.mark.parametrize("name", ["idefics3", "internvl"])
def test_a_dominant_tile_token_lands_on_its_region_of_the_image(name):
    """A one-hot language row on one image token of a tile, the vision layers skipped: its whole share lands on
    the 2×2 canvas cells of its vision tokens, in the region of the original image that tile covers."""
    from attnroll.explain.linked import compose_link

    model = build(name)
    inp = split_inputs(name)
    rec = attnroll.capture(model, inp)
    link = rec.info["language"].link
    Hc, Wc = link.placement.grid
    cols = Wc // 8
    px = views_of(inp)
    checked = 0
    for j in range(0, 16 * (px.shape[0] - 1), 11):
        i, t = divmod(j, 16)
        row = torch.zeros(1, inp["input_ids"].shape[1])
        row[0, 2 + j] = 1.0
        image, text, _ = compose_link(row, link, rec.stream_shape("vision"), lambda s, r, k: r.weights, "language")
        hit = torch.nonzero(image[0] > 1e-9).reshape(-1) - 1
        assert float(text.abs().sum()) == 0 and float(image.sum()) == pytest.approx(1.0, abs=1e-6)
        assert hit.numel() == 4 and bool((image[0, hit + 1] - 0.25).abs().max() < 1e-6)
        tr, tc = divmod(i, cols)
        assert bool(((hit // Wc) // 8 == tr).all()) and bool(((hit % Wc) // 8 == tc).all())
        ys = (hit // Wc + 0.5) / Hc
        xs = (hit % Wc + 0.5) / Wc
        rr, cc = divmod(t, 4)
        patch = px[i, :, 8 * rr:8 * rr + 8, 8 * cc:8 * cc + 8]
        assert abs(float(xs.mean()) - float(patch[0].mean())) < 0.03
        assert abs(float(ys.mean()) - float(patch[1].mean())) < 0.05
        checked += 1
    assert checked >= 4


def test_a_layout_that_does_not_match_the_views_is_refused():
    model = build("idefics3")
    inp = split_inputs("idefics3")
    inp["rows"], inp["cols"] = [[3]], [[2]]  # 3 × 2 tiles, but a 2 × 3 canvas: still 7 views
    assert attnroll.capture(model, inp).info["language"].link.placement.grid == (24, 16)
    inp["rows"] = [[1]]
    with pytest.raises(ValueError, match=r"the tile layout means 3 view"):
        attnroll.explain(model, inp, "rollout")
    del inp["rows"], inp["cols"]
    with pytest.raises(ValueError, match="rows= and cols="):
        attnroll.explain(model, inp, "rollout")


@pytest.mark.parametrize("name, method", [("smolvlm", "gae"), ("aya_vision", "grad_rollout")])
def test_gradient_methods_put_split_tiles_back_and_shares_add_to_the_rows_total(name, method):
    model = build(name)
    inp = split_inputs(name)
    e = attnroll.explain(model, inp, method, target=5)
    total = float(e.extra["language_row"][0].sum())
    assert float(e.extra["image_share"][0] + e.extra["text_share"][0]) == pytest.approx(total, rel=1e-5)
    assert e.grid == attnroll.capture(model, inp).info["language"].link.placement.grid
    assert float(e.extra["image_share"][0]) > 0 and float(e.scores.abs().sum()) > 0


def test_a_batch_of_split_images_equals_its_single_prompts():
    """Two prompts, each one image of the same layout (image_sizes per image): each prompt's map is its own."""
    model = build("internvl")
    one = split_inputs("internvl")
    two = split_inputs("internvl", image=torch.rand(3, H0, W0, generator=torch.Generator().manual_seed(4)))
    both = {"input_ids": torch.cat([one["input_ids"], two["input_ids"]]),
            "attention_mask": torch.cat([one["attention_mask"], two["attention_mask"]]),
            "pixel_values": torch.cat([one["pixel_values"], two["pixel_values"]]),
            "image_sizes": torch.tensor([[H0, W0], [H0, W0]])}
    e = attnroll.explain(model, both, "rollout")
    for b, alone in enumerate((one, two)):
        assert torch.allclose(attnroll.explain(model, alone, "rollout").scores[0], e.scores[b], atol=1e-5)
