"""Explaining a text or a sentence pair (``explain --text``, the demo's MiniLM page)."""

from __future__ import annotations

from typing import Any

import click

__all__ = ["explain_text"]


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
    probe = tok([text], return_tensors="pt")
    with torch.no_grad():
        has_logits = main_logits(lm.model(**probe)) is not None
    if has_logits or pair is None:
        if not has_logits and method_info(method).needs_grad and target is None:
            raise click.UsageError(
                f"method {method!r} needs a scalar target and {lm.name} has no class scores: give --pair TEXT "
                "(explains the cosine similarity of the two sentences)"
            )
        enc = tok([text], [pair], return_tensors="pt") if pair is not None else probe
        return {
            "text" if pair is None else "text + pair": explain(lm.model, enc, method, target, tokenizer=tok, **options)
        }
    out = {}
    for label, a, b in (("text (vs pair)", text, pair), ("pair (vs text)", pair, text)):
        ea = tok([a], return_tensors="pt")
        out[label] = explain(lm.model, ea, method, _cosine_target(lm, ea["attention_mask"], b), tokenizer=tok,
                             **options)
    return out
