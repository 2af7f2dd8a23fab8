"""The viewer's page of a vision-language model's generation attribution (``viz.viewer.context``): per generated
token one map per image, over the image, and its scores over the prompt's tokens. The data it carries, checked
without a browser; clicking an answer token in a real browser (slow)."""

from __future__ import annotations

import numpy as np
import pytest

from attnroll.viz.viewer import decode_rows, read_payload
from attnroll.viz.viewer.context import vlm_generation_html, vlm_generation_payload
from attnroll.viz.viewer.page import CSP


def vlm_record(T=3, seed=0):
    """A prompt of 10 tokens: "<s>", image 1's 4 tokens (a 2×2 map), " and", image 2's 2 tokens (a 1×2 map),
    " what", "?"; every row a distribution whose image tokens' shares are spread over the images' maps."""
    rng = np.random.default_rng(seed)
    n_input = 10
    n_src = n_input + T - 1
    M = rng.random((T, n_src)) ** 2
    for t in range(T):
        M[t, n_input + t:] = 0
    M /= M.sum(axis=1, keepdims=True)
    maps = []
    for t in range(T):
        a = rng.random((2, 2))
        b = rng.random((1, 2))
        maps.append([(a / a.sum() * M[t, 1:5].sum()).tolist(), (b / b.sum() * M[t, 6:8].sum()).tolist()])
    tokens = ["<s>", "<img>", "<img>", "<img>", "<img>", " and", "<img>", "<img>", " what", "?"] + \
        [" a", " cat", "\n"][:T]
    return {"answer": " a cat", "answer_ids": list(range(T)), "method": "rollout", "n_input": n_input,
            "tokens": tokens, "source_tokens": tokens[:n_src], "answer_tokens": tokens[n_input:],
            "image_positions": [1, 2, 3, 4, 6, 7], "matrix": M.tolist(), "image_maps": maps,
            "image_share": [float(M[t, [1, 2, 3, 4, 6, 7]].sum()) for t in range(T)]}


def test_the_page_carries_per_token_image_maps_and_collapsed_image_columns():
    d = vlm_record()
    page = vlm_generation_html(d, title="v")
    payload = read_payload(page)
    ex = payload["examples"][0]
    assert payload["title"] == "v" and ex["kind"] == "matrix" and ex["row_label"] == "generated token"
    assert ex["tokens"] == ["<s>", "[image 1]", " and", "[image 2]", " what", "?", " a", " cat"]
    assert ex["image_columns"] == [1, 3] and ex["first_generated"] == 6 and ex["target_tokens"] == [" a", " cat", "↵"]
    M = np.asarray(d["matrix"])
    want = np.stack([M[:, 0], M[:, 1:5].sum(1), M[:, 5], M[:, 6:8].sum(1), *M[:, 8:].T], axis=1)
    got = decode_rows(ex["maps"]["rollout"]["rows"])
    assert np.abs(got - want).max() <= 2e-4 * want.max()
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-3)  # the row's shares still add up
    assert [im["grid"] for im in ex["images"]] == [[2, 2], [1, 2]] and ex["images"][0]["image"] is None
    for k, im in enumerate(ex["images"]):
        rows = decode_rows(im["rows"])
        exp = np.asarray([np.asarray(d["image_maps"][t][k]).reshape(-1) for t in range(3)])
        assert rows.shape == exp.shape and np.abs(rows - exp).max() <= 2e-4 * exp.max()
        # each token's map holds its image column's share
        np.testing.assert_allclose(rows.sum(axis=1), want[:, ex["image_columns"][k]], rtol=1e-3)
    assert CSP in page and "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page


def test_the_images_are_embedded_under_the_maps():
    d = vlm_record(T=2)
    pics = [np.full((20, 30, 3), 200, np.uint8), np.zeros((10, 20, 3), np.uint8)]
    ex = vlm_generation_payload(d, images=pics)["examples"][0]
    assert [im["size"] for im in ex["images"]] == [[30, 20], [20, 10]]
    assert all(im["image"].startswith("data:image/png;base64,") for im in ex["images"])
    with pytest.raises(ValueError, match="1 given, but the attribution has maps for 2 image"):
        vlm_generation_payload(d, images=pics[:1])
    with pytest.raises(ValueError, match="no generated token"):
        vlm_generation_payload({**d, "matrix": np.zeros((0, 9)).tolist(), "image_maps": []})


def test_an_attribution_of_a_tiny_llava_makes_the_page():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    import attnroll

    from ..capture.test_vlm import llava, prompt

    ga = attnroll.vlm_generation_attribution(llava(), prompt("llava"), generate=2)
    ex = read_payload(ga.to_html(images=[np.zeros((32, 32, 3), np.uint8)]))["examples"][0]
    assert ex["tokens"][2] == "[image 1]" and len(ex["images"]) == 1 and ex["images"][0]["grid"] == [4, 4]
    rows = decode_rows(ex["images"][0]["rows"])
    want = np.stack([m[0].reshape(-1).numpy() for m in ga.image_maps])
    assert np.abs(rows - want).max() <= 2e-4 * want.max()


@pytest.mark.slow
def test_clicking_an_answer_token_shows_its_map_on_every_image(d, tmp_path):
    from . import browser

    rec = vlm_record(T=3)
    browser.open_page(d, vlm_generation_html(rec), tmp_path / "vlm.html")
    assert browser.console_messages(d) == []
    browser.set_control(d, "ar-cmap", "grey")
    tgt = d.find_elements("css selector", ".toks.tgt .t")
    maps = d.find_elements("css selector", ".answer-image canvas.map")
    assert len(maps) == 2
    for t in (0, 2, 1):
        tgt[t].click()
        for k, cv in enumerate(maps):
            got = browser.canvas_rgba(d, cv)[..., 0].astype(float)
            want = np.asarray(rec["image_maps"][t][k])
            assert got.shape == want.shape
            np.testing.assert_allclose(got, browser.grey_expected(want), atol=1)
        cap = d.find_elements("css selector", ".answer-image figcaption")[1].text
        assert cap.startswith("image 2 · generated token " + ['" a"', '" cat"', '"↵"'][t])
    imgs = [s.text for s in d.find_elements("css selector", "#ar-ex-0 .toks:not(.tgt) .t.img")]
    assert imgs == ["[image 1]", "[image 2]"]
    browser.hover(d, maps[0], 240, 80)  # the first image's top-right patch (320 px wide, 2 columns)
    where, shown = browser.readout(d, d.find_element("css selector", "#ar-ex-0"))
    assert where.startswith("image 1 · generated token") and "patch (row 0, col 1)" in where
    row = np.asarray(rec["image_maps"][1][0]).reshape(-1)
    assert abs(shown - row[1]) <= browser.value_tol(row, 1)
    assert browser.requested_urls(d) == [] or all(u.startswith(("file:", "data:")) for u in browser.requested_urls(d))
