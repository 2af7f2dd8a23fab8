"""Explaining a text or a sentence pair (``explain --text``, the demo's MiniLM page)."""

from __future__ import annotations

import re
from typing import Any

import click

__all__ = ["explain_text", "encode", "max_tokens", "shown", "slug"]

#: What tokenizers say when they know no length limit (transformers' VERY_LARGE_INTEGER is above it).
_NO_LIMIT = 10**9


def max_tokens(lm: Any) -> int | None:
    """The most tokens the model reads: the tokenizer's ``model_max_length``, else the config's
    ``max_position_embeddings``; None when neither gives a limit."""
    limit = getattr(lm.tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < _NO_LIMIT:
        return limit
    config = getattr(lm.model, "config", None)
    limit = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def shown(text: str, limit: int = 300) -> str:
    """``text`` for a page's notes: its first ``limit`` characters, with the length of the rest when cut."""
    return text if len(text) <= limit else f"{text[:limit]}… (+{len(text) - limit:,} characters)"


def encode(lm: Any, texts: list[str], pairs: list[str] | None = None) -> Any:
    """``lm.tokenizer(texts, pairs, return_tensors="pt")``, truncated to the model's :func:`max_tokens` as
    ``attnroll batch`` encodes its texts; a note on stderr says when a text was cut, and to how many tokens."""
    tok, limit = lm.tokenizer, max_tokens(lm)
    if limit is None:
        return tok(texts, pairs, padding=True, return_tensors="pt")
    enc = tok(texts, pairs, padding=True, truncation=True, max_length=limit, return_tensors="pt")
    full = tok(texts, pairs, verbose=False)["input_ids"]
    longest = max(len(ids) for ids in full)
    if longest > enc["input_ids"].shape[1]:
        what = "the text and its pair are" if pairs is not None else "the text is"
        click.echo(f"note: {what} {longest:,} tokens long and {lm.name} reads at most {limit:,}: explaining the "
                   f"first {enc['input_ids'].shape[1]:,} tokens (the rest is cut off)", err=True)
    return enc


def _cosine_target(lm: Any, mask: Any, other_text: str) -> Any:
    """Target ``f(outputs) -> (B,)``: cosine similarity of the mean-pooled embedding (real tokens of
    ``mask``) to ``other_text``'s, which is held fixed."""
    from ..targets import similarity_to

    return similarity_to(lm.model, lm.tokenizer, mask, [other_text])


def explain_text(lm: Any, text: str, pair: str | None, method: str, options: dict, target: Any) -> dict[str, Any]:
    """Explanations of a text (and a pair) -> {label: Explanation}.

    A model with class scores reads the pair as one input (``tokenizer(text, pair)``), as it was trained.
    A bare encoder (sentence embeddings, e.g. MiniLM) with a pair: each sentence is explained for the cosine
    similarity of its mean-pooled embedding to the other's (held fixed)."""
    import torch

    from ..capture.outputs import main_logits
    from ..methods import explain, method_info

    tok = lm.tokenizer
    probe = encode(lm, [text])
    with torch.no_grad():
        has_logits = main_logits(lm.model(**probe)) is not None
    if has_logits or pair is None:
        if not has_logits and method_info(method).needs_grad and target is None:
            raise click.UsageError(
                f"method {method!r} needs a scalar target and {lm.name} has no class scores: give --pair TEXT "
                "(explains the cosine similarity of the two sentences)"
            )
        enc = encode(lm, [text], [pair]) if pair is not None else probe
        return {
            "text" if pair is None else "text + pair": explain(lm.model, enc, method, target, tokenizer=tok, **options)
        }
    out = {}
    for label, a, b in (("text (vs pair)", text, pair), ("pair (vs text)", pair, text)):
        ea = encode(lm, [a])
        out[label] = explain(lm.model, ea, method, _cosine_target(lm, ea["attention_mask"], b), tokenizer=tok,
                             **options)
    return out


def slug(text: str, words: int = 5) -> str:
    """The first ``words`` words of a text, lower case, joined by "-" (a file name stem)."""
    s = "-".join(re.findall(r"[a-z0-9]+", text.lower())[:words])
    return s or "text"
