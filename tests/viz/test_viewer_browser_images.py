"""The viewer in a real headless browser, image models: what the page draws is what the Explanation holds.

The embedded shapes ViT (8x8 patches, 4 layers) explains 3 generated images with four methods; the page is
opened from file:// in chromium. The map canvas holds one pixel per patch, so with the grey colours and the
"0 → max" scale each pixel must be round(255 · v / max v) of the Explanation's own values."""

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll import viz  # noqa: E402
from attnroll.models import shapes  # noqa: E402

from . import browser  # noqa: E402

pytestmark = pytest.mark.slow  # a real headless browser

GRID = 8


@pytest.fixture(scope="module")
def data():
    model = shapes.load_shapes_model()
    images, labels, masks = shapes.make_dataset(3, 11)
    x = shapes.preprocess(images)
    E = {m: attnroll.explain(model, x, m, return_layers=True) for m in ("rollout", "gae", "per_head_rollout")}
    E["flow"] = attnroll.explain(model, x, "flow")
    return {"E": E, "images": images, "masks": masks, "model": model, "x": x}


@pytest.fixture(scope="module")
def page_url(d, data, tmp_path_factory):
    page = viz.view(data["E"], data["images"], masks=data["masks"], title="shapes")
    path = tmp_path_factory.mktemp("viewer") / "shapes.html"
    ready = browser.open_page(d, page, path)
    print(f"\nshapes page: {page.nbytes:,} bytes, ready {ready:.0f} ms after navigation start")
    return path


def _fresh(d, path):
    browser.open_page(d, path.read_text(), path)
    browser.set_control(d, "ar-cmap", "grey")
    browser.set_control(d, "ar-opacity", "1")


def _map(d, card: int) -> np.ndarray:
    cv = d.find_elements("css selector", f"#ar-ex-{card} canvas.map")[0]
    return browser.canvas_rgba(d, cv)[..., 0].reshape(-1).astype(float)


def test_page_loads_without_console_errors_and_requests_nothing(d, page_url):
    browser.open_page(d, page_url.read_text(), page_url)
    assert browser.console_messages(d) == []
    urls = browser.requested_urls(d)
    assert urls and all(u == "file://" + str(page_url) or u.startswith("data:") for u in urls), urls
    assert d.execute_script("return performance.getEntriesByType('resource').length") == 0


def test_the_checks_catch_a_page_that_reaches_out(d, page_url, tmp_path):
    """The same checks on a page with one external picture: the policy blocks it and says so."""
    bad = page_url.read_text().replace("<body>", "<body><img src='http://127.0.0.1:9/x.png'>", 1)
    browser.open_page(d, bad, tmp_path / "bad.html")
    msgs = browser.console_messages(d)
    assert any("Content Security Policy" in m for m in msgs), msgs


def test_layer_slider_moves_the_map_and_its_end_is_the_final_map(d, data, page_url):
    _fresh(d, page_url)
    e = data["E"]["rollout"]
    shot_final = d.find_element("css selector", "#ar-ex-0 .stack").screenshot_as_png
    final = _map(d, 0)
    browser.set_control(d, "ar-layer", "1")
    first = _map(d, 0)
    shot_first = d.find_element("css selector", "#ar-ex-0 .stack").screenshot_as_png
    assert shot_first != shot_final
    assert np.abs(first - final).max() > 20
    layer1 = e.layers[0, 0, e.prefix:].numpy()
    assert np.abs(first - browser.grey_expected(layer1)).max() <= 1
    browser.set_control(d, "ar-layer", str(e.layers.shape[0]))
    last = _map(d, 0)
    for b in range(3):
        np.testing.assert_allclose(_map(d, b), browser.grey_expected(e.scores[b].numpy()), atol=1)
    np.testing.assert_array_equal(last, final)


def test_method_switch_draws_that_methods_map(d, data, page_url):
    _fresh(d, page_url)
    roll = _map(d, 1)
    browser.set_control(d, "ar-method", "gae")
    gae = _map(d, 1)
    assert np.abs(roll - gae).max() > 20
    np.testing.assert_allclose(gae, browser.grey_expected(data["E"]["gae"].scores[1].numpy()), atol=1)
    browser.set_control(d, "ar-method", "flow")  # no per-layer rows: the slider cannot change it
    flow = _map(d, 1)
    browser.set_control(d, "ar-layer", "1")
    np.testing.assert_array_equal(_map(d, 1), flow)
    np.testing.assert_allclose(flow, browser.grey_expected(data["E"]["flow"].scores[1].numpy()), atol=1)


@pytest.mark.parametrize("method,layer", [("rollout", None), ("gae", None), ("rollout", 2)])
def test_value_under_the_pointer_is_the_explanations_value(d, data, page_url, method, layer):
    _fresh(d, page_url)
    browser.set_control(d, "ar-method", method)
    if layer is not None:
        browser.set_control(d, "ar-layer", str(layer))
    e = data["E"][method]
    card = d.find_element("css selector", "#ar-ex-2")
    stack = card.find_element("css selector", ".stack")
    side = stack.size["width"] / GRID
    for r, c in [(0, 0), (3, 5), (7, 2), (4, 4)]:
        browser.hover(d, stack, (c + 0.5) * side, (r + 0.5) * side)
        where, shown = browser.readout(d, card)
        row = e.scores[2] if layer is None else e.layers[layer - 1, 2, e.prefix:]
        want = float(row[r * GRID + c])
        assert f"patch (row {r}, col {c})" in where
        assert abs(shown - want) <= browser.value_tol(row.numpy(), r * GRID + c), (where, shown, want)


def test_ground_truth_outline_follows_the_mask(d, data, page_url):
    from scipy import ndimage

    _fresh(d, page_url)
    oc = d.find_element("css selector", "#ar-ex-0 canvas.outline")
    alpha = browser.canvas_rgba(d, oc)[..., 3] > 0
    k = alpha.shape[0] // data["masks"].shape[-1]
    m = np.kron(data["masks"][0].numpy().astype(np.uint8), np.ones((k, k), np.uint8)).astype(bool)
    band = ndimage.binary_dilation(m, iterations=3) & ~ndimage.binary_erosion(m, iterations=3)
    assert alpha.sum() > 4 * k * 4  # a real line was drawn
    assert not (alpha & ~band).any()  # and only along the object's edge
    browser.set_control(d, "ar-outline", False)
    assert not oc.is_displayed()


def test_per_head_grid_draws_each_head(d, data, page_url):
    _fresh(d, page_url)
    heads = data["E"]["per_head_rollout"].extra["heads"][0][:, 1:].numpy()
    det = d.find_element("css selector", "#ar-ex-0 details.heads")
    assert det.find_elements("css selector", "canvas") == []  # built only when opened
    det.find_element("css selector", "summary").click()
    canvases = browser.wait_for(d, "#ar-ex-0 details.heads canvas.hmap", heads.shape[0])
    assert len(canvases) == heads.shape[0]
    for k, cv in enumerate(canvases):
        px = browser.canvas_rgba(d, cv)[..., 0].reshape(-1).astype(float)
        np.testing.assert_allclose(px, browser.grey_expected(heads[k]), atol=1)
    side = canvases[2].size["width"] / GRID
    browser.hover(d, canvases[2], 5.5 * side, 2.5 * side)
    where, shown = browser.readout(d, d.find_element("css selector", "#ar-ex-0"))
    want = float(heads[2, 2 * GRID + 5])
    assert "head 2" in where and abs(shown - want) <= browser.value_tol(heads[2], 2 * GRID + 5)


def test_opacity_is_the_map_layers_opacity(d, page_url):
    _fresh(d, page_url)
    browser.set_control(d, "ar-opacity", "0.25")
    cv = d.find_element("css selector", "#ar-ex-0 canvas.map")
    assert float(cv.value_of_css_property("opacity")) == pytest.approx(0.25)


def test_audit_shows_both_models_and_their_difference(d, data, tmp_path):
    from attnroll.evaluate.audit import audit
    from attnroll.models.spurious import load_marker_model

    rep = audit(data["model"], load_marker_model(), data["x"], n_boot=20)
    page = viz.view(rep, data["images"], masks=data["masks"], names=("original", "marker"))
    browser.open_page(d, page, tmp_path / "audit.html")
    assert browser.console_messages(d) == []
    b = int(rep.order[0])
    card = d.find_element("css selector", "#ar-ex-0")
    assert card.find_element("css selector", "h2").text.startswith(f"example {b}")
    stacks = card.find_elements("css selector", ".stack")
    assert len(stacks) == 3
    side = stacks[0].size["width"] / GRID
    diff = rep.maps_b[b] - rep.maps_a[b]
    for panel, want in zip(stacks, (rep.maps_a[b], rep.maps_b[b], diff)):
        for r, c in [(0, 0), (5, 3)]:
            browser.hover(d, panel, (c + 0.5) * side, (r + 0.5) * side)
            _, shown = browser.readout(d, card)
            w = float(want[r * GRID + c])
            assert abs(shown - w) <= browser.value_tol(want, r * GRID + c)
    # the difference panel is signed: white at 0, red where B has more, blue where it has less
    px = browser.canvas_rgba(d, stacks[2].find_element("css selector", "canvas.map")).reshape(-1, 4).astype(int)
    t = diff / np.abs(diff).max()
    clear = np.abs(t) > 0.1
    assert clear.sum() >= 3
    np.testing.assert_array_equal(np.sign(px[clear, 0] - px[clear, 2]), np.sign(t[clear]))
    j = int(np.argmax(np.abs(t)))
    assert abs(px[j, 0] - px[j, 2]) > 150  # the strongest difference is a saturated colour


def test_colour_scales_min_max_and_one_scale_over_the_layers(d, data, page_url):
    _fresh(d, page_url)
    e = data["E"]["rollout"]
    v = e.scores[0].double().numpy()
    browser.set_control(d, "ar-scale", "minmax")
    np.testing.assert_allclose(_map(d, 0), np.rint(255 * (v - v.min()) / np.ptp(v)), atol=1)
    browser.set_control(d, "ar-scale", "layers")  # 0 -> the largest value of any layer's row or the final one
    rows = e.layers[:, 0, e.prefix:].double().numpy()
    top = max(rows.max(), v.max())
    np.testing.assert_allclose(_map(d, 0), np.rint(255 * v / top), atol=1)
    browser.set_control(d, "ar-layer", "1")
    np.testing.assert_allclose(_map(d, 0), np.rint(255 * rows[0] / top), atol=1)


def test_without_pictures_the_maps_and_values_still_show(d, data, tmp_path):
    e = data["E"]["gae"]
    browser.open_page(d, viz.view(e), tmp_path / "bare.html")
    assert browser.console_messages(d) == []
    browser.set_control(d, "ar-cmap", "grey")
    assert d.find_elements("css selector", "img") == []
    np.testing.assert_allclose(_map(d, 1), browser.grey_expected(e.scores[1].numpy()), atol=1)
    card = d.find_element("css selector", "#ar-ex-1")
    stack = card.find_element("css selector", ".stack")
    side = stack.size["width"] / GRID
    browser.hover(d, stack, 6.5 * side, 1.5 * side)
    _, shown = browser.readout(d, card)
    want = float(e.scores[1, 1 * GRID + 6])
    assert abs(shown - want) <= browser.value_tol(e.scores[1].numpy(), 1 * GRID + 6)


def test_all_methods_side_by_side(d, data, page_url):
    _fresh(d, page_url)
    browser.set_control(d, "ar-method", "*")
    card = d.find_element("css selector", "#ar-ex-1")
    shown = [s for s in card.find_elements("css selector", ".stack") if s.is_displayed()]
    names = list(data["E"])
    assert len(shown) == len(names)
    caps = [c.text.split(" · ")[0] for c in card.find_elements("css selector", "figcaption") if c.is_displayed()
            and c.find_elements("xpath", "following-sibling::div[contains(@class,'stack')]")]
    assert caps == names
    for name, stack in zip(names, shown):
        px = browser.canvas_rgba(d, stack.find_element("css selector", "canvas.map"))[..., 0].reshape(-1)
        np.testing.assert_allclose(px.astype(float), browser.grey_expected(data["E"][name].scores[1].numpy()), atol=1)
    browser.set_control(d, "ar-method", "gae")
    assert sum(s.is_displayed() for s in card.find_elements("css selector", ".stack")) == 1
