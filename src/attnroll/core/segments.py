"""Token scores aggregated to larger units of a text: words, sentences or given segments (pure functions).

Tokens are placed by their character offsets into the text (what a fast tokenizer's ``offset_mapping``
gives): a token belongs to the unit that contains its first non-space character. Tokens in no unit (special
tokens, text between given segments) form one "(other)" unit, so that the units' scores always add up to
the total.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

UNITS = ("token", "word", "sentence")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of the whitespace-separated words."""
    return [m.span() for m in re.finditer(r"\S+", text)]


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of sentences: split after . ! ? followed by whitespace, and at blank lines; each
    span trimmed of surrounding whitespace."""
    spans, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        spans.append((start, m.start()))
        start = m.end()
    spans.append((start, len(text)))
    out = []
    for a, b in spans:
        piece = text[a:b]
        lead = len(piece) - len(piece.lstrip())
        trail = len(piece) - len(piece.rstrip())
        if b - trail > a + lead:
            out.append((a + lead, b - trail))
    return out


def segment_spans(text: str, segments: Sequence[str]) -> list[tuple[int, int]]:
    """Character spans of given segments, found in order in ``text`` (each after the previous one)."""
    spans, at = [], 0
    for i, seg in enumerate(segments):
        if not isinstance(seg, str) or not seg:
            raise ValueError(f"segments[{i}] must be a non-empty string, got {seg!r}")
        k = text.find(seg, at)
        if k < 0:
            raise ValueError(
                f"segments[{i}] ({seg[:40]!r}...) does not occur in the prompt after the previous segment; "
                "segments must be consecutive pieces of the prompt, in order"
            )
        spans.append((k, k + len(seg)))
        at = k + len(seg)
    return spans


def assign(offsets: Sequence[tuple[int, int]], text: str, spans: Sequence[tuple[int, int]]) -> list[int]:
    """For each token (char offsets [a, b)), the index of the span holding its first non-space character,
    or -1 (special tokens have empty offsets)."""
    out = []
    for a, b in offsets:
        while a < b and text[a].isspace():
            a += 1
        hit = -1
        if b > a:
            for i, (s, e) in enumerate(spans):
                if s <= a < e:
                    hit = i
                    break
        out.append(hit)
    return out


def aggregate(scores: torch.Tensor, owner: Sequence[int], num_units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit sums of token ``scores`` (n,) given each token's unit (−1 = none): (units (num_units,),
    other (scalar): the tokens in no unit). units.sum() + other == scores.sum()."""
    idx = torch.tensor(list(owner), dtype=torch.long)
    units = torch.zeros(num_units, dtype=scores.dtype)
    ok = idx >= 0
    units.index_add_(0, idx[ok], scores[ok])
    return units, scores[~ok].sum()
