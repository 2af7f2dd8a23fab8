"""Real labelled text: the VADER movie-review snippets, and the shipped MiniLM classifier trained on them.

The snippets (Hutto & Gilbert, "VADER: A Parsimonious Rule-based Model for Sentiment Analysis of Social Media
Text", ICWSM 2014; MIT licence, see ``minilm_reviews/LICENSE_VADER.txt``) are 10,605 sentences from movie
reviews, each with the mean of human sentiment ratings on −4..4. They ship only in the source distribution
of ``vaderSentiment==3.3.2`` (``additional_resources/hutto_ICWSM_2014.tar.gz``,
``movieReviewSnippets_GroundTruth.txt``: id, mean rating, sentence per line).

- Labels: positive (1) when the mean rating is above 0, negative (0) below; the snippets rated exactly 0 are
  left out.
- :func:`split` fixes the split: the labelled snippets in id order, permuted by numpy's PCG64 with
  :data:`SPLIT_SEED`; the first :data:`HELD_OUT` are the held-out test set, the rest the training pool.
- :func:`held_out` reads the held-out snippets shipped in this package (``minilm_reviews/heldout.tsv``), so
  the shipped model's accuracy can be checked without the source distribution.
- :func:`load_reviews_model` loads the shipped classifier (``minilm_reviews/``, see its MODEL_CARD.md): the
  pip-shipped all-MiniLM-L6-v2 (the ``text`` extra) with every layer fine-tuned: low-rank (LoRA) factors of
  every attention and MLP linear, merged into the package's weights at load, and the fully trained biases,
  LayerNorms, pooler and head, stored there in float32. Its training script is ``tools/train/train_reviews.py`` (in the
  source repository), which downloads the source distribution with pip.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CLASSES", "SPLIT_SEED", "HELD_OUT", "MAX_LENGTH", "REVIEWS_DIR", "Snippets", "parse_snippets",
           "split", "held_out", "load_reviews_model"]

#: Class names, index = label.
CLASSES = ("negative", "positive")
#: Seed of the fixed permutation that splits the snippets.
SPLIT_SEED = 2014
#: Number of held-out test snippets (the first of the permutation).
HELD_OUT = 500
#: Tokens per snippet the classifier reads (longer snippets are truncated).
MAX_LENGTH = 64
#: Folder of the shipped classifier's delta, config, model card, held-out snippets and the data's licence.
REVIEWS_DIR = Path(__file__).resolve().with_name("minilm_reviews")


@dataclass
class Snippets:
    """Labelled snippets: ``ids`` (int64), ``ratings`` (float64 mean human rating), ``texts``, ``labels``
    (int64, 1 = positive)."""

    ids: np.ndarray
    ratings: np.ndarray
    texts: list[str]

    @property
    def labels(self) -> np.ndarray:
        return (self.ratings > 0).astype(np.int64)

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, idx: Any) -> "Snippets":
        idx = np.asarray(idx, dtype=np.int64)
        return Snippets(self.ids[idx], self.ratings[idx], [self.texts[i] for i in idx])


def parse_snippets(text: str) -> Snippets:
    """The labelled snippets of a ``movieReviewSnippets_GroundTruth.txt`` / ``heldout.tsv`` text (id, rating,
    sentence, tab-separated), in id order, those rated exactly 0 left out.

    Raises:
        ValueError: a line does not have the three fields, or its id / rating is not a number.
    """
    rows = []
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rstrip("\r\n").split("\t", 2)
        try:
            rows.append((int(parts[0]), float(parts[1]), parts[2].strip()))
        except (IndexError, ValueError):
            raise ValueError(f"snippets line {k}: expected 'id<TAB>rating<TAB>sentence', got {line[:80]!r}") from None
    rows = sorted(r for r in rows if r[1] != 0)
    return Snippets(np.array([r[0] for r in rows], dtype=np.int64), np.array([r[1] for r in rows]),
                    [r[2] for r in rows])


def split(snippets: Snippets, seed: int = SPLIT_SEED, held: int = HELD_OUT) -> tuple[Snippets, Snippets]:
    """(held-out test set, training pool): the first ``held`` of the seeded permutation, and the rest in the
    permutation's order."""
    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(snippets))
    return snippets.subset(order[:held]), snippets.subset(order[held:])


def held_out(path: str | Path | None = None) -> Snippets:
    """The shipped held-out snippets (default ``REVIEWS_DIR / "heldout.tsv"``)."""
    file = Path(path) if path is not None else REVIEWS_DIR / "heldout.tsv"
    return parse_snippets(file.read_text(encoding="utf-8"))


def encode(tokenizer: Any, texts: list[str]) -> dict:
    """The tokenizer's (B, n) tensors for ``texts``, padded to the longest, truncated at :data:`MAX_LENGTH`."""
    return dict(tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"))


def load_reviews_model(path: str | Path | None = None) -> Any:
    """The shipped review classifier in eval mode, float32, offline: ``BertForSequenceClassification``
    (2 classes, :data:`CLASSES`) from the pip-shipped all-MiniLM-L6-v2 weights and ``path/delta.safetensors``
    (default :data:`REVIEWS_DIR`; its low-rank pairs merged by :func:`attnroll.models.evidence.merge_low_rank`).
    Raises as :func:`attnroll.models.evidence.load_delta_model`."""
    from .evidence import load_delta_model

    return load_delta_model(REVIEWS_DIR if path is None else Path(path), "tools/train/train_reviews.py")
