"""Modules that can be called, so that a public function and the module it lives in share one name without
one hiding the other.

``attnroll.capture`` is the capture subpackage *and* works as ``attnroll.capture(model, inputs)``;
likewise ``attnroll.methods()``, ``attnroll.evaluate.audit(...)``, ``attnroll.evaluate.localisation(...)``,
``attnroll.viz.overlay(...)`` and ``attnroll.viz.panel(...)``. Before, the package bound those names to the
functions, so ``attnroll.capture`` was a function while ``import attnroll.capture.hf`` found a package: a
name meant two things depending on how it was reached. Now the name is always the module; calling it calls
the module's function of the same name (``attnroll.capture.capture``), so the public API is unchanged.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

__all__ = ["CallableModule", "make_callable"]


class CallableModule(types.ModuleType):
    """A module whose call is its main function: ``module(*args, **kwargs)`` is
    ``module.<__call_name__>(*args, **kwargs)``."""

    __call_name__: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__call_name__)(*args, **kwargs)


def make_callable(module_name: str, function: str | None = None) -> None:
    """Make the (already imported) module ``module_name`` callable as its function ``function`` (default: the
    function named like the module's last component). Call it at the end of that module."""
    module = sys.modules[module_name]
    name = function or module_name.rsplit(".", 1)[-1]
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{module_name}.{name} is not callable")
    module.__class__ = CallableModule
    module.__call_name__ = name
    module.__signature__ = inspect.signature(fn)
