"""Two small state-space classifiers trained from scratch on the evidence sentences (:mod:`.evidence`), to measure
what composing the token mixers into a map is worth on a model whose evidence is known:

- ``bamba-evidence``: a hybrid, transformers' ``BambaForCausalLM`` with four layers: Mamba-2 mixers in layers 0, 1
  and 3, softmax attention in layer 2;
- ``mamba2-evidence``: a pure state-space stack, transformers' ``Mamba2ForCausalLM`` with three Mamba-2 layers.

Both read words, one token each (a word-level vocabulary of the generator's words, ``vocab.json`` in the model's
folder), with an end token ``[END]`` appended; the class is read off the last real token, as a decoder classifier
does: the language-model head has one output per class and :class:`LastTokenClassifier` returns its logits at the
last position the attention mask keeps (B, 2). The transformers classes are the real ones, so ``attnroll.explain``
captures them through its usual path (the mixers composed, see docs/methods.md).

- :func:`load_state_space_model` ``(name)``: the shipped model (eval mode, float32) and its tokenizer;
- :func:`build_model` ``(kind, vocab_size)``: a fresh, untrained one (the training recipe's start);
- :func:`word_tokenizer` ``(vocab)``: the word-level fast tokenizer (``[PAD]`` 0, ``[UNK]`` 1, ``[END]`` 2).

The training recipe is ``tools/train/train_state_space.py`` (source repository); each folder's MODEL_CARD.md
records its command, data, held-out accuracy and limits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "SPECIALS", "LastTokenClassifier", "build_model", "word_tokenizer", "vocabulary",
           "load_state_space_model", "model_dir"]

#: Shipped model name -> (folder under attnroll/models, architecture kind).
MODELS = {"bamba-evidence": ("bamba_evidence", "hybrid"), "mamba2-evidence": ("mamba2_evidence", "ssm")}
#: The special tokens, in id order: padding, unknown word, the end token whose row is read out.
SPECIALS = ("[PAD]", "[UNK]", "[END]")
_HIDDEN = 64
#: Architecture kind -> (transformers config class name, its fields).
_CONFIGS = {
    "hybrid": ("BambaConfig", dict(hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=4,
                                   attn_layer_indices=[2], num_attention_heads=4, num_key_value_heads=4,
                                   mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16,
                                   mamba_n_groups=1, mamba_expand=2)),
    "ssm": ("Mamba2Config", dict(hidden_size=_HIDDEN, num_hidden_layers=3, num_heads=4, head_dim=32,
                                 state_size=16, n_groups=1, chunk_size=16, expand=2)),
}


class LastTokenClassifier:
    """Mixed in before a transformers ``...ForCausalLM`` whose ``lm_head`` has one output per class: ``forward``
    returns ``SequenceClassifierOutput(logits)`` with the logits (B, classes) of the last token each row's
    attention mask keeps (right padding)."""

    def forward(self, input_ids: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
        import torch
        from transformers.modeling_outputs import SequenceClassifierOutput

        kwargs.pop("labels", None)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if attention_mask is None:
            last = torch.full((out.logits.shape[0],), out.logits.shape[1] - 1, device=out.logits.device)
        else:
            last = attention_mask.sum(dim=1) - 1
        return SequenceClassifierOutput(logits=out.logits[torch.arange(out.logits.shape[0]), last])


def _classes() -> dict[str, Any]:
    """kind -> the classifier class (built lazily: transformers is an extra)."""
    import transformers as T

    return {"hybrid": type("BambaLastTokenClassifier", (LastTokenClassifier, T.BambaForCausalLM), {}),
            "ssm": type("Mamba2LastTokenClassifier", (LastTokenClassifier, T.Mamba2ForCausalLM), {})}


_CLASS_CACHE: dict[str, Any] = {}


def _class_of(kind: str) -> Any:
    if not _CLASS_CACHE:
        _CLASS_CACHE.update(_classes())
    return _CLASS_CACHE[kind]


def build_model(kind: str, vocab_size: int, n_classes: int = 2) -> Any:
    """A fresh classifier of ``kind`` ("hybrid" or "ssm"; weights from torch's current seed), float32."""
    import torch
    import transformers as T

    if kind not in _CONFIGS:
        raise ValueError(f"kind must be one of {', '.join(_CONFIGS)}, got {kind!r}")
    cls_name, fields = _CONFIGS[kind]
    cfg = getattr(T, cls_name)(vocab_size=int(vocab_size), tie_word_embeddings=False, pad_token_id=0,
                               eos_token_id=2, bos_token_id=None, **fields)
    cfg.num_labels = int(n_classes)
    model = _class_of(kind)(cfg)
    model.lm_head = torch.nn.Linear(_HIDDEN, int(n_classes), bias=False)
    return model


def vocabulary() -> list[str]:
    """The special tokens then every word the evidence generator can write, sorted (the training vocabulary)."""
    from . import evidence as ev

    words: set[str] = {*ev.POSITIVE, *ev.NEGATIVE, *ev.NEGATORS, *ev._SUBJECTS, *ev._INTENSIFIERS, "and"}
    for before, verb in ev._FRAMES:
        words.update((*before, verb))
    for clause in (*ev._DISTRACTORS, *ev._SEPARATORS):
        words.update(clause)
    return [*SPECIALS, *sorted(words)]


def word_tokenizer(vocab: list[str]) -> Any:
    """A fast tokenizer over whole words (split on whitespace), ``[END]`` appended to every sequence, padding
    with ``[PAD]`` on the right; unknown words become ``[UNK]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if list(vocab[:len(SPECIALS)]) != list(SPECIALS):
        raise ValueError(f"vocab must start with {SPECIALS}, got {vocab[:3]}")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A [END]", special_tokens=[("[END]", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[END]",
                                   padding_side="right")


def model_dir(name: str) -> Path:
    """The folder of a shipped model (:data:`MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"name must be one of {', '.join(MODELS)}, got {name!r}")
    return Path(__file__).resolve().with_name(MODELS[name][0])


def load_state_space_model(name: str, path: str | Path | None = None) -> tuple[Any, Any]:
    """(model in eval mode, float32; its word tokenizer) of the shipped ``name`` (:data:`MODELS`), from ``path``
    (default its folder: ``model.safetensors`` and ``vocab.json``; the architecture is :func:`build_model`'s).

    Raises:
        ValueError: an unknown name, or weights that do not fit the model.
        FileNotFoundError: a file is missing (the message says how to rebuild it).
    """
    import torch
    from safetensors.torch import load_file

    folder = model_dir(name) if path is None else Path(path)
    kind = MODELS[name][1]
    for f in ("model.safetensors", "vocab.json"):
        if not (folder / f).is_file():
            raise FileNotFoundError(f"load_state_space_model: {folder / f} not found; rebuild it with "
                                    f"`python tools/train/train_state_space.py --model {name}` (source repository)")
    vocab = json.loads((folder / "vocab.json").read_text())
    torch.manual_seed(0)
    model = build_model(kind, len(vocab))
    state = load_file(str(folder / "model.safetensors"))
    own = model.state_dict()
    bad = sorted(set(own) ^ set(state)) + [k for k in own if k in state and own[k].shape != state[k].shape]
    if bad:
        raise ValueError(f"load_state_space_model: {folder / 'model.safetensors'} does not fit {name}: {bad[:5]}")
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return model.eval(), word_tokenizer(vocab)
