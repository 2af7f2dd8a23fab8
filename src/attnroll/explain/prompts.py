"""A decoder's prompt as the model reads it, for context and generation attribution: the chat template put
around the user's prompt (its character offsets kept, so that units still refer to the user's text), the
answer's token ids (given or generated greedily) and readable token pieces (``" Tower"``, ``"\\n"``, not the
byte-level ``"ĠTower"`` / ``"Ċ"``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import _checks
from ..capture import model_facts
from ..capture.hf import is_hf_model

__all__ = ["Encoded", "on_model", "encode_prompt", "uses_template", "answer_ids", "readable_pieces", "answer_pieces",
           "is_decoder_lm", "check_decoder"]

#: Stands for the user's text while the template is rendered to find its own special tokens.
_PLACEHOLDER = "\u2063attnroll-prompt\u2063"


@dataclass
class Encoded:
    """The prompt as the model reads it.

    Attributes:
        ids: (1, n) token ids of the model's input (template included).
        offsets: per token, its character span [a, b) in the USER's prompt, (0, 0) for tokens outside it
            (special tokens, the chat template's text).
        text: the text the model reads (the templated text, or the prompt itself).
        start: where the user's prompt begins in ``text``.
        templated: whether the chat template was applied.
        pieces: per token, its readable text (see :func:`readable_pieces`).
    """

    ids: torch.Tensor
    offsets: list[tuple[int, int]]
    text: str
    start: int
    templated: bool
    pieces: list[str]


def on_model(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` on the device of the model's parameters (a model on a GPU gets its inputs there)."""
    p = next(iter(model.parameters()), None)
    return ids if p is None or p.device.type == "meta" else ids.to(p.device)


def is_decoder_lm(model: Any) -> bool:
    """A transformers model that generates text and is not an encoder-decoder."""
    if not is_hf_model(model) or model_facts(model).encoder_decoder:
        return False
    from transformers import GenerationMixin

    return isinstance(model, GenerationMixin)


def check_decoder(model: Any, what: str) -> None:
    """TypeError naming the model unless it is a decoder-only language model."""
    if not is_decoder_lm(model):
        name = getattr(getattr(model, "config", None), "model_type", None)
        named = f"{type(model).__name__}" + (f" ({name})" if name else "")
        if is_hf_model(model) and model_facts(model).encoder_decoder:
            named += ", an encoder-decoder"
        elif not isinstance(model, torch.nn.Module):
            named = _checks.describe(model)
        raise TypeError(f"{what} needs a transformers decoder-only language model (GPT-2, Llama, Qwen, SmolLM2, "
                        f"...), got {named}")


def _template_specials(tokenizer: Any) -> list[str]:
    """The special-token strings the chat template writes around a message."""
    rendered = _render(tokenizer, _PLACEHOLDER)
    specials = [s for s in (getattr(tokenizer, "all_special_tokens", None) or []) if s]
    return [s for s in specials if s in rendered.replace(_PLACEHOLDER, "")]


def _render(tokenizer: Any, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def uses_template(tokenizer: Any, prompt: str, chat_template: bool | None) -> bool:
    """Whether to apply the tokenizer's chat template: ``True`` / ``False`` as asked (True without a template
    is a ValueError); ``None``: when the tokenizer has one and the prompt holds none of the special tokens the
    template writes (a prompt already templated is read as it is)."""
    if chat_template is not None and not isinstance(chat_template, bool):
        raise TypeError(f"chat_template must be None, True or False, got {chat_template!r}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template is True and not has:
        raise ValueError(f"chat_template=True but the tokenizer ({type(tokenizer).__name__}) has no chat template; "
                         "give chat_template=False (the prompt as it is) or a tokenizer with one")
    if chat_template is not None:
        return chat_template
    return has and not any(s in prompt for s in _template_specials(tokenizer))


def encode_prompt(tokenizer: Any, prompt: str, chat_template: bool | None = None) -> Encoded:
    """Tokenise ``prompt`` as the model will read it (see :class:`Encoded`); a fast tokenizer is needed (its
    character offsets place tokens in the prompt's units)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
    if not getattr(tokenizer, "is_fast", True):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} is a slow tokenizer; context attribution needs a "
                         "fast one (character offsets): load it with use_fast=True")
    templated = uses_template(tokenizer, prompt, chat_template)
    text, start = prompt, 0
    if templated:
        text = _render(tokenizer, prompt)
        start = text.find(prompt)
        if start < 0:
            raise ValueError("the tokenizer's chat template rewrites the prompt's text (it does not occur as given "
                             "in the templated text); give chat_template=False and template the prompt yourself")
    enc = tokenizer(text, return_offsets_mapping=True, return_tensors="pt",
                    **({"add_special_tokens": False} if templated else {}))
    raw = [tuple(map(int, o)) for o in enc["offset_mapping"][0].tolist()]
    ids = enc["input_ids"]
    offsets = []
    for a, b in raw:
        a, b = max(a - start, 0), min(b - start, len(prompt))
        offsets.append((a, b) if b > a else (0, 0))
    return Encoded(ids, offsets, text, start, templated, readable_pieces(tokenizer, ids[0].tolist(), text, raw))


def readable_pieces(tokenizer: Any, ids: list[int], text: str, offsets: list[tuple[int, int]]) -> list[str]:
    """Each token's text: the characters from the end of the token before to its own end (so that a space
    the tokenizer folds into a word's token shows, ``" Tower"``); a token without characters (a special token
    the tokenizer adds) its vocabulary string."""
    out, end = [], 0
    names = _vocab_names(tokenizer, list(ids))
    for name, (a, b) in zip(names, offsets):
        if b > a:
            out.append(text[min(end, a):b])
            end = b
        else:
            out.append(str(name))
    return out


def answer_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Readable pieces of generated tokens: each token decoded after up to four tokens before it, keeping
    the difference (a character split across tokens shows on the token that completes it)."""
    out = []
    for i in range(len(ids)):
        before = tokenizer.decode(ids[max(0, i - 4):i])
        both = tokenizer.decode(ids[max(0, i - 4):i + 1])
        piece = both[len(before):] if both.startswith(before) else tokenizer.decode(ids[i:i + 1])
        out.append(piece.replace("\ufffd", "") or _vocab_names(tokenizer, [ids[i]])[0])
    return out


def _vocab_names(tokenizer: Any, ids: list[int]) -> list[str]:
    """The vocabulary strings of ``ids`` (``#id`` for a tokenizer that cannot name them)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    names = convert(list(ids)) if convert is not None else None
    return [str(n) if n is not None else f"#{i}" for n, i in zip(names or [None] * len(ids), ids)]


def answer_ids(model: Any, tokenizer: Any, prompt_ids: torch.Tensor, generate: int | None,
               answer: str | None) -> list[int]:
    """The answer's token ids: ``answer`` tokenised (no special tokens added; a list of token ids is taken as
    it is), or ``generate`` tokens
    generated greedily after ``prompt_ids`` (stopping early at the model's end-of-sequence token)."""
    if (generate is None) == (answer is None):
        raise ValueError("give exactly one of generate=N (tokens to generate) and answer='text'")
    if answer is not None:
        if isinstance(answer, (list, tuple)) and answer and all(isinstance(i, int) for i in answer):
            return [int(i) for i in answer]  # token ids, e.g. another attribution's answer_ids
        if not isinstance(answer, str):
            raise TypeError(f"answer must be a string or a non-empty list of token ids, got {answer!r}")
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"answer {answer!r} has no tokens")
        return list(ids)
    return greedy(model, {"input_ids": prompt_ids, "attention_mask": torch.ones_like(prompt_ids)}, generate)


def greedy(model: Any, inputs: dict, generate: Any) -> list[int]:
    """The ids of ``generate`` tokens the model generates greedily after one prompt's ``inputs`` (the model's own
    ``generate``; padding id: its pad token, else its end of text)."""
    n = _checks.check_int("generate", generate)
    if n < 1:
        raise ValueError(f"generate must be >= 1 (tokens to generate), got {n}")
    facts = model_facts(model)
    pad = facts.pad_token_id if facts.pad_token_id is not None else (facts.eos_token_id or 0)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, pad_token_id=pad)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
