"""The method registry: ``register`` (the decorator every method file uses), ``methods()``, ``method_info``.

A method is a function ``fn(ctx, **options) -> Explanation`` registered under a name with the options it
accepts (and their defaults). The method files are the modules of :mod:`attnroll.methods`; each registers
itself when imported. This package sits below them, so the registry imports them at the first question
asked of it (:func:`registered`), never at import time: asking for a method then always finds it, however
the package was imported, and there is no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .explanation import Explanation

__all__ = ["Method", "register", "methods", "method_info", "registered"]


@dataclass
class Method:
    """A registered method: its function, accepted options with defaults, and table facts."""

    name: str
    fn: Callable[..., Explanation]
    description: str
    options: dict[str, Any]
    needs_grad: bool = False
    class_specific: bool = False
    cost: str = ""
    reference: str = ""
    #: option name -> why it is refused and what to use instead (for options of other methods)
    refuse: dict[str, str] = field(default_factory=dict)
    #: False for methods that read no layer's mixing (input gradients, the random control): the ``mixers=``
    #: option's refusal of token mixers other than attention does not concern them
    reads_layers: bool = True


_REGISTRY: dict[str, Method] = {}


def register(
    name: str,
    *,
    description: str,
    options: dict[str, Any] | None = None,
    needs_grad: bool = False,
    class_specific: bool = False,
    cost: str = "",
    reference: str = "",
    refuse: dict[str, str] | None = None,
    reads_layers: bool = True,
) -> Callable:
    """Decorator registering ``fn(ctx, **options) -> Explanation`` under ``name``."""

    if name in _REGISTRY:
        raise ValueError(f"method name {name!r} is already registered (by {_REGISTRY[name].fn.__module__}); "
                         "choose another name")

    def deco(fn: Callable) -> Callable:
        _REGISTRY[name] = Method(
            name, fn, description, dict(options or {}), needs_grad, class_specific, cost, reference, dict(refuse or {}),
            reads_layers,
        )
        return fn

    return deco


def registered() -> dict[str, Method]:
    """Name -> :class:`Method` of every registered method, in registration order, the method files of
    :mod:`attnroll.methods` imported first (each registers itself on import)."""
    from .. import methods  # noqa: F401  the one import upward, at call time (tests/test_architecture.py)

    return _REGISTRY


def methods() -> dict[str, str]:
    """Registered method names -> one-line descriptions (in registration order)."""
    return {name: m.description for name, m in registered().items()}


def method_info(name: str) -> Method:
    """The registry entry of ``name`` (options, cost, reference...); ValueError listing the methods if unknown."""
    found = registered()
    if not isinstance(name, str) or name not in found:
        listing = "; ".join(f"{k}: {m.description}" for k, m in found.items())
        raise ValueError(f"method must be one of the registered methods, got {name!r}. Methods: {listing}")
    return found[name]
