"""Peer tools run from their own packages, installed for benchmarks only into a separate folder:
``/work/main/.venv/bin/pip install --no-deps --target /work/peers context-cite at2 flashtrace tracllm``.

ContextCite 0.0.4 runs offline on our loaded model with our segments as its sources (its
``BaseContextPartitioner``) and our gold answer as its response. Its module imports nltk (and downloads
``punkt_tab`` at import), spaCy and ``datasets`` for sentence splitting and batching only; the partitioner we
pass makes the splitters unused, so tiny stand-ins are registered for those three imports (the package's
ablation, forward and LASSO code runs unchanged).

FlashTrace 0.1.1 (``flashtrace``, its default method ``FlashTrace.trace(method="flashtrace")``) runs offline on
our loaded model with our gold answer as its target. Its modules import, at module level, packages its
attribution never calls here: spaCy (``shared_utils`` builds a sentence splitter from ``en_core_web_sm``, or
spaCy's blank English pipeline with the rule-based sentencizer when that model is absent; the splitter is used
only by the legacy sentence aggregation, which now raises before calling it, and by the perturbation baseline),
seaborn (heatmap plots), wordfreq (the word-frequency baseline ``LLMBasicAttribution``). The Longformer it names
is imported from transformers (present) and loaded only by the perturbation baseline. Stand-ins for spaCy,
seaborn and wordfreq are registered; each raises a clear error if anything calls it, so a run that completes
shows they were not needed. Its token scores are summed per passage, as attnroll's segments are."""

from __future__ import annotations

import sys
import types

import numpy as np

PEERS = "/work/peers"


def _stand_ins() -> None:
    """Register minimal nltk / spacy / datasets modules unless the real ones import."""
    for name in ("nltk", "spacy", "spacy.lang", "spacy.lang.en", "datasets"):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
    nltk = sys.modules["nltk"]
    if not hasattr(nltk, "download"):
        nltk.download = lambda *a, **k: None
    if not hasattr(sys.modules["spacy"], "Language"):  # ``datasets`` checks spacy.Language when spacy is loaded
        sys.modules["spacy"].Language = type("Language", (), {})
    en = sys.modules["spacy.lang.en"]
    if not hasattr(en, "English"):
        en.English = object
    ds = sys.modules["datasets"]
    if not hasattr(ds, "Dataset"):
        class Dataset(list):
            @classmethod
            def from_dict(cls, d):
                keys = list(d)
                return cls({k: d[k][i] for k in keys} for i in range(len(d[keys[0]])))
        ds.Dataset = Dataset


class StandInCalled(RuntimeError):
    """A peer called a stand-in registered for an import it was expected not to use."""


def _refuse(what: str):
    def call(*args, **kwargs):
        raise StandInCalled(f"{what} is a stand-in registered by benchmarks/context/peers.py (the package is not "
                            "installed); the peer called it, so its result would need the real package")
    return call


def _flashtrace_stand_ins() -> None:
    """Register spaCy / seaborn / wordfreq stand-ins (unless the real ones import) for FlashTrace's
    module-level imports: spaCy's ``load`` fails as without ``en_core_web_sm``, so ``shared_utils`` builds
    the blank English pipeline, whose splitting refuses to run; plots and word frequencies refuse too."""
    _stand_ins()
    spacy = sys.modules["spacy"]
    if not hasattr(spacy, "blank"):
        class Pipeline:
            def __init__(self):
                self.pipe_names: list[str] = []

            def add_pipe(self, name, **where):
                self.pipe_names.append(name)

            __call__ = staticmethod(_refuse("spaCy's sentence splitting"))

        def load(name, *a, **k):
            raise OSError(f"spaCy model {name!r} is not installed (stand-in)")

        spacy.load, spacy.blank = load, lambda lang: Pipeline()
        spacy.Language.component = staticmethod(lambda name: (lambda fn: fn))
        for sub, attr, value in (("language", "Language", spacy.Language), ("tokens", "Doc", type("Doc", (), {}))):
            mod = sys.modules.setdefault(f"spacy.{sub}", types.ModuleType(f"spacy.{sub}"))
            setattr(mod, attr, getattr(mod, attr, value))
    for name, attr, what in (("seaborn", "heatmap", "seaborn's heatmap"),
                             ("wordfreq", "zipf_frequency", "wordfreq's zipf_frequency")):
        try:
            __import__(name)
        except ImportError:
            mod = sys.modules[name] = types.ModuleType(name)
            setattr(mod, attr, _refuse(what))


def flashtrace(model, tokenizer, item, hops: int = 1) -> np.ndarray:
    """FlashTrace's scores (its default method, ``hops`` hops) summed per passage; the prompt is our chat
    prompt as is (``use_chat_template=False``), the target our gold answer over the whole answer span."""
    if PEERS not in sys.path:
        sys.path.append(PEERS)
    _flashtrace_stand_ins()
    from flashtrace import FlashTrace

    from .methods import owners  # noqa: PLC0415 (methods imports attnroll; keep peers importable alone)

    tracer = FlashTrace(model, tokenizer)
    n_answer = len(tokenizer(item.answer, add_special_tokens=False)["input_ids"])
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")  # it reads output_attentions, which SDPA does not return
    try:
        trace = tracer.trace(prompt=item.prompt, target=item.answer, output_span=(0, n_answer - 1), hops=hops)
    finally:
        model.set_attn_implementation(before)
    tokens = np.asarray(trace.scores, dtype=float)
    own = owners(tokenizer, item.prompt, item.segments)
    if len(tokens) != len(own):
        raise ValueError(f"FlashTrace scored {len(tokens)} prompt tokens, the prompt has {len(own)}")
    return np.array([tokens[own == i].sum() for i in range(len(item.segments))])


def context_cite_module():
    """The installed ``context_cite`` package (``PEERS`` on the path, stand-ins registered)."""
    if PEERS not in sys.path:
        sys.path.append(PEERS)
    _stand_ins()
    import context_cite
    from context_cite.context_partitioner import BaseContextPartitioner

    return context_cite, BaseContextPartitioner


def context_cite(model, tokenizer, item, ablations: int, reuse: dict | None = None) -> np.ndarray:
    """ContextCite's LASSO scores per segment from ``ablations`` random 50 % ablations (its own seeds
    0..N−1, so a smaller N uses the first N of a larger run: pass that run's ``reuse`` cache)."""
    cc_mod, Base = context_cite_module()

    class Passages(Base):
        def __init__(self, context, parts):
            super().__init__(context)
            self.parts = parts

        @property
        def num_sources(self):
            return len(self.parts)

        def split_context(self):
            pass

        def get_source(self, index):
            return self.parts[index]

        def get_context(self, mask=None):
            keep = np.ones(len(self.parts), bool) if mask is None else mask
            return "\n\n".join(p for p, k in zip(self.parts, keep) if k)

    context = "\n\n".join(item.segments)
    cc = cc_mod.ContextCiter(model, tokenizer, context, item.question, num_ablations=ablations,
                             partitioner=Passages(context, item.segments))
    cc._cache["output"] = item.prompt + item.answer  # our gold answer as the response
    if reuse:
        cc._cache["reg_masks"] = reuse["reg_masks"][:ablations]
        cc._cache["reg_logit_probs"] = reuse["reg_logit_probs"][:ablations]
    scores = cc.get_attributions(verbose=False)
    if reuse is not None and not reuse:
        reuse.update(cc._cache)
    return np.asarray(scores, dtype=float)
