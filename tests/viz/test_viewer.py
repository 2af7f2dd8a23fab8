"""attnroll.viz.view without a browser: what the page carries (only the rows shown, quantised, decodable back
to the Explanation), that it is self-contained, the notebook frame, and the errors."""

import html
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from attnroll import viz
from attnroll.methods import explain_targets
from attnroll.explain.explanation import Explanation
from attnroll.viz.viewer import decode_rows, read_payload
from attnroll.viz.viewer.quant import encode_rows, error_bound, max_error


def token_expl(n=40, layers=3, heads=None, batch=1, seed=0, method="rollout", mask=None):
    g = torch.Generator().manual_seed(seed)
    L = torch.rand(layers, batch, n, generator=g)
    extra = {} if heads is None else {"heads": torch.rand(batch, heads, n, generator=g)}
    toks = [[f"t{b}_{j}" for j in range(n)] for b in range(batch)]
    return Explanation(scores=L[-1].clone(), full_row=L[-1].clone(), layers=L, tokens=toks, method=method,
                       extra=extra, attention_mask=mask)


# ------------------------------------------------------------------------------------------- quantising
@given(arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 50)),
              elements=st.floats(-1e3, 1e3, allow_nan=False, width=32)),
       st.sampled_from(["uint8", "uint16", "float32"]))
def test_rows_decode_within_their_bound(a, precision):
    p = encode_rows(a, precision)
    back = decode_rows(p)
    assert back.shape == a.shape
    err = np.abs(back - a)
    assert np.all(err <= error_bound(p, a))
    assert err.max() <= max_error(p)
    if precision != "float32":  # the ends of the code are exact: 0 and +-max|v|
        top = np.abs(a).max(axis=1, keepdims=True)
        ends = (a == 0) | (np.abs(a) == top)
        assert np.all(err[ends] <= 1e-12 * np.maximum(top, 1).repeat(a.shape[1], 1)[ends])


def test_small_values_beside_a_dominant_one_keep_their_digits():
    """A decoder row: the explained token holds half the mass, 4,095 others share the rest (~1.2e-4 each).
    A linear uint16 code over [0, 0.5] would have steps of 7.6e-6 (6% of these values); the page keeps them
    within 0.2%."""
    v = np.full(4096, 0.5 / 4095)
    v[-1] = 0.5
    v[:100] *= np.linspace(0.5, 1.5, 100)
    back = decode_rows(encode_rows(v))[0]
    assert np.max(np.abs(back[:-1] - v[:-1]) / v[:-1]) < 2e-3
    assert back[-1] == 0.5


def test_float32_is_exact():
    v = np.random.default_rng(0).random((3, 20)).astype(np.float32)
    np.testing.assert_array_equal(decode_rows(encode_rows(v, "float32")), v)


def test_quantising_refuses_what_it_cannot_show():
    with pytest.raises(ValueError, match="NaN"):
        encode_rows([0.0, float("nan")])
    with pytest.raises(ValueError, match="precision"):
        encode_rows([0.0, 1.0], "float8")
    with pytest.raises(ValueError, match="precision"):
        viz.view(token_expl(), precision="int4")


# --------------------------------------------------------------------------------------------- payload
def test_page_carries_exactly_the_rows_it_shows():
    e = token_expl(n=30, layers=4, heads=3, batch=2)
    other = token_expl(n=30, layers=4, batch=2, seed=1, method="gae")
    data = read_payload(viz.view({"rollout": e, "gae": other}).html)
    assert data["methods"] == ["rollout", "gae"] and data["layers"] == 4
    for b, ex in enumerate(data["examples"]):
        assert ex["tokens"] == e.tokens[b]
        for name, src in (("rollout", e), ("gae", other)):
            m = ex["maps"][name]
            for packed, want in ((m["final"], src.scores[b:b + 1]), (m["layers"], src.layers[:, b])):
                want = want.double().numpy()
                assert np.all(np.abs(decode_rows(packed) - want) <= error_bound(packed, want))
        heads = ex["maps"]["rollout"]["heads"]
        want = e.extra["heads"][b].double().numpy()
        assert np.all(np.abs(decode_rows(heads) - want) <= error_bound(heads, want))
        assert ex["maps"]["gae"]["heads"] is None


def test_page_grows_linearly_with_the_tokens_never_with_their_square():
    sizes = [viz.view(token_expl(n=n, layers=12)).nbytes for n in (1024, 2048, 4096)]
    growth = (sizes[2] - sizes[1]) / (sizes[1] - sizes[0])  # the fixed script and styles cancel out
    assert 1.9 < growth < 2.1  # doubling n doubles what is added (n² would quadruple it)


def test_uint8_halves_the_rows():
    e = token_expl(n=2000, layers=12)
    p16 = read_payload(viz.view(e).html)["examples"][0]["maps"]["rollout"]["layers"]
    p8 = read_payload(viz.view(e, precision="uint8").html)["examples"][0]["maps"]["rollout"]["layers"]
    assert len(p8["data"]) == pytest.approx(len(p16["data"]) / 2, rel=0.01)


def test_padded_tokens_are_left_out_and_segments_follow():
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    e = token_expl(n=12, layers=2, batch=2, mask=mask)
    data = read_payload(viz.view(e, segments=[("a", 0, 6), ("b", 6, 12)]).html)
    ex1 = data["examples"][1]
    assert ex1["tokens"] == e.tokens[1][3:]
    np.testing.assert_allclose(decode_rows(ex1["maps"]["rollout"]["final"])[0], e.scores[1, 3:].double(), atol=1e-4)
    assert ex1["segments"] == [["a", 0, 3], ["b", 3, 9]]
    assert data["examples"][0]["segments"] == [["a", 0, 6], ["b", 6, 12]]


def test_skip_tokens_are_marked():
    e = token_expl(n=5, layers=1)
    e.tokens = [["[CLS]", "a", "b", "[SEP]", "c"]]
    assert read_payload(viz.view(e, skip={"[CLS]", "[SEP]"}).html)["examples"][0]["skip"] == [0, 3]


def test_big_pictures_are_shrunk():
    from PIL import Image
    import base64
    import io

    s = torch.rand(1, 4)
    e = Explanation(scores=s, full_row=torch.cat([torch.zeros(1, 1), s], 1), grid=(2, 2), prefix=1, method="m")
    ex = read_payload(viz.view(e, np.zeros((800, 1000, 3), np.uint8)).html)["examples"][0]
    im = Image.open(io.BytesIO(base64.b64decode(ex["image"].split(",", 1)[1])))
    assert im.size == (640, 512) and ex["size"] == [640, 512]


# --------------------------------------------------------------------------------------- self-contained
def test_page_is_one_self_contained_file():
    page = viz.view(token_expl()).html
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    refs = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]*)""", page) + re.findall(r"url\(([^)]*)\)", page)
    assert all(r.startswith("data:") for r in refs), refs
    assert not re.search(r"https?://|fetch\(|XMLHttpRequest|import\(|<link", page)


def test_a_token_cannot_end_the_data_block():
    e = token_expl(n=3, layers=1)
    e.tokens = [["</script><script>alert(1)</script>", "ok", "<b>"]]
    page = viz.view(e).html
    assert page.count("</script>") == 2  # the data block and the code block, nothing from the tokens
    assert read_payload(page)["examples"][0]["tokens"] == e.tokens[0]


def test_notebook_frame_and_saving(tmp_path):
    page = viz.view(token_expl())
    frame = page._repr_html_()
    assert frame.startswith("<iframe sandbox='allow-scripts'")
    assert html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1)) == page.html
    path = page.save(tmp_path / "v")
    assert path.endswith("v.html") and open(path, encoding="utf-8").read() == page.html
    assert [p.name for p in tmp_path.iterdir()] == ["v.html"]  # no temporary file left


def test_explanation_to_html_interactive_is_the_viewer():
    e = token_expl(n=6, layers=2, batch=2)
    page = e.to_html(interactive=True, title="t")
    assert read_payload(page) == read_payload(viz.view(e, title="t").html)
    assert len(read_payload(e.to_html(1, interactive=True))["examples"]) == 1
    assert "<script" not in e.to_html()
    with pytest.raises(TypeError, match="interactive=True"):
        e.to_html(title="t")


# ----------------------------------------------------------------------------------------------- errors
def test_bad_inputs_say_what_was_expected():
    e = token_expl(n=8, layers=2, batch=2)
    with pytest.raises(TypeError, match="explanations must be"):
        viz.view("rollout")
    with pytest.raises(TypeError, match=r"explanations\['x'\] must be an Explanation"):
        viz.view({"x": 3})
    with pytest.raises(ValueError, match="empty"):
        viz.view({})
    with pytest.raises(ValueError, match="batch sizes differ"):
        viz.view({"a": e, "b": token_expl(n=8, layers=2, batch=1)})
    with pytest.raises(ValueError, match="unit counts differ"):
        viz.view({"a": e, "b": token_expl(n=9, layers=2, batch=2)})
    with pytest.raises(ValueError, match="images= and masks= are for image models"):
        viz.view(e, np.zeros((2, 8, 8, 3)))
    with pytest.raises(ValueError, match=r"segment 'q'.*0 <= start < end <= 8"):
        viz.view(e, segments=[("q", 5, 9)])
    with pytest.raises(ValueError, match="labels must have one entry per example"):
        viz.view(e, labels=["one"])
    with pytest.raises(ValueError, match=r"index must be example indices in \[0, 2\)"):
        viz.view(e, index=2)


def test_explain_targets_needs_a_decoder():
    with pytest.raises(ValueError, match="decoder_input_ids"):
        explain_targets(None, {"input_ids": torch.zeros(1, 3, dtype=torch.long)})
    with pytest.raises(TypeError, match="positions="):
        explain_targets(None, {"decoder_input_ids": torch.zeros(1, 3, dtype=torch.long)}, position=1)
    with pytest.raises(ValueError, match=r"decoder positions in \[0, 3\)"):
        explain_targets(None, {"decoder_input_ids": torch.zeros(1, 3, dtype=torch.long)}, positions=[3])
