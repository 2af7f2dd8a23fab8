"""The default method per kind of model: ONE table, chosen by measurement, read by the command line.

Rule: the most faithful measured method whose cost is at most 3x one forward + backward of the model. Each
entry lists methods in order of preference: the first that applies to the model is used (a value-aware
method needs a layer anatomy, and a logit layer for ``decompx``; a gradient method needs a scalar to
explain). The measurements are in EVALUATION.md; the table cites them. ``explain()`` in Python keeps its own
default, ``method="rollout"`` (the public contract); ``attnroll explain`` / ``view`` / ``batch`` read this
table when ``-m`` is not given, and say which method they chose and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "Default", "DEFAULTS", "Choice", "model_kind", "choose", "default_for"]

KINDS = ("image classifier", "text classifier", "sentence encoder", "decoder")
#: Where the measurements behind the table are.
SOURCE = "EVALUATION.md"


@dataclass(frozen=True)
class Default:
    """A kind's defaults: ``methods`` in order of preference, ``why`` the measurement in one line."""

    methods: tuple[str, ...]
    why: str


DEFAULTS: dict[str, Default] = {
    # Shapes ViT, 200 held-out images (EVALUATION.md, "Shapes: the value-aware methods"): decompx deletion
    # 0.159 / positive perturbation 14.9, gae 0.221 / 21.1, rollout 0.289 / 27.6; decompx costs 2.87x an SDPA
    # forward at ViT-B/16 batch 8 (BENCHMARKS.md), under one forward + backward.
    "image classifier": Default(("decompx", "gae", "rollout"),
                                "most faithful on the shapes ViT (deletion 0.159 vs rollout 0.289)"),
    # minilm-reviews, real movie-review snippets (EVALUATION.md, "Real movie reviews (minilm-reviews)";
    # benchmarks/bench_text_defaults.py, benchmarks/text_defaults.json): chosen on 100 validation snippets by
    # comprehensiveness - sufficiency: decompx 0.452 / 0.014, alti_logit 0.415 / 0.028, grad_rollout 0.389 / 0.034,
    # gae 0.382 / 0.035, rollout 0.115 / 0.307, random 0.080 / 0.367; held-out (200): decompx 0.405 / -0.015 at
    # 0.94x fwd+bwd (alti_logit 0.359 / 0.002, gae 0.342 / 0.017).
    "text classifier": Default(("decompx", "alti_logit", "gae", "rollout"),
                               "most faithful on real movie reviews within 3x forward+backward"),
    # all-MiniLM-L6-v2 on the same snippets (32 per split), target = cosine similarity to the nearest other
    # snippet (EVALUATION.md, same section): gae 0.151 / 0.075 (held-out 0.165 / 0.070, 0.79x fwd+bwd); without
    # a scalar to explain (no pair) the best map that needs none: norm_rollout 0.135 / 0.108 (rollout 0.085 /
    # 0.177, random 0.038 / 0.235). A bare encoder has no logit layer: decompx / alti_logit do not apply.
    "sentence encoder": Default(("gae", "norm_rollout", "rollout"),
                                "most faithful for sentence similarity within 3x forward+backward"),
    # SmolLM2-135M-Instruct, multi-passage QA against exact leave-one-out (EVALUATION.md, "Context attribution
    # on SmolLM2-135M-Instruct"; benchmarks/context/): of the methods `explain` has, gae ranked LOO's top passage
    # first in 4/4 held-out prompts (Spearman 0.09, top-1 log-prob drop 3.84 nats, 1.6x fwd+bwd), rollout 2/4
    # (-0.14, 2.22), even with its attention sink dropped. (Context attribution's own default, `checked`:
    # gate_grad's ranking with its top 4 passages verified by exact LOO, chosen on validation by top-1 agreement
    # with LOO, is no `explain` method: it needs the passages and the answer.)
    "decoder": Default(("gae", "grad_rollout", "rollout"),
                       "most faithful against leave-one-out on SmolLM2 context prompts within 3x forward+backward"),
}


@dataclass(frozen=True)
class Choice:
    """The method chosen for a model: ``method``, the model's ``kind``, and ``note`` (one line saying why)."""

    method: str
    kind: str
    note: str


def model_kind(model: Any, modality: str, has_scores: bool | None = None) -> str:
    """One of :data:`KINDS`: ``modality`` "image" → image classifier; a model that generates (transformers'
    ``can_generate()``) → decoder; a text model with class scores (``has_scores``, else a logit layer in its
    anatomy) → text classifier; else sentence encoder."""
    if modality == "image":
        return "image classifier"
    gen = getattr(model, "can_generate", None)
    try:
        if callable(gen) and gen():
            return "decoder"
    except Exception:  # a model whose can_generate needs more than itself: not a decoder we know
        pass
    if has_scores is None:
        has_scores = _anatomy(model)[1]
    return "text classifier" if has_scores else "sentence encoder"


def _anatomy(model: Any) -> tuple[Any, bool]:
    """(the model's layer anatomy usable by the value-aware methods or None, whether it has a logit layer)."""
    try:
        from ..capture import model_facts

        anat = model_facts(model).anatomy
    except Exception:  # an unsupported model: the command's own explain call says why
        return None, False
    if anat is None or anat.value_aware:
        return None, False
    return anat, anat.classifier is not None and not anat.head_reason


def _refusal(model: Any, method: str, scalar: bool) -> str:
    """Why ``method`` does not apply to ``model`` ("" when it does)."""
    from .registry import method_info

    info = method_info(method)
    if info.needs_grad and not scalar:
        return "it needs a scalar to explain and the model has no class scores"
    if method in ("decompx", "alti_logit", "alti", "globenc", "norm", "norm_rollout", "value_zeroing"):
        anat, head = _anatomy(model)
        if anat is None:
            return "the value-aware methods do not know the model's layers"
        if method in ("decompx", "alti_logit") and not head:
            return "it decomposes a logit layer and the model has none"
    return ""


def choose(model: Any, kind: str, *, scalar: bool = True, table: dict[str, Default] | None = None) -> Choice:
    """The default method for ``model`` of ``kind`` (:data:`KINDS`): the first of its table entry that applies
    (``scalar``: whether there is a scalar to explain, class scores or a similarity)."""
    entry = (DEFAULTS if table is None else table)[kind]
    skipped = []
    for m in entry.methods:
        why = _refusal(model, m, scalar)
        if not why:
            more = f"; {'; '.join(skipped)}" if skipped else ""
            return Choice(m, kind, f"method {m}: the default for {kind}s ({entry.why}; see {SOURCE}){more}")
        skipped.append(f"{m} skipped: {why}")
    raise ValueError(f"no default method of the {kind} entry applies to {type(model).__name__} "
                     f"({'; '.join(skipped)}); choose one with -m")


def default_for(lm: Any, *, has_scores: bool | None = None, scalar: bool | None = None) -> Choice:
    """:func:`choose` for a loaded model (``lm.model``, ``lm.kind`` "image" / "text")."""
    kind = model_kind(lm.model, lm.kind, has_scores)
    if kind == "decoder":  # a decoder always has a scalar to explain: its predicted next token's logit
        scalar = True
    return choose(lm.model, kind, scalar=(kind != "sentence encoder") if scalar is None else scalar)
