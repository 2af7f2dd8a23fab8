"""Token highlights: a self-contained HTML page (no scripts, no external URLs) and the terminal (rich)."""

from __future__ import annotations

import html
from typing import Any, Mapping

import torch

from .. import _checks
from . import deps
from ._explanation import is_explanation


def _named(explanations: Any) -> list[tuple[str, Any]]:
    if is_explanation(explanations):
        return [(explanations.method, explanations)]
    if isinstance(explanations, Mapping):
        return [(str(k), v) for k, v in explanations.items()]
    return [(e.method or f"map {i}", e) for i, e in enumerate(explanations)]


def token_scores(expl: Any, index: int = 0, kind: str = "max", skip: Any = None) -> list[tuple[str, float | None]]:
    """(token, score) pairs of example ``index``, prefix and padded tokens dropped, scores rescaled per
    example ("max": largest absolute value 1, so negatives stay negative; "minmax": to [0, 1]; "sum": shares).

    ``skip``: token strings (e.g. the tokenizer's special tokens ``[CLS]``, ``[SEP]``) left out of the scaling;
    their score is None (shown without colour). Useful when the explained row's own token dominates."""
    n = expl.scores.shape[-1]
    index = _checks.check_index("index", index, expl.batch_size, "examples")
    raw = expl.scores[index].to(torch.float64)
    toks = list(expl.tokens[index][expl.prefix:]) if expl.tokens else [f"#{j}" for j in range(n)]
    keep = list(range(min(n, len(toks))))
    if expl.attention_mask is not None:
        m = expl.attention_mask[index, expl.prefix:].tolist()
        keep = [j for j in keep if j < len(m) and m[j]]
    skip = set(skip or ())
    scaled = [j for j in keep if toks[j] not in skip]
    vals = {}
    if scaled:
        from dataclasses import replace

        sub = raw[scaled][None]
        vals = dict(zip(scaled, replace(expl, scores=sub).normalized(kind).scores[0].tolist()))
    return [(toks[j], vals.get(j)) for j in keep]


def score_color(v: float | None) -> str:
    """The CSS background of a score scaled to [-1, 1]: red for positive, blue for negative, its strength
    |v|; transparent for None (a token left out of the scaling). The one colour ramp of every HTML view."""
    if v is None:
        return "transparent"
    v = max(-1.0, min(1.0, float(v)))
    return f"rgba(215,48,39,{v:.3f})" if v >= 0 else f"rgba(49,104,212,{-v:.3f})"


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:60em}"
    "h1{font-size:1.3em}h2{font-size:1.05em;margin:1.2em 0 .3em}.meta{color:#666;font-size:.85em}"
    ".toks{line-height:2.1;margin:.3em 0 .8em}.t{padding:2px 3px;margin:1px;border-radius:3px;"
    "border:1px solid #ddd;white-space:pre}.legend span{padding:2px 6px}"
)


def tokens_html(
    explanations: Any,
    *,
    title: str = "attnroll: token maps",
    index: int | None = None,
    kind: str = "max",
    notes: str | None = None,
    skip: Any = None,
) -> str:
    """A complete, self-contained HTML page highlighting tokens by their scores.

    ``explanations``: one Explanation, a list, or ``{heading: Explanation}``; each shows every example
    (or example ``index``) as its tokens on a background of strength |score| (``normalized(kind)``): red for
    positive, blue for negative; the exact score is in each token's tooltip. Inline CSS only: no scripts,
    fonts or images fetched from anywhere. ``skip``: tokens left out of the scaling and shown uncoloured
    (see :func:`token_scores`). Returns the page as a str.
    """
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if notes:
        parts.append(f"<p class='meta'>{html.escape(notes)}</p>")
    parts.append(
        "<p class='legend meta'>background = score scaled to the example's largest |score|: "
        f"<span style='background:{score_color(1)}'>1</span> <span style='background:{score_color(0.5)}'>0.5</span> "
        f"<span style='background:{score_color(0)}'>0</span> <span style='background:{score_color(-1)}'>−1</span></p>"
    )
    for heading, e in _named(explanations):
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        parts.append(
            f"<div class='meta'>method {html.escape(e.method)}, target {html.escape(str(e.target))}</div>"
        )
        for b in (
            range(e.batch_size) if index is None else [_checks.check_index("index", index, e.batch_size, "examples")]
        ):
            spans = "".join(
                f"<span class='t' title='{html.escape(tok, quote=True)}: {_num(v)}' "
                f"style='background:{score_color(v)}'>"
                f"{html.escape(tok)}</span>"
                for tok, v in token_scores(e, b, kind, skip)
            )
            parts.append(f"<div class='toks'>{spans}</div>")
    parts.append("</body></html>\n")
    return "".join(parts)


def explanation_html(expl: Any, index: int | None = None, kind: str = "max") -> str:
    """A self-contained HTML snippet (a ``<div>``, no page) of one Explanation: its method and target, then
    each example (or example ``index``): tokens (prefix and padding left out) or, for images, a table of
    patch cells, on the background :func:`score_color` gives their score (``normalized(kind)``)."""
    which = (
        range(expl.batch_size) if index is None else [_checks.check_index("index", index, expl.batch_size, "examples")]
    )
    parts = [
        "<div class='attnroll' style='font-family:sans-serif;line-height:2'>"
        f"<div><b>{html.escape(expl.method)}</b> target={html.escape(str(expl.target))}</div>"
    ]
    for b in which:
        parts.append("<div style='margin:6px 0'>")
        if expl.grid is not None:
            h, w = expl.grid
            vals = expl.normalized(kind).scores[b].tolist()
            parts.append("<table style='border-collapse:collapse'>")
            for r in range(h):
                cells = "".join(f"<td title='{vals[r * w + c]:.3g}' style='width:12px;height:12px;"
                                f"background:{score_color(vals[r * w + c])}'></td>" for c in range(w))
                parts.append(f"<tr>{cells}</tr>")
            parts.append("</table>")
        else:
            parts.extend(f"<span title='{_num(v)}' style='background:{score_color(v)};padding:1px 2px;margin:1px;"
                         f"border-radius:3px'>{html.escape(tok)}</span>" for tok, v in token_scores(expl, b, kind))
        parts.append("</div>")
    parts.append("</div>")
    return "".join(parts)


def _num(v: float | None) -> str:
    return "not scaled" if v is None else f"{v:.4g}"


def tokens_text(expl: Any, index: int = 0, *, kind: str = "max", skip: Any = None) -> Any:
    """The tokens of example ``index`` as a ``rich.text.Text`` with a background per score (red positive,
    blue negative, strength = |score|)."""
    deps.rich("attnroll.viz.tokens_text")
    from rich.text import Text

    out = Text()
    for j, (tok, v) in enumerate(token_scores(expl, index, kind, skip)):
        if j:
            out.append(" ")
        if v is None:
            out.append(tok, style="dim")
            continue
        a = max(-1.0, min(1.0, v))
        base = (215, 48, 39) if a >= 0 else (49, 104, 212)
        w = abs(a)
        r, g, b = (round(255 + (c - 255) * w) for c in base)
        fg = "white" if w > 0.6 else "black"
        out.append(tok, style=f"{fg} on rgb({r},{g},{b})")
    return out


def print_tokens(expl: Any, index: int | None = None, *, kind: str = "max", console: Any = None,
                 skip: Any = None) -> None:
    """Print token highlights to the terminal (rich), one line per example (or only ``index``)."""
    deps.rich("attnroll.viz.print_tokens")
    from rich.console import Console

    console = console or Console()
    for b in (
        range(expl.batch_size) if index is None else [_checks.check_index("index", index, expl.batch_size, "examples")]
    ):
        if console.is_terminal:
            console.print(tokens_text(expl, b, kind=kind, skip=skip))
        else:  # piped or written to a file: no colours reach it, so the scores are written out
            console.print(tokens_plain(expl, b, kind=kind, skip=skip), markup=False, highlight=False, soft_wrap=True)


def tokens_plain(expl: Any, index: int = 0, *, kind: str = "max", skip: Any = None) -> str:
    """The tokens of example ``index`` with their scores as numbers, ``token(0.42)`` (scaled as
    :func:`token_scores` scales them; a skipped token has no number): what :func:`print_tokens` writes where
    colours do not reach (a pipe, a file)."""
    return " ".join(tok if v is None else f"{tok}({v:.2f})" for tok, v in token_scores(expl, index, kind, skip))


def explanation_text(expl: Any, index: int | None = None, *, digits: int = 4) -> str:
    """Plain text of one Explanation with its scores as numbers, in the method's own units: a heading (method,
    target, shape), then per example (or only ``index``) each token with its score, or the patch grid as rows
    of numbers. What ``Explanation.show()`` prints outside a notebook."""
    which = (
        range(expl.batch_size) if index is None else [_checks.check_index("index", index, expl.batch_size, "examples")]
    )
    where = f"grid {expl.grid[0]}x{expl.grid[1]}" if expl.grid is not None else f"{expl.scores.shape[-1]} tokens"
    lines = [f"{expl.method or 'explanation'}: target={expl.target}, {expl.batch_size} example(s), {where}"]
    for b in which:
        vals = expl.scores[b].to(torch.float64).tolist()
        lines.append(f"example {b}:")
        if expl.grid is not None and len(vals) == expl.grid[0] * expl.grid[1]:
            h, w = expl.grid
            lines += ["  " + " ".join(f"{vals[r * w + c]:.{digits}g}" for c in range(w)) for r in range(h)]
            continue
        toks = list(expl.tokens[b][expl.prefix:]) if expl.tokens else [f"#{j}" for j in range(len(vals))]
        mask = None if expl.attention_mask is None else expl.attention_mask[b, expl.prefix:].tolist()
        lines += [f"  {toks[j] if j < len(toks) else f'#{j}'}\t{v:.{digits}g}" for j, v in enumerate(vals)
                  if mask is None or j >= len(mask) or mask[j]]
    return "\n".join(lines)
