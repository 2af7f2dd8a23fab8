"""Context attribution's "checked": a gradient ranking whose leading candidates are verified by exact leave-one-out.

A gradient method (``base``: "gate_grad", the key-gate estimate of leave-one-out, or "attn_grad") ranks the
prompt's units in one forward + backward. The ``r`` units it ranks highest are then removed one at a time, as
leave-one-out does (the unit's text and the whitespace after it cut out of the prompt, which is re-tokenised:
positions shift as in ContextCite's ablations), and the answer's log-probability is recomputed by one forward
each without gradient: their exact drops f(all) − f(without j), in nats. The rule that combines the two:

- the ``r`` checked units are ordered by their exact drops and keep them as their scores;
- every other unit keeps the base's order, below every checked unit: its score is the base score times c
  (c = Σ checked drops / Σ their base scores when both are positive, else 1: the base's scale mapped onto the
  drops), lowered by one common shift where needed so that the highest one stays under the smallest checked
  drop.

So the top unit is the one among the base's ``r`` candidates whose removal costs the answer most, at ``r``
forwards on top of the base; ``r`` ≥ the number of units is exact leave-one-out. f(all) is read off the base's
own unmodified forward (the capture that finds the attention sinks) where there is one, else one more forward;
so are that forward's keys and values, and each ablated prompt is computed from its first changed token on.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Sequence

import torch
from torch import nn

from . import prompts

#: The units verified by exact leave-one-out unless ``r`` is given (the validation choice, EVALUATION.md).
DEFAULT_R = 4

#: The gradient rankings "checked" can verify.
BASES = ("gate_grad", "attn_grad")


def check_r(r: Any) -> int:
    """``r`` as an int ≥ 1, else a TypeError / ValueError saying what was expected."""
    if isinstance(r, bool) or not isinstance(r, numbers.Integral):
        raise TypeError(f"method 'checked' takes r, the number of top-ranked units verified by exact leave-one-out, "
                        f"as a positive integer; got {r!r}")
    if int(r) < 1:
        raise ValueError(f"method 'checked' needs r >= 1 (the number of top-ranked units verified by exact "
                         f"leave-one-out), got {int(r)}")
    return int(r)


def split_options(options: dict) -> tuple[str, int, dict]:
    """(base method, r, the base's own options) of the options given to method "checked"."""
    rest = dict(options)
    base = rest.pop("base", "gate_grad")
    if base not in BASES:
        raise ValueError(f"method 'checked' verifies the ranking of one of {', '.join(BASES)} (option 'base'), "
                         f"got {base!r}")
    return base, check_r(rest.pop("r", DEFAULT_R)), rest


def without(prompt: str, span: tuple[int, int]) -> str:
    """``prompt`` with the text in ``span`` removed together with the whitespace right after it (passages joined
    by blank lines lose their separator, as leave-one-out's re-rendered prompt does)."""
    a, b = span
    while b < len(prompt) and prompt[b].isspace():
        b += 1
    return prompt[:a] + prompt[b:]


def answer_logprob(model: nn.Module, prompt_ids: torch.Tensor, answer_ids: Sequence[int]) -> float:
    """Σ_t log p(answer_t | prompt, answer_<t) by one forward without gradient (plain causal attention, any
    kernel; only the answer's logits computed where the model allows)."""
    T = len(answer_ids)
    ids = torch.cat([prompt_ids, torch.tensor([list(answer_ids)], dtype=prompt_ids.dtype,
                                              device=prompt_ids.device)], dim=1)
    kw = {"logits_to_keep": T + 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        logits = model(input_ids=ids, **kw).logits[0, -T - 1:-1]
    return _logprob(logits, answer_ids)


def _logprob(logits: torch.Tensor, answer_ids: Sequence[int]) -> float:
    """Σ_t log_softmax(logits[t])[answer_t] for (T, V) logits predicting the answer's tokens."""
    logp = (logits if logits.dtype == torch.float64 else logits.float()).log_softmax(dim=-1)
    return float(logp[torch.arange(len(answer_ids)), torch.tensor(list(answer_ids), device=logits.device)].sum())


class FullProbe:
    """Within ``with``, keeps f(all) from the first forward of ``model`` on exactly ``ids`` (1, n), without an
    attention mask (an unmodified pass, e.g. the capture that finds the sinks); ``full`` stays None otherwise."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, answer_ids: Sequence[int]):
        self.model, self.ids, self.answer_ids = model, ids, list(answer_ids)
        self.full: float | None = None
        self.kv: list | None = None
        self._hook = None

    def _seen(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if (self.full is not None or kwargs.get("attention_mask") is not None or logits is None
                or not isinstance(ids, torch.Tensor) or ids.shape != self.ids.shape or not torch.equal(ids, self.ids)
                or logits.shape[1] != ids.shape[1]):
            return
        T = len(self.answer_ids)
        self.full = _logprob(logits[0, -T - 1:-1].detach(), self.answer_ids)
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)  # newer / older name
        layers = getattr(cache, "layers", None) or []
        kv = [(getattr(lay, "keys", None), getattr(lay, "values", None)) for lay in layers]
        if kv and all(isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.shape[-2] == ids.shape[1]
                      for k, v in kv):
            self.kv = [(k.detach(), v.detach()) for k, v in kv]  # the keys and values to start ablations from

    def __enter__(self) -> "FullProbe":
        self._hook = self.model.register_forward_hook(self._seen, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()


def exact_drops(model: nn.Module, tokenizer: Any, prompt: str, spans: Sequence[tuple[int, int]],
                chosen: Sequence[int], answer_ids: Sequence[int], templated: bool, probe: "FullProbe") -> dict:
    """{unit j: f(all) − f(prompt without unit j)} for the ``chosen`` units (one forward each, plus one for
    f(all) when the ``probe`` saw none); the prompt re-encoded as the full one was (``templated``: chat template).
    Where the probe kept the full sequence's keys and values, an ablated prompt's forward starts where its tokens
    first differ from the full one's (the same numbers up to rounding, less compute)."""
    def f(text: str) -> float:
        ids = prompts.on_model(model, prompts.encode_prompt(tokenizer, text, templated).ids)
        if probe.kv is not None:
            try:
                return prefixed_logprob(model, ids, answer_ids, probe.ids, probe.kv)
            except (TypeError, ValueError, RuntimeError, ImportError, AttributeError):
                probe.kv = None  # a model whose cache this route does not fit: whole forwards
        return answer_logprob(model, ids, answer_ids)

    full = f(prompt) if probe.full is None else probe.full
    rest = {j: without(prompt, spans[j]) for j in chosen}
    return {j: full - f(text) for j, text in rest.items() if text.strip()}  # a unit that is the whole prompt: unchecked


def prefixed_logprob(model: nn.Module, prompt_ids: torch.Tensor, answer_ids: Sequence[int], full_ids: torch.Tensor,
                     kv: list) -> float:
    """:func:`answer_logprob` of ``prompt_ids`` (1, m), computed from the first token where it differs from
    ``full_ids`` (1, n) on, the common prefix's keys and values taken from ``kv`` (per layer, (1, H, n, d))."""
    from transformers import DynamicCache

    T = len(answer_ids)
    ids = torch.cat([prompt_ids, torch.tensor([list(answer_ids)], dtype=prompt_ids.dtype,
                                              device=prompt_ids.device)], dim=1)
    m = min(ids.shape[1], full_ids.shape[1])
    same = (ids[0, :m] == full_ids[0, :m].to(ids.device)).to(torch.int64)
    p = min(int(same.cumprod(0).sum()), prompt_ids.shape[1] - 1)  # the row predicting answer token 0 is recomputed
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k[:, :, :p], v[:, :, :p], i)
    params = inspect.signature(model.forward).parameters
    kw = {"logits_to_keep": T + 1} if "logits_to_keep" in params else {}
    kw["cache" if "cache" in params else "past_key_values"] = cache  # the newer name where the model takes it
    with torch.no_grad():
        logits = model(input_ids=ids[:, p:], use_cache=True, **kw).logits[0, -T - 1:-1]
    return _logprob(logits, answer_ids)


def combine(base: Sequence[float], exact: dict) -> list[float]:
    """The units' scores: the checked units' exact drops; every other unit its base score scaled by c and shifted
    under the smallest checked drop (see the module's docstring); base order kept among the unchecked."""
    base = [float(v) for v in base]
    if not exact:
        return base
    d = [exact[j] for j in exact]
    g = sum(base[j] for j in exact)
    c = sum(d) / g if sum(d) > 0 and g > 0 else 1.0
    rest = [j for j in range(len(base)) if j not in exact]
    scaled = {j: c * base[j] for j in rest}
    top = max(scaled.values(), default=None)
    shift = 0.0 if top is None or top < min(d) else top - min(d) + max(1e-6, 1e-6 * abs(min(d)))
    return [exact[j] if j in exact else scaled[j] - shift for j in range(len(base))]


def choose(base: Sequence[float], r: int) -> list[int]:
    """The ``r`` units the base ranks highest (ties: the earlier unit first)."""
    order = sorted(range(len(base)), key=lambda j: (-float(base[j]), j))
    return order[:r]


def reweight(token_scores: torch.Tensor, owner: Sequence[int], old: Sequence[float],
             new: Sequence[float]) -> torch.Tensor:
    """Token scores whose per-unit sums are ``new``: unit j's tokens scaled by new_j / old_j (spread evenly
    where old_j is 0); tokens outside every unit unchanged."""
    out = token_scores.clone()
    own = torch.tensor(list(owner))
    for j, (o, v) in enumerate(zip(old, new)):
        at = own == j
        if not bool(at.any()) or o == v:
            continue
        out[at] = out[at] * (v / o) if o != 0 else torch.full_like(out[at], v / int(at.sum()))
    return out
