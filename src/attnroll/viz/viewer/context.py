"""Viewer pages of a decoder's context and generation attribution, from their ``to_dict()`` records (plain
lists and numbers; nothing above ``viz`` is imported).

- :func:`context_html`: the prompt's units ranked by their share (the viewer's segment panel: each unit opens
  onto its tokens coloured by relevance), or a compact HTML ranking without script.
- :func:`generation_html`: the source × target view: one row per generated token, one column per source
  token (the prompt's, then the earlier generated ones); clicking a generated token shows its map.
- :func:`vlm_generation_html`: the same for a vision-language model's answer, each run of image tokens one
  column (its share), and under the matrix one map per image, over the image: clicking a generated token shows
  that token's map on every image and its scores over the prompt's tokens.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from .page import render
from .quant import encode_rows

__all__ = ["context_payload", "context_html", "generation_payload", "generation_html", "vlm_generation_payload",
           "vlm_generation_html", "shown_token"]


def shown_token(piece: str) -> str:
    """A token's text as the page shows it: a line break as ↵ (a token strip stays one line of pieces)."""
    return piece.replace("\r\n", "↵").replace("\n", "↵").replace("\t", "→") or "∅"


def _owner_runs(d: dict) -> list[list]:
    """Segments [label, start, end) over the input tokens: one per run of tokens of one unit ("(other)" and
    "(chat template)" included)."""
    units = d["units"]
    runs: list[list] = []
    for i, o in enumerate(d["token_units"]):
        if runs and runs[-1][3] == o:
            runs[-1][2] = i + 1
        else:
            text = " ".join(units[o]["text"].split())
            runs.append([text if len(text) <= 60 else text[:59] + "…", i, i + 1, o])
    return [r[:3] for r in runs]


def context_payload(d: dict, title: str | None = None) -> dict[str, Any]:
    """The viewer payload of a context attribution record (``ContextAttribution.to_dict()``)."""
    scores = np.asarray(d["token_scores"], dtype=np.float64)
    method = d["method"]
    entry = {"final": encode_rows(scores), "layers": None, "heads": None, "signed": bool((scores < 0).any())}
    ex = {"label": f"answer: {d['answer']}", "kind": "tokens", "panels": [[None, None, None]], "maps": {method: entry},
          "tokens": [shown_token(t) for t in d["tokens"]], "skip": list(d.get("sinks", [])),
          "segments": _owner_runs(d) if d["unit"] != "token" else None}
    notes = (f"{d['unit']} units ranked by their share of the answer's {method} relevance"
             + ("; the chat template was put around the prompt" if d.get("chat_template") else "")
             + (f"; attention sinks left out (held {100 * d['sink_share']:.1f}%)" if d.get("sinks") else ""))
    return {"title": title or f"attnroll context attribution ({method})", "notes": notes, "methods": [method],
            "layers": 0, "examples": [ex]}


def _ranking_html(d: dict, title: str) -> str:
    rows = []
    for u in sorted(d["units"], key=lambda u: -u["share"]):
        text = " ".join(u["text"].split())
        pct = 100 * u["share"]
        rows.append(f"<tr><td style='text-align:right;font-variant-numeric:tabular-nums'>{pct:.2f}%</td>"
                    f"<td><div style='background:#d73027;height:.7em;width:{max(pct, 0):.1f}%'></div></td>"
                    f"<td>{html.escape(text if len(text) <= 300 else text[:299] + '…')}</td></tr>")
    return ("<div class='attnroll-context' style='font-family:system-ui,sans-serif'>"
            f"<h3 style='margin:.2em 0'>{html.escape(title)}</h3>"
            f"<p><b>answer</b>: {html.escape(d['answer'])}</p>"
            "<table style='border-collapse:collapse'><tr><th>share</th><th style='width:8em'></th>"
            f"<th style='text-align:left'>{html.escape(d['unit'])}</th></tr>{''.join(rows)}</table></div>")


def context_html(d: dict, *, interactive: bool = True, title: str | None = None) -> str:
    """A context attribution record as one HTML page: the viewer (``interactive``) or a compact ranking."""
    if interactive:
        return render(context_payload(d, title))
    t = title or f"attnroll context attribution ({d['method']})"
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(t)}</title></head>"
            f"<body>{_ranking_html(d, t)}</body></html>\n")


def generation_payload(d: dict, title: str | None = None) -> dict[str, Any]:
    """The viewer payload of a generation attribution record (``GenerationAttribution.to_dict()``): a
    "matrix" example, rows = generated tokens, columns = source tokens."""
    M = np.asarray(d["matrix"], dtype=np.float64)
    T, n_src = M.shape if M.ndim == 2 else (0, 0)
    if T == 0:
        raise ValueError("the generation attribution has no generated token to show")
    method = d["method"]
    ex = {"label": f"answer: {d['answer']}", "kind": "matrix",
          "maps": {method: {"rows": encode_rows(M), "target": None, "signed": bool((M < 0).any())}},
          "tokens": [shown_token(t) for t in d["source_tokens"]], "skip": list(d.get("sinks", [])),
          "target_tokens": [shown_token(t) for t in d["answer_tokens"]], "positions": list(range(T)),
          "row_label": "generated token", "first_generated": int(d["n_input"])}
    notes = (f"{T} generated tokens × {n_src} source tokens (the prompt's {d['n_input']}, then the generated "
             f"ones): row t is the {method} relevance of the prediction of generated token t; click a generated "
             "token to see its map over the sources")
    return {"title": title or f"attnroll generation attribution ({method})", "notes": notes, "methods": [method],
            "layers": 0, "examples": [ex]}


def generation_html(d: dict, *, title: str | None = None) -> str:
    """A generation attribution record as one viewer page (the source × target view)."""
    return render(generation_payload(d, title))


def _image_runs(positions: list[int]) -> list[tuple[int, int]]:
    """Runs [start, end) of consecutive image-token positions."""
    runs: list[list[int]] = []
    for p in sorted(positions):
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return [(a, b) for a, b in runs]


def _collapsed(d: dict) -> tuple[np.ndarray, list[str], list[int], int]:
    """The matrix with each run of image tokens summed into one column: (T, columns), the column labels, the
    image columns, the column of the first generated token."""
    M = np.asarray(d["matrix"], dtype=np.float64)
    n_src = M.shape[1]
    runs = [(a, b) for a, b in _image_runs(d["image_positions"]) if a < n_src]
    n_images = len(d["image_maps"][0]) if d["image_maps"] else 0
    start = {a: (b, k) for k, (a, b) in enumerate(runs)}
    cols, labels, image_cols, first, i = [], [], [], 0, 0
    while i < n_src:
        if i == d["n_input"]:
            first = len(labels)
        if i in start:
            b, k = start[i]
            cols.append(M[:, i:b].sum(axis=1))
            image_cols.append(len(labels))
            labels.append(f"[image {k + 1}]" if len(runs) == n_images else f"[{b - i} image tokens]")
            i = b
            continue
        cols.append(M[:, i])
        labels.append(shown_token(d["source_tokens"][i]))
        i += 1
    if d["n_input"] >= n_src:
        first = len(labels)
    return np.stack(cols, axis=1), labels, image_cols, first


def _image_entries(d: dict, images: Any) -> list[dict]:
    """One entry per image: the picture (a PNG data URI, when given), its size, its grid and the T rows of its
    map (one per generated token)."""
    from .media import as_list, image_uri

    pictures = as_list(images, 3) or []
    n = len(d["image_maps"][0]) if d["image_maps"] else 0
    if pictures and len(pictures) != n:
        raise ValueError(f"images: {len(pictures)} given, but the attribution has maps for {n} image(s)")
    out = []
    for k in range(n):
        maps = np.asarray([row[k] for row in d["image_maps"]], dtype=np.float64)  # (T, h, w)
        h, w = maps.shape[1:]
        entry = {"grid": [int(h), int(w)], "rows": encode_rows(maps.reshape(maps.shape[0], -1)),
                 "image": None, "size": [int(w) * 40, int(h) * 40], "label": f"image {k + 1}"}
        if pictures:
            entry["image"], W, H = image_uri(pictures[k])
            entry["size"] = [W, H]
        out.append(entry)
    return out


def vlm_generation_payload(d: dict, images: Any = None, title: str | None = None) -> dict[str, Any]:
    """The viewer payload of a VLM's generation attribution (``VLMGenerationAttribution.to_dict()``), with the
    user's ``images`` (PIL images or arrays, one per map) under the maps."""
    if not d["matrix"] or not d["image_maps"]:
        raise ValueError("the generation attribution has no generated token to show")
    M, labels, image_cols, first = _collapsed(d)
    T = M.shape[0]
    method = d["method"]
    ex = {"label": f"answer: {d['answer']}", "kind": "matrix",
          "maps": {method: {"rows": encode_rows(M), "target": None, "signed": bool((M < 0).any())}},
          "tokens": labels, "skip": [], "target_tokens": [shown_token(t) for t in d["answer_tokens"]],
          "positions": list(range(T)), "row_label": "generated token", "first_generated": first,
          "image_columns": image_cols, "images": _image_entries(d, images)}
    notes = (f"{T} generated tokens over {len(ex['images'])} image(s) and the prompt's text: row t is the {method} "
             "relevance of the prediction of generated token t; each image's run of tokens is one column (its "
             "share), spread over the image in the maps below. Click a generated token to see its maps.")
    return {"title": title or f"attnroll generation attribution over images ({method})", "notes": notes,
            "methods": [method], "layers": 0, "examples": [ex]}


def vlm_generation_html(d: dict, *, images: Any = None, title: str | None = None) -> str:
    """A VLM's generation attribution record as one viewer page (matrix, per-token maps over the images)."""
    return render(vlm_generation_payload(d, images, title))
