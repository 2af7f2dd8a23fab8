"""What :func:`attnroll.models.load_model` checks before a model is explained, so that a model folder never
runs code nobody asked for and a wrong model never gives a plausible map:

- **remote code**: a folder whose configuration names its own Python classes (``auto_map``) is refused
  unless ``trust_remote_code=True`` (``--trust-remote-code``); transformers is always called with
  ``trust_remote_code`` given explicitly, so it never asks on the terminal;
- **partial weights**: every weight the model has must come from the files, every tensor in the files must
  be used, and every shape must fit; else an error naming the keys, unless ``allow_partial_weights=True``
  (``--allow-partial-weights``, a warning then names them);
- **tokenizer**: a text model's tokenizer must know words (a folder without its tokenizer files gets a
  tokenizer of a few special tokens that turns every word into the unknown token).
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = ["RemoteCodeError", "PartialWeightsError", "TokenizerError", "TRUST_HINT", "PARTIAL_HINT",
           "check_remote_code", "check_weights", "compare_state", "check_tokenizer", "quiet_load_report"]

#: How to ask for a folder's own code, as the library and the command line spell it.
TRUST_HINT = "trust_remote_code=True (--trust-remote-code on the command line)"
#: How to accept weights that do not cover the model.
PARTIAL_HINT = "allow_partial_weights=True (--allow-partial-weights on the command line)"
#: The configuration files of a folder in which transformers looks for ``auto_map`` (custom classes).
CONFIG_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json",
                "image_processor_config.json", "video_preprocessor_config.json", "feature_extractor_config.json")
#: Common English words: a tokenizer that knows words maps them (nearly all) to real pieces.
PROBE = "the people in the city said that a new school and a good house are on the way to the park"
#: At least this share of the probe's pieces unknown: the tokenizer does not know words.
UNKNOWN_SHARE = 0.9
#: A tokenizer with fewer entries than this share of the model's ``vocab_size`` is not the model's.
VOCAB_SHARE = 0.5
#: How many keys a message lists before "and N more".
FEW = 5


class RemoteCodeError(ValueError):
    """A model folder asks to run its own Python code and ``trust_remote_code`` was not given."""


class PartialWeightsError(ValueError):
    """The weights files do not cover the model (missing, unexpected or wrongly shaped tensors)."""


class TokenizerError(ValueError):
    """A text model's tokenizer does not know words (no tokenizer files, or not the model's tokenizer)."""


def _auto_map(path: Path) -> list[str]:
    """``file: Auto class -> module.Class`` for each custom class the folder's configuration files name."""
    found = []
    for name in CONFIG_FILES:
        f = path / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # an unreadable file is transformers' to report
        auto = data.get("auto_map") if isinstance(data, dict) else None
        if auto:
            items = auto.items() if isinstance(auto, dict) else [("auto_map", auto)]
            found += [f"{name}: {k} -> {v}" for k, v in items]
    return found


def check_remote_code(path: Path, trust: bool) -> None:
    """Refuse a folder that names its own Python classes (``auto_map``) unless ``trust`` is True."""
    found = _auto_map(path)
    if found and not trust:
        more = f" and {len(found) - 2} more" if len(found) > 2 else ""
        raise RemoteCodeError(
            f"model {path}: the folder asks to run its own Python code ({'; '.join(found[:2])}{more}); attnroll "
            f"runs no code from a model folder unless asked: pass {TRUST_HINT} if you trust this folder's .py files")


def _few(keys: Iterable[Any]) -> str:
    keys = sorted(keys, key=str)
    shown = ", ".join(str(k) for k in keys[:FEW])
    return shown + (f" and {len(keys) - FEW} more" if len(keys) > FEW else "")


def _shape(s: Any) -> str:
    return "(" + ", ".join(str(int(d)) for d in s) + ")"


def check_weights(where: str, missing: Iterable[str], unexpected: Iterable[str], mismatched: Iterable[Any],
                  allow: bool, errors: Iterable[str] = ()) -> None:
    """Raise :class:`PartialWeightsError` naming the keys when the files do not cover the model (``mismatched``:
    (key, shape in the files, shape in the model) triples); with ``allow``, warn instead."""
    missing, unexpected, mismatched, errors = sorted(missing), sorted(unexpected), list(mismatched), list(errors)
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's tensors missing from the files ({_few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensors in the files the model does not have ({_few(unexpected)})")
    if mismatched:
        described = [f"{k} {_shape(a)} in the files, {_shape(b)} in the model" for k, a, b in mismatched]
        parts.append(f"{len(mismatched)} tensors of the wrong shape ({_few(described)})")
    if errors:
        parts.append(f"loading errors: {_few(errors)}")
    if not parts:
        return
    msg = f"{where}: the weights do not match the model: " + "; ".join(parts)
    if allow:
        warnings.warn(msg + "; loaded anyway, as asked (partial weights allowed): missing and wrongly shaped "
                      "tensors are random, unused ones are ignored", UserWarning, stacklevel=3)
        return
    raise PartialWeightsError(
        msg + "; the model's output would come from random weights. Give the complete weights of this "
        f"architecture, or pass {PARTIAL_HINT} to explain it with random weights where they are missing")


def compare_state(model_state: dict, state: dict) -> tuple[list[str], list[str], list[tuple]]:
    """(missing, unexpected, mismatched) keys of a state dict ``state`` against a model's ``model_state``."""
    missing = [k for k in model_state if k not in state]
    unexpected = [k for k in state if k not in model_state]
    mismatched = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in model_state.items()
                  if k in state and tuple(state[k].shape) != tuple(v.shape)]
    return missing, unexpected, mismatched


class _DropLoadReport(logging.Filter):
    """Drops transformers' loading report for one folder: attnroll states the same keys itself."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.marker = f" LOAD REPORT\x1b[0m from: {path}\n"

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.marker not in record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not ours to drop
            return True


@contextlib.contextmanager
def quiet_load_report(path: Path) -> Iterator[None]:
    """Around one ``from_pretrained`` of ``path``: transformers' table of missing / unexpected / mismatched
    keys of that folder is left out (exact pattern), since :func:`check_weights` reports the same keys."""
    log = logging.getLogger("transformers.modeling_utils")
    flt = _DropLoadReport(path)
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)


def _vocab_size(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def check_tokenizer(tok: Any, config: Any, path: Path) -> None:
    """Refuse a tokenizer that does not know words: the probe sentence of common words (:data:`PROBE`) comes
    out (nearly) all unknown tokens, or as nothing, or the vocabulary is a fraction of the model's."""
    try:
        ids = list(tok(PROBE, add_special_tokens=False)["input_ids"])
    except Exception as e:  # noqa: BLE001
        raise TokenizerError(f"model {path}: its tokenizer cannot encode a plain sentence: {e}") from None
    unk = getattr(tok, "unk_token_id", None)
    n_unk = sum(i == unk for i in ids) if unk is not None else 0
    size, want = len(tok), _vocab_size(config)
    why = None
    if not ids:
        why = "it turns a sentence of common words into no tokens"
    elif n_unk >= UNKNOWN_SHARE * len(ids):
        why = (f"it turns {n_unk} of the {len(ids)} pieces of a sentence of common words into the unknown token "
               f"{getattr(tok, 'unk_token', None)!r} (a vocabulary of {size} tokens)")
    elif want is not None and size < VOCAB_SHARE * want:
        why = f"its vocabulary has {size} tokens, the model's {want}"
    if why is not None:
        raise TokenizerError(
            f"model {path}: the tokenizer is not this model's: {why}; the folder needs the tokenizer files the "
            "model was trained with (tokenizer.json, or vocab.txt / vocab.json / tokenizer.model with "
            "tokenizer_config.json)")
