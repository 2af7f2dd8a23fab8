"""A method's options, checked before any model runs: :func:`check_options` (names: the method's own options
and the common ones, an option of another method refused naming the methods that take it) and the
model-free checks of option *values*: each option name (shared by every method that takes it) has one
rule, applied by ``check_options`` before any model runs, so that ``explain(..., alpha="abc")``
and ``attnroll explain -o alpha=abc`` fail at once, naming the option, not after a forward pass. Rules
that need the model (``top_k`` <= n, ``start_layer`` < L, a stream's name) are checked again where the
record is known."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .. import _checks
from ..core import logit_rollout, residual, sparsify
from .registry import Method, method_info, registered

__all__ = ["COMMON_OPTIONS", "check_options", "check_values", "RULES"]

#: Options every method takes (besides its own): the output position to explain (row of the map, and the
#: position of a token-level target), and the readout (which rows, with what weights; overrides the model's).
#: ``sinks``: "drop" (default) takes a decoder's measured attention sinks out of the map, their share recorded in
#: ``Explanation.extra``; "keep" leaves them in (:mod:`attnroll.explain.sinks`).
#: ``mixers``: "compose" (default) refuses a model whose block stack holds token mixers other than softmax attention
#: that attnroll does not compose (Mamba, gated DeltaNet, short convolutions, RG-LRU; :mod:`attnroll.capture.mixers`);
#: "attention_only" rolls out through its attention layers alone, recorded in ``Explanation.extra["mixers"]`` and
#: warned about.
#: ``specials``: "drop" (default) leaves a text encoder's special tokens ([CLS], [SEP], <s>, ...) out of
#: ``Explanation.scores``, their share recorded; "keep" leaves them in (:mod:`attnroll.explain.specials`).
COMMON_OPTIONS = {"position": None, "readout": None, "sinks": "drop", "specials": "drop",
                  "mixers": "compose"}


def _optional(rule: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, v: None if v is None else rule(name, v)


def _n_jobs(name: str, v: Any) -> Any:
    n = _checks.check_int(name, v)
    if n < 1 and n != -1:
        raise ValueError(f"{name} must be a positive number of worker processes or -1 for all cores, got {n}")
    return n


def _position(name: str, v: Any) -> Any:
    if isinstance(v, (list, tuple)) or (isinstance(v, (np.ndarray, torch.Tensor)) and v.ndim == 1):
        return [_checks.check_int(f"{name}[{i}]", p) for i, p in enumerate(v)]
    return _checks.check_int(name, v)


def _baseline(name: str, v: Any) -> Any:
    if isinstance(v, str):
        return _checks.check_choice(name, v, ("pad", "zeros"))
    return _checks.check_int(name, v, low=0)


def _stream(name: str, v: Any) -> Any:
    if not isinstance(v, str):
        raise TypeError(f"{name} must be the name of an attention stream (a string), got {_checks.describe(v)}")
    return v


#: option name -> rule(name, value) raising TypeError / ValueError; options not listed are not checked here.
RULES: dict[str, Callable[[str, Any], Any]] = {
    "alpha": lambda n, v: _checks.check_real(n, v, low=0.0, high=1.0),
    "residual_mode": lambda n, v: _checks.check_choice(n, v, residual.MODES),
    "head_fusion": lambda n, v: _checks.check_head_fusion(n, v, allow_none=False),
    "discard_ratio": lambda n, v: _checks.check_real(n, v, low=0.0, high=1.0, high_open=True),
    "discard_scope": lambda n, v: _checks.check_choice(n, v, sparsify.SCOPES),
    "top_k": _optional(lambda n, v: _checks.check_int(n, v, low=1)),
    "threshold": _optional(lambda n, v: _checks.check_real(n, v, low=0.0)),
    "protect_prefix": _optional(lambda n, v: _checks.check_int(n, v, low=0)),
    "start_layer": lambda n, v: _checks.check_int(n, v),
    "start_layer_text": lambda n, v: _checks.check_int(n, v),
    "end_layer": _optional(lambda n, v: _checks.check_int(n, v)),
    "layer": lambda n, v: _checks.check_int(n, v),
    "return_layers": _checks.check_bool,
    "normalize": _checks.check_bool,
    "transpose": _checks.check_bool,
    "dtype": lambda n, v: _checks.check_dtype(v),
    "clamp": lambda n, v: _checks.check_choice(n, v, ("per_head", "after_mean")),
    "mlp": _optional(lambda n, v: _checks.check_choice(n, v, logit_rollout.MLP_RULES)),
    "n_steps": lambda n, v: _checks.check_int(n, v, low=1),
    "internal_batch_size": _optional(lambda n, v: _checks.check_int(n, v, low=1)),
    "max_tokens": lambda n, v: _checks.check_int(n, v, low=1),
    "n_jobs": _optional(_n_jobs),
    "seed": lambda n, v: _checks.check_int(n, v),
    "baseline": _baseline,
    "stream": _optional(_stream),
    "position": _optional(_position),
    "sinks": lambda n, v: _checks.check_choice(n, v, ("drop", "keep")),
    "mixers": lambda n, v: _checks.check_choice(n, v, ("compose", "attention_only")),
    "specials": lambda n, v: _checks.check_choice(n, v, ("drop", "keep")),
}


def check_values(method: str, options: dict[str, Any]) -> None:
    """Check the value of every option in ``options`` that has a rule; errors name the method and the
    option (TypeError / ValueError from the shared checkers)."""
    for name, value in options.items():
        rule = RULES.get(name)
        if rule is None:
            continue
        try:
            rule(name, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"method {method!r}: {e}") from None


def check_options(method: str | Method, options: dict) -> dict:
    """Validate ``options`` for ``method`` (a name or its registry entry) and return them completed with the
    defaults. ValueError for an unknown method, an option it does not take (naming the methods that do) or
    an option it refuses (saying why)."""
    m = method if isinstance(method, Method) else method_info(method)
    allowed = {**COMMON_OPTIONS, **m.options}
    for k in options:
        if k in allowed:
            continue
        if k in m.refuse:
            raise ValueError(f"option {k}= makes no sense for method {m.name!r}: {m.refuse[k]}")
        takers = [n for n, other in registered().items() if k in other.options]
        hint = f" Methods that take {k}=: {', '.join(takers)}." if takers else ""
        raise ValueError(
            f"method {m.name!r} has no option {k!r}. Its options: {', '.join(sorted(allowed))}.{hint}"
        )
    check_values(m.name, options)  # values too, before any model runs
    return {**allowed, **options}
