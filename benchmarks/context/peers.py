"""Peer tools run from their own packages, installed for benchmarks only into a separate folder:
``/work/main/.venv/bin/pip install --no-deps --target /work/peers context-cite at2 flashtrace tracllm``.

ContextCite 0.0.4 runs offline on our loaded model with our segments as its sources (its
``BaseContextPartitioner``) and our gold answer as its response. Its module imports nltk (and downloads
``punkt_tab`` at import), spaCy and ``datasets`` for sentence splitting and batching only; the partitioner we
pass makes the splitters unused, so tiny stand-ins are registered for those three imports (the package's
ablation, forward and LASSO code runs unchanged)."""

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
