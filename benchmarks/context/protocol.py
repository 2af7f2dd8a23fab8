"""ContextCite's evaluation protocol, written from its published definitions.

For a prompt whose segments are the sources, and the answer's log-probability f(keep) = log p(answer | prompt
rendered with the kept segments only):
- leave-one-out (LOO): drop_i = f(all) − f(all but i), exact, one forward per segment;
- top-k log-prob drop: f(all) − f(all but the k top-scored segments), k = 1, 3, 5;
- LDS: Spearman between the attribution's linear prediction Σ_{i kept} score_i and the actual f(keep) over
  held-out random 50 % ablations (rank-based, so log p and ContextCite's logit-prob give the same LDS);
- top-1 agreement with LOO and Spearman with the LOO drops;
- cost: the method's time over the time of one forward + backward of prompt + answer, both measured in the
  same process, side by side.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from scipy.stats import spearmanr

from .data import Prompt, render


def token_ids(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids), tokenised as ``context_attribution`` does (answer without special tokens)."""
    return tokenizer(prompt)["input_ids"], tokenizer(answer, add_special_tokens=False)["input_ids"]


class Scorer:
    """log p(answer | prompt with the kept segments), cached per keep-mask (one forward each)."""

    def __init__(self, model, tokenizer, item: Prompt):
        self.model, self.tok, self.item = model, tokenizer, item
        self.answer_ids = token_ids(tokenizer, item.prompt, item.answer)[1]
        self.cache: dict[tuple, float] = {}
        self.forwards = 0

    def logp(self, keep) -> float:
        key = tuple(bool(k) for k in keep)
        if key not in self.cache:
            text = render(self.tok, self.item.segments, self.item.question, key)
            self.cache[key] = answer_logp(self.model, self.tok, text, self.answer_ids)
            self.forwards += 1
        return self.cache[key]

    def full(self) -> float:
        return self.logp([True] * len(self.item.segments))


def answer_logp(model, tokenizer, prompt: str, answer_ids: list[int]) -> float:
    """Σ_t log p(answer_t | prompt, answer_<t), one forward computing only the answer's logits."""
    p = tokenizer(prompt)["input_ids"]
    ids = torch.tensor([p + answer_ids])
    T = len(answer_ids)
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=T + 1).logits[0, :T].float()
    return float(logits.log_softmax(-1)[torch.arange(T), torch.tensor(answer_ids)].sum())


def loo(scorer: Scorer) -> np.ndarray:
    """Exact leave-one-out drops f(all) − f(all but i), one per segment."""
    n, full = len(scorer.item.segments), scorer.full()
    return np.array([full - scorer.logp([j != i for j in range(n)]) for i in range(n)])


def topk_drop(scorer: Scorer, scores: np.ndarray, k: int) -> float:
    """f(all) − f(without the k top-scored segments); ties broken by position."""
    top = set(np.argsort(-scores, kind="stable")[:k].tolist())
    return scorer.full() - scorer.logp([i not in top for i in range(len(scores))])


def lds_masks(n: int, count: int = 32, seed: int = 12345) -> np.ndarray:
    """Held-out random 50 % ablation masks (their own seed, apart from any method's ablations)."""
    rng = np.random.default_rng(seed + n)
    return rng.random((count, n)) < 0.5


def lds(scorer: Scorer, scores: np.ndarray, masks: np.ndarray) -> float:
    """Spearman between Σ_{kept} score and the actual log p(answer) over the masks (NaN without masks)."""
    if len(masks) == 0:
        return float("nan")
    actual = np.array([scorer.logp(m) for m in masks])
    pred = masks.astype(float) @ scores
    return _spearman(pred, actual)


def _spearman(a, b) -> float:
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return 0.0
    return float(spearmanr(a, b).statistic)


def fwd_bwd_seconds(model, tokenizer, item: Prompt, repeats: int = 1) -> float:
    """Seconds of one forward + backward of prompt + answer (log p(answer) as the target), best of repeats."""
    p, a = token_ids(tokenizer, item.prompt, item.answer)
    ids, T = torch.tensor([p + a]), len(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits = model(input_ids=ids, logits_to_keep=T + 1).logits[0, :T].float()
        logits.log_softmax(-1)[torch.arange(T), torch.tensor(a)].sum().backward()
        best = min(best, time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return best


def evaluate(scorer: Scorer, scores: np.ndarray, drops: np.ndarray, masks: np.ndarray) -> dict:
    """Every protocol figure for one method's segment scores on one prompt."""
    scores = np.asarray(scores, dtype=float)
    return {"top1": bool(np.argmax(scores) == np.argmax(drops)),
            "spearman": _spearman(scores, drops),
            "gold_top1": bool(int(np.argmax(scores)) in scorer.item.gold),
            **{f"drop{k}": topk_drop(scorer, scores, k) for k in (1, 3, 5)},
            "lds": lds(scorer, scores, masks)}
