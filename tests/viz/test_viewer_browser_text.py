"""The viewer in a real headless browser, token models: every token shown, colours and pointer values from
the Explanation, the encoder-decoder matrix, ranked segments of a long prompt, a 4,096-token page (size and
time to interactive, printed), and the notebook frame."""

import re
import time

import numpy as np
import pytest
import torch

T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll import viz  # noqa: E402
from attnroll.methods import explain_targets  # noqa: E402
from attnroll.explain.explanation import Explanation  # noqa: E402

from . import browser  # noqa: E402
from ..zoo import sharp as M  # noqa: E402

pytestmark = pytest.mark.slow  # a real headless browser


#: Browsers keep a colour's alpha in 8 bits and print it with as few decimals as name that byte: up to a
#: step of 1/255 off, plus the page's own 3 decimals.
ALPHA = 1 / 255 + 5e-4 + 1e-6


@pytest.fixture(scope="module")
def bert(bert_dir):
    tok = T.AutoTokenizer.from_pretrained(bert_dir)
    model = T.AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    enc = tok(["the cat sat on the mat", "a dog ran"], ["a dog ran on the mat", "the cat"], padding=True,
              return_tensors="pt")
    E = {m: attnroll.explain(model, enc, m, tokenizer=tok, return_layers=True) for m in ("rollout", "gae")}
    return E, set(tok.all_special_tokens)


def _spans(d, card):
    return d.find_elements("css selector", f"#ar-ex-{card} .toks .t")


def _alphas(d, card):
    """The background alpha of every token span of a card (0 for transparent), in page order."""
    return np.array(d.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(function(s){"
        "var m=getComputedStyle(s).backgroundColor.match(/rgba?\\(([^)]*)\\)/)[1].split(',');"
        "return m.length>3?parseFloat(m[3]):(m[0].trim()==='0'&&m[1].trim()==='0'?0:1);});",
        f"#ar-ex-{card} .toks .t"))


def test_every_real_token_is_shown_in_order(d, bert, tmp_path):
    E, special = bert
    browser.open_page(d, viz.view(E, skip=special), tmp_path / "pair.html")
    assert browser.console_messages(d) == []
    e = E["rollout"]
    for b in range(2):
        real = int(e.attention_mask[b].sum())
        want = e.tokens[b][:real]
        shown = [s.get_attribute("textContent") for s in _spans(d, b)]
        assert shown == want and "[PAD]" not in shown


def test_token_colours_and_pointer_values_follow_the_explanation(d, bert, tmp_path):
    E, special = bert
    browser.open_page(d, viz.view(E, skip=special), tmp_path / "pair.html")
    for method in ("rollout", "gae"):
        browser.set_control(d, "ar-method", method)
        e = E[method]
        for b in range(2):
            real = int(e.attention_mask[b].sum())
            toks, v = e.tokens[b][:real], e.scores[b, :real].double().numpy()
            scaled = np.array([t not in special for t in toks])
            want = np.where(scaled, np.clip(v / v[scaled].max(), 0, 1), 0)
            np.testing.assert_allclose(_alphas(d, b), want, atol=ALPHA)
        card = d.find_element("css selector", "#ar-ex-1")
        for j in (1, 3):
            browser.hover(d, _spans(d, 1)[j], 3, 3)
            where, shown = browser.readout(d, card)
            want = float(e.scores[1, j])
            assert f"(#{j})" in where and abs(shown - want) <= browser.value_tol(e.scores[1].numpy(), j)


def test_layer_slider_recolours_tokens_and_ends_at_the_final_row(d, bert, tmp_path):
    E, _ = bert
    browser.open_page(d, viz.view(E), tmp_path / "layers.html")
    e = E["rollout"]
    real = int(e.attention_mask[0].sum())
    final = _alphas(d, 0)
    browser.set_control(d, "ar-layer", "1")
    first = _alphas(d, 0)
    lay = e.layers[0, 0, :real].double().numpy()
    np.testing.assert_allclose(first, lay / lay.max(), atol=ALPHA)
    assert np.abs(first - final).max() > 0.05
    browser.set_control(d, "ar-layer", str(e.layers.shape[0]))
    np.testing.assert_allclose(_alphas(d, 0), final)


def test_encoder_decoder_matrix_and_clicking_a_target_token(d, tmp_path):
    model = M.model("bart")
    x = M.example(M.inputs_for("bart", batch=1, pad=False), 0)
    rows = explain_targets(model, x, "encdec_rollout")
    assert [r.positions[0] for r in rows] == list(range(x["decoder_input_ids"].shape[1]))
    page = viz.view({"encdec_rollout": rows})
    browser.open_page(d, page, tmp_path / "encdec.html")
    assert browser.console_messages(d) == []
    R = torch.stack([r.scores[0] for r in rows]).double().numpy()  # (targets, source)
    mat = browser.canvas_rgba(d, d.find_element("css selector", "canvas.mat"))
    assert mat.shape[:2] == R.shape
    browser.set_control(d, "ar-cmap", "grey")
    mat = browser.canvas_rgba(d, d.find_element("css selector", "canvas.mat"))[..., 0].astype(float)
    np.testing.assert_allclose(mat, np.rint(255 * R / R.max()), atol=1)
    tgt = d.find_elements("css selector", ".toks.tgt .t")
    assert len(tgt) == R.shape[0]
    src_sel = "#ar-ex-0 .toks:not(.tgt) .t"
    for t in (1, 3):
        tgt[t].click()
        assert "sel" in tgt[t].get_attribute("class")
        alphas = np.array(d.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(function(s){"
            "return parseFloat(getComputedStyle(s).backgroundColor.split(',')[3]||'1');});", src_sel))
        np.testing.assert_allclose(alphas, R[t] / R[t].max(), atol=ALPHA)
        ts = rows[t].extra["target_scores"][0].double().numpy()
        tgt_alpha = np.array(d.execute_script(
            "return Array.from(document.querySelectorAll('.toks.tgt .t')).map(function(s){"
            "var c=getComputedStyle(s).backgroundColor.split(',');return c.length>3?parseFloat(c[3]):1;});"))
        np.testing.assert_allclose(tgt_alpha, np.clip(ts / ts.max(), 0, 1), atol=ALPHA)
    cv = d.find_element("css selector", "canvas.mat")
    cell = cv.size["width"] / R.shape[1]
    browser.hover(d, cv, 2.5 * cell, 1.5 * cell)
    _, shown = browser.readout(d, d.find_element("css selector", "#ar-ex-0"))
    assert abs(shown - R[1, 2]) <= browser.value_tol(R[1], 2)


def long_prompt(n=4096, layers=12, methods=("rollout", "gae", "grad_rollout"), seed=0):
    """A decoder-like explanation of n tokens: rows after each of ``layers`` layers, several methods."""
    g = torch.Generator().manual_seed(seed)
    toks = [f"w{j % 997}" for j in range(n)]
    out = {}
    for m in methods:
        L = torch.rand(layers, 1, n, generator=g) ** 4
        L = L / L.sum(-1, keepdim=True)
        out[m] = Explanation(scores=L[-1].clone(), full_row=L[-1].clone(), layers=L, tokens=[toks], method=m)
    return out


def test_long_prompt_segments_are_ranked_and_built_on_opening(d, tmp_path):
    E = long_prompt(n=600, layers=3, methods=("rollout", "gae"))
    segs = [("system", 0, 50), ("doc A", 50, 300), ("doc B", 300, 520), ("question", 520, 600)]
    browser.open_page(d, viz.view(E, segments=segs), tmp_path / "segs.html")
    assert browser.console_messages(d) == []
    for m in ("rollout", "gae"):
        browser.set_control(d, "ar-method", m)
        v = E[m].scores[0].double().numpy()
        mass = [v[a:z].sum() for _, a, z in segs]
        want = [segs[k][0] for k in np.argsort(-np.array(mass), kind="stable")]
        summaries = [s.text for s in d.find_elements("css selector", ".seg summary")]
        assert [re.sub(r"^#\d+\s+", "", s).split(" — ")[0] for s in summaries] == want
        shares = [float(re.search(r"— ([\d.]+)%", s).group(1)) for s in summaries]
        np.testing.assert_allclose(shares, 100 * np.sort(mass)[::-1] / sum(mass), atol=0.05)
    opened = d.find_elements("css selector", ".seg[open]")
    assert len(opened) == 1  # only the top-ranked segment is open, and only open segments hold tokens
    closed = d.find_elements("css selector", ".seg:not([open])")
    assert all(c.find_elements("css selector", ".t") == [] for c in closed)
    k = int(closed[0].get_attribute("data-k"))
    closed[0].find_element("css selector", "summary").click()
    _, a, z = segs[k]
    got = [s.get_attribute("textContent") for s in browser.wait_for(d, f".seg[data-k='{k}'] .t", z - a)]
    assert got == E["gae"].tokens[0][a:z]


def test_4096_token_page_is_small_and_interactive_fast(d, tmp_path):
    """The issue's acceptance check: at most 2 MB for 4,096 tokens x 12 layers x 3 methods, interactive
    within 2 s. The bound is generous; the measurements are printed."""
    E = long_prompt()
    page = viz.view(E)
    assert page.nbytes <= 2_000_000
    t0 = time.perf_counter()
    ready = browser.open_page(d, page, tmp_path / "long.html")
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    browser.set_control(d, "ar-method", "gae")
    browser.set_control(d, "ar-layer", "6")
    switch = time.perf_counter() - t1
    # every token ends up in the page (rendered in chunks after the first)
    deadline = time.monotonic() + 10
    while len(d.find_elements("css selector", "#ar-ex-0 .toks .t")) < 4096 and time.monotonic() < deadline:
        time.sleep(0.05)
    full = d.execute_script("return performance.now()")
    texts = d.execute_script("return Array.from(document.querySelectorAll('#ar-ex-0 .toks .t')).map(s=>s.textContent)")
    assert texts == E["gae"].tokens[0]
    print(f"\n4,096 tokens x 12 layers x 3 methods: {page.nbytes:,} bytes; ready {ready:.0f} ms after navigation "
          f"start (driver wall {wall * 1000:.0f} ms); method + layer switch {switch * 1000:.0f} ms; all tokens "
          f"in the page at {full:.0f} ms")
    assert ready < 2000
    lay = E["gae"].layers[5, 0].double().numpy()
    np.testing.assert_allclose(_alphas(d, 0)[:512], (lay / lay.max())[:512], atol=ALPHA)


def test_notebook_frame_runs_the_viewer(d, bert, tmp_path):
    """What a notebook cell shows (``_repr_html_``): the page in a sandboxed iframe, working."""
    E, _ = bert
    page = viz.view(E["rollout"])
    host = "<!DOCTYPE html><html><body><p>cell output</p>" + page._repr_html_() + "</body></html>"
    (tmp_path / "cell.html").write_text(host)
    d.get("file://" + str(tmp_path / "cell.html"))
    d.switch_to.frame(d.find_element("css selector", "iframe"))
    try:
        deadline = time.monotonic() + 10
        while d.execute_script("return window.attnroll ? 1 : 0") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        shown = [s.get_attribute("textContent") for s in d.find_elements("css selector", "#ar-ex-0 .t")]
        real = int(E["rollout"].attention_mask[0].sum())
        assert shown == E["rollout"].tokens[0][:real]
    finally:
        d.switch_to.default_content()


def test_per_head_strips_of_a_text_model(d, bert, bert_dir, tmp_path):
    tok = T.AutoTokenizer.from_pretrained(bert_dir)
    model = T.AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    enc = tok(["the cat sat on the mat"], return_tensors="pt")
    e = attnroll.explain(model, enc, "per_head_rollout", tokenizer=tok)
    browser.open_page(d, viz.view(e), tmp_path / "heads.html")
    d.find_element("css selector", "details.heads summary").click()
    heads = e.extra["heads"][0].double().numpy()
    strips = browser.wait_for(d, "canvas.hstrip", heads.shape[0])
    assert len(strips) == heads.shape[0]
    for k, cv in enumerate(strips):
        px = browser.canvas_rgba(d, cv)
        assert px.shape[:2] == (1, heads.shape[1])
        # heat colours: the largest value of each head is its brightest (highest red + green) token
        assert int(np.argmax(px[0, :, :3].astype(int).sum(-1))) == int(np.argmax(heads[k]))
    cell = strips[1].size["width"] / heads.shape[1]
    browser.hover(d, strips[1], 2.5 * cell, 3)
    where, shown = browser.readout(d, d.find_element("css selector", "#ar-ex-0"))
    assert "head 1" in where and abs(shown - heads[1, 2]) <= browser.value_tol(heads[1], 2)


def test_percentile_scale_keeps_one_dominant_token_from_washing_out_the_rest(d, tmp_path):
    E = long_prompt(n=300, layers=2, methods=("rollout",))
    E["rollout"].scores[0, -1] = 50.0  # a decoder's own last token often dominates its row like this
    browser.open_page(d, viz.view(E), tmp_path / "p99.html")
    v = E["rollout"].scores[0].double().numpy()
    assert _alphas(d, 0)[:-1].max() < 0.01  # under "0 → max" the rest is invisible
    browser.set_control(d, "ar-scale", "p99")
    top = np.sort(v)[int(np.floor(0.99 * (len(v) - 1)))]
    np.testing.assert_allclose(_alphas(d, 0), np.clip(v / top, 0, 1), atol=ALPHA)
