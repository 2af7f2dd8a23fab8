"""The attributions compared: attnroll's methods through ``context_attribution`` and baselines written from
their papers' formulas (mean last-layer attention; AttnTrace's subsampled top-5 attention)."""

from __future__ import annotations

import numpy as np
import torch

from attnroll import context_attribution
from attnroll.capture.recompute import capture_kernels
from attnroll.core import operators
from attnroll.core import segments as seg

from .data import Prompt, render
from .protocol import token_ids


def owners(tokenizer, prompt: str, segments: list[str]) -> np.ndarray:
    """(n_prompt,) the segment index of each prompt token, −1 outside every segment."""
    enc = tokenizer(prompt, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    return np.array(seg.assign(offsets, prompt, seg.segment_spans(prompt, segments)))


def attnroll_pooled(model, tokenizer, item: Prompt, method: str) -> dict:
    """Segment scores of one ``context_attribution`` call (sinks dropped), pooled two ways: ``method`` (the
    library's per-segment sum) and ``method/top5`` (the mean of each segment's five largest token scores)."""
    base, options = method_options(method)
    ca = context_attribution(model, tokenizer, item.prompt, answer=item.answer, segments=item.segments,
                             method=base, sinks="drop", **options)
    top5 = pool_top(ca.token_scores.numpy(), owners(tokenizer, item.prompt, item.segments), len(item.segments), 5)
    return {method: np.array([u["score"] for u in ca.units[:len(item.segments)]]), f"{method}/top5": top5}


def method_options(name: str) -> tuple[str, dict]:
    """(method, options) of a method name; ``gate_grad@0.5+0.1`` is gate_grad with scales (0.5, 0.1)."""
    if "@" not in name:
        return name, {}
    base, _, points = name.partition("@")
    if base != "gate_grad":
        raise ValueError(f"only gate_grad takes gate points after '@' (e.g. gate_grad@0.5+0.1), got {name!r}")
    return base, {"scales": tuple(float(v) for v in points.split("+"))}


def pool_top(tokens: np.ndarray, owner: np.ndarray, n: int, k: int) -> np.ndarray:
    """Per segment, the mean of its ``k`` largest token scores."""
    out = np.zeros(n)
    for i in range(n):
        v = np.sort(tokens[owner == i])[::-1][:k]
        out[i] = v.mean() if len(v) else 0.0
    return out


def attention_from(model, tokenizer, prompt: str, answer_ids: list[int], layers_used, own_rows: bool):
    """(n_prompt,) attention to each prompt token from the answer, averaged over the given layers and heads
    and summed over the answer tokens. ``own_rows``: the answer tokens' own rows (AttnTrace); else the
    rows that predict them."""
    p = tokenizer(prompt)["input_ids"]
    ids = torch.tensor([p + answer_ids])
    n_p, T = len(p), len(answer_ids)
    rows = [n_p + t for t in range(T)] if own_rows else [n_p - 1 + t for t in range(T)]
    with torch.no_grad():
        rec = capture_kernels(model, {"input_ids": ids})
        layers = rec.operators["self"]
        chosen = [layers[i] for i in layers_used(len(layers))]
        acc = sum(operators.attention_rows(lay, rows)[0].mean(dim=0).sum(dim=0) for lay in chosen)
    return (acc / len(chosen))[:n_p].numpy()


def last_layer_attention(model, tokenizer, item: Prompt) -> np.ndarray:
    """Mean over heads of the last layer's attention from the answer's predicting rows, summed per segment."""
    a = attention_from(model, tokenizer, item.prompt, token_ids(tokenizer, item.prompt, item.answer)[1],
                       lambda L: [L - 1], own_rows=False)
    own = owners(tokenizer, item.prompt, item.segments)
    return np.array([a[own == i].sum() for i in range(len(item.segments))])


def attntrace(model, tokenizer, item: Prompt, B: int = 30, rho: float = 0.4, seed: int = 0) -> np.ndarray:
    """AttnTrace: attention averaged over every layer and head from the answer tokens; a segment's score is
    the mean of its top-5 token scores; averaged over B random subsets keeping ``rho`` of the segments."""
    n = len(item.segments)
    answer_ids = token_ids(tokenizer, item.prompt, item.answer)[1]
    rng = np.random.default_rng(seed)
    total, seen = np.zeros(n), np.zeros(n)
    keep_n = max(1, round(rho * n))
    for _ in range(B):
        kept = np.sort(rng.choice(n, keep_n, replace=False))
        keep = np.zeros(n, bool)
        keep[kept] = True
        text = render(tokenizer, item.segments, item.question, keep)
        a = attention_from(model, tokenizer, text, answer_ids, lambda L: range(L), own_rows=True)
        sub = [item.segments[i] for i in kept]
        total[kept] += pool_top(a, owners(tokenizer, text, sub), len(sub), 5)
        seen[kept] += 1
    return np.divide(total, seen, out=np.zeros(n), where=seen > 0)
