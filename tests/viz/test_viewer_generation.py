"""The viewer's pages of a decoder's context and generation attribution (``viz.viewer.context``): the data
they carry, checked without a browser, and the source × target view in a real browser (slow)."""

from __future__ import annotations

import numpy as np
import pytest

from attnroll.viz.viewer import decode_rows, read_payload
from attnroll.viz.viewer.context import context_html, generation_html, generation_payload, shown_token


def generation_record(T=3, n_input=5, seed=0):
    rng = np.random.default_rng(seed)
    n_src = n_input + T - 1
    M = rng.random((T, n_src)) ** 3
    for t in range(T):
        M[t, n_input + t:] = 0  # a decoder reads only what came before
    M /= M.sum(axis=1, keepdims=True)
    tokens = ["<s>", "Bob", " lives", " in", "\n"] + [" Oslo", ".", "</s>"][:T]
    return {"prompt": "Bob lives in", "answer": " Oslo.", "answer_ids": list(range(T)), "method": "rollout",
            "n_input": n_input, "tokens": tokens, "source_tokens": tokens[:n_src], "answer_tokens": tokens[n_input:],
            "sinks": [0], "matrix": M.tolist()}


def test_generation_page_carries_the_matrix_and_the_tokens():
    d = generation_record()
    payload = read_payload(generation_html(d, title="g"))
    assert payload["title"] == "g" and payload["methods"] == ["rollout"]
    ex = payload["examples"][0]
    assert ex["kind"] == "matrix" and ex["row_label"] == "generated token" and ex["first_generated"] == 5
    assert ex["tokens"] == ["<s>", "Bob", " lives", " in", "↵", " Oslo", "."]  # a line break shown as ↵
    assert ex["target_tokens"] == [" Oslo", ".", "</s>"] and ex["positions"] == [0, 1, 2] and ex["skip"] == [0]
    M = np.asarray(d["matrix"])
    got = decode_rows(ex["maps"]["rollout"]["rows"])
    assert got.shape == M.shape
    assert np.abs(got - M).max() <= 2e-4 * M.max()  # uint16 square-root code
    assert (got[np.asarray(d["matrix"]) == 0] == 0).all()  # zeros stay exact: nothing read from the future
    assert payload == generation_payload(d, "g") | {"title": "g"}


def test_context_page_segments_cover_every_token_in_order():
    d = {"answer": "Oslo", "method": "gae", "unit": "segments", "tokens": ["<s>", "A", " b", ".", " C", "\n"],
         "token_units": [2, 0, 0, 0, 1, 2], "token_scores": [0.0, 1.0, 2.0, 0.5, 3.0, 0.25], "sinks": [0],
         "sink_share": 0.4, "units": [{"text": "A b.", "span": [0, 4], "score": 3.5, "share": 3.5 / 6.75},
                                      {"text": "C", "span": [5, 6], "score": 3.0, "share": 3.0 / 6.75},
                                      {"text": "(other)", "span": None, "score": 0.25, "share": 0.25 / 6.75}]}
    ex = read_payload(context_html(d))["examples"][0]
    assert ex["segments"] == [["(other)", 0, 1], ["A b.", 1, 4], ["C", 4, 5], ["(other)", 5, 6]]
    np.testing.assert_allclose(decode_rows(ex["maps"]["gae"]["final"])[0], d["token_scores"], rtol=2e-4, atol=1e-9)
    compact = context_html(d, interactive=False)
    assert "<script" not in compact and "51.85%" in compact and compact.index("A b.") < compact.index(">C<")


def test_shown_tokens_and_an_empty_matrix():
    assert shown_token("a\nb\tc") == "a↵b→c" and shown_token("") == "∅"
    with pytest.raises(ValueError, match="no generated token"):
        generation_payload({**generation_record(), "matrix": []})


@pytest.mark.slow
def test_clicking_a_generated_token_shows_its_map_and_hover_names_the_cell(d, tmp_path):
    from . import browser

    rec = generation_record(T=3, n_input=5)
    M = np.asarray(rec["matrix"])
    browser.open_page(d, generation_html(rec), tmp_path / "gen.html")
    assert browser.console_messages(d) == []
    browser.set_control(d, "ar-cmap", "grey")
    mat = browser.canvas_rgba(d, d.find_element("css selector", "canvas.mat"))[..., 0].astype(float)
    assert mat.shape == M.shape
    hi = M[:, 1:].max()  # the sink column (skip) is out of the colour scale
    np.testing.assert_allclose(mat, np.rint(255 * np.clip(M / hi, 0, 1)), atol=1)
    gen_src = d.find_elements("css selector", "#ar-ex-0 .toks:not(.tgt) .t.gen")
    assert [s.text for s in gen_src] == [" Oslo", "."]  # the generated tokens among the sources
    tgt = d.find_elements("css selector", ".toks.tgt .t")
    src_sel = "#ar-ex-0 .toks:not(.tgt) .t"
    for t in (0, 2):
        tgt[t].click()
        assert "sel" in tgt[t].get_attribute("class")
        alphas = np.array(d.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(function(s){"
            "var c=getComputedStyle(s).backgroundColor.split(',');return c.length>3?parseFloat(c[3]):1;});", src_sel))
        expect = M[t] / M[t, 1:].max()  # the sink column (skip) is uncoloured and out of the scale
        expect[0] = 0
        np.testing.assert_allclose(alphas, np.clip(expect, 0, 1), atol=1 / 255 + 5e-4 + 1e-6)
    cv = d.find_element("css selector", "canvas.mat")
    cell = cv.size["width"] / M.shape[1]
    browser.hover(d, cv, 2.5 * cell, 1.5 * cell)
    where, shown = browser.readout(d, d.find_element("css selector", "#ar-ex-0"))
    assert where.startswith('rollout · generated token "." (#1) × source " lives" (#2)')
    assert abs(shown - M[1, 2]) <= browser.value_tol(M[1], 2)
