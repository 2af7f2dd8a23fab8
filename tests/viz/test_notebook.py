"""Results that show themselves: a sandboxed, offline inline page in a notebook; plain text with the numbers
elsewhere (``attnroll.viz.notebook``)."""

from __future__ import annotations

import html
import io
import re
import sys
import types

import numpy as np
import pytest
import torch

from attnroll.evaluate.audit import AuditReport
from attnroll.explain.context_attribution import ContextAttribution
from attnroll.explain.explanation import Explanation
from attnroll.viz import notebook

SRCDOC = re.compile(r'^<iframe sandbox="allow-scripts" [^>]*srcdoc="([^"]*)"></iframe>$', re.DOTALL)


def page_of(frame: str) -> str:
    m = SRCDOC.match(frame)
    assert m, frame[:200]
    return html.unescape(m.group(1))


def offline(page: str) -> bool:
    """Nothing in the page is fetched from anywhere: no http(s) or protocol-relative addresses in src/href."""
    return not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)


def numbers_in(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", text)]


def token_expl() -> Explanation:
    s = torch.tensor([[0.125, 0.5, 0.0625, 0.3125]])
    return Explanation(scores=s, full_row=s, tokens=[["the", "cat", "sat", "."]], method="rollout", target=[1])


def image_expl() -> Explanation:
    torch.manual_seed(0)
    s = torch.rand(2, 6)
    return Explanation(scores=s, full_row=torch.cat([torch.zeros(2, 1), s], 1), grid=(2, 3), prefix=1,
                       method="gae", target=[0, 1])


@pytest.mark.parametrize("make", [token_expl, image_expl])
def test_explanation_inline_viewer_is_sandboxed_and_offline(make):
    e = make()
    frame = e._repr_html_()
    assert "allow-same-origin" not in frame
    page = page_of(frame)
    assert "attnroll-data" in page and offline(page)  # the interactive viewer, its data inside
    from attnroll.viz.viewer import decode_rows, read_payload

    data = read_payload(page)
    got = decode_rows(data["examples"][0]["maps"]["rollout" if e.method == "rollout" else "gae"]["final"])
    np.testing.assert_allclose(got.reshape(-1), e.scores[0].numpy(), atol=1e-3 * float(e.scores[0].abs().max()))


def test_explanation_show_outside_a_notebook_prints_every_score(capsys):
    e = image_expl()
    e.show()
    out = capsys.readouterr().out
    assert out.startswith("gae: target=[0, 1], 2 example(s), grid 2x3")
    np.testing.assert_allclose(numbers_in(out), e.scores.reshape(-1).tolist(), rtol=1e-3)
    t = token_expl()
    t.show()
    lines = capsys.readouterr().out.splitlines()[2:]
    assert [ln.split()[0] for ln in lines] == ["the", "cat", "sat", "."]
    np.testing.assert_allclose([float(ln.split()[1]) for ln in lines], t.scores[0].tolist())


def test_show_in_a_notebook_displays_the_frame(monkeypatch):
    shown = []

    class ZMQInteractiveShell:  # what a Jupyter kernel's shell is called
        kernel = object()

    display_mod = types.SimpleNamespace(HTML=lambda s: ("HTML", s), display=lambda x: shown.append(x))
    ipython = types.SimpleNamespace(get_ipython=lambda: ZMQInteractiveShell(), display=display_mod)
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display_mod)
    assert notebook.in_notebook()
    e = token_expl()
    e.show()
    assert shown == [("HTML", e._repr_html_())]


def test_not_a_notebook_without_a_kernel(monkeypatch):
    class TerminalInteractiveShell:
        pass

    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: TerminalInteractiveShell()))
    assert not notebook.in_notebook()
    monkeypatch.delitem(sys.modules, "IPython")
    assert not notebook.in_notebook()


def test_context_attribution_shows_its_ranking():
    units = [{"text": "Paris is in France.", "span": (0, 19), "score": 3.0, "share": 0.75},
             {"text": "Cats <sleep>.", "span": (20, 33), "score": 1.0, "share": 0.25}]
    ca = ContextAttribution(prompt="Paris is in France. Cats <sleep>.", answer="France", answer_ids=[7],
                            token_scores=torch.tensor([2.0, 1.0, 0.5, 0.5]), units=units, total=4.0, method="rollout",
                            unit="sentence", tokens=["Paris", " is in France.", " Cats", " <sleep>."],
                            token_units=[0, 0, 1, 1])
    page = page_of(ca._repr_html_())
    assert page == ca.to_html(interactive=True) and offline(page)
    buf = io.StringIO()
    ca.show(file=buf)
    assert "75.00%  Paris is in France." in buf.getvalue() and "25.00%  Cats <sleep>." in buf.getvalue()


def test_generation_attribution_shows_its_matrix():
    from attnroll.explain.generation_attribution import GenerationAttribution

    m = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5]])
    ga = GenerationAttribution(prompt="a b", answer=" c d", answer_ids=[3, 4], matrix=m,
                               tokens=["a", " b", " c", " d"], n_input=2, method="rollout")
    page = page_of(ga._repr_html_())
    assert page == ga.to_html() and offline(page)
    buf = io.StringIO()
    ga.show(file=buf)
    out = buf.getvalue()
    assert out.startswith("rollout: 2 generated token(s) over 3 sources") and ga.table() in out
    assert "60.0%" in out and "50.0%" in out  # each row's largest source share


def test_audit_report_shows_its_summary_and_report():
    js = np.array([0.1, 0.3])
    maps = np.full((2, 4), 0.25)
    rep = AuditReport(method="rollout", grid=None, k=2, maps_a=maps, maps_b=maps, js=js, spearman=np.array([0.5, 1.0]),
                      topk=np.array([1.0, 0.5]), regions={}, mass_a={}, mass_b={}, shift={}, shift_ci={},
                      flagged=True, reasons=["mean JS 0.2 above 0.1"], order=np.array([1, 0]),
                      pred_a=np.array([0, 1]), pred_b=np.array([0, 0]), settings={"js_threshold": 0.1})
    page = page_of(rep._repr_html_())
    assert offline(page) and "0.2000" in page and "FLAGGED" in page
    buf = io.StringIO()
    rep.show(file=buf)
    assert buf.getvalue().strip() == rep.summary()


def test_print_tokens_writes_numbers_where_colours_do_not_reach():
    from rich.console import Console

    from attnroll.viz import print_tokens

    buf = io.StringIO()
    print_tokens(token_expl(), console=Console(file=buf, width=200))  # a file: not a terminal
    assert buf.getvalue().strip() == "the(0.25) cat(1.00) sat(0.12) .(0.62)"
