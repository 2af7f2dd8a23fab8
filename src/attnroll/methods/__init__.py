"""Explanation methods: ``explain``, ``Explainer``, ``Explanation``, ``methods()``; one file per method.

Every module of this package other than ``base``, ``explanation``, ``batches`` and ``context`` (and private ``_*`` ones) is
a method file, imported when the package is imported; its ``@register(...)`` decorator adds the method to the registry
(registering a name twice raises). Adding a method is writing one file here: nothing else to list. The
built-in methods are imported first, in the order ``methods()`` shows them; other files follow by name.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from .._callable import make_callable as _make_callable
from .base import Context, Explainer, Method, check_options, explain, method_info, methods, register
from .batches import BatchScores, batch_size_of, explain_batches, explain_targets, iter_explanations, take_rows
from .explanation import Explanation

__all__ = ["explain", "Explainer", "Explanation", "methods", "method_info", "check_options", "register", "Method",
           "Context", "explain_batches", "iter_explanations", "BatchScores", "explain_targets"]

#: The built-in method files, in the order of ``methods()``.
_BUILT_IN = ("raw", "rollout", "per_head_rollout", "flow", "grad_rollout", "gae", "attn_gradcam", "encdec", "clip",
             "captum_baselines", "random_baseline")
_NOT_METHODS = {"base", "explanation", "batches", "context"}  # the infrastructure, not methods


def _import_method_files() -> None:
    found = {m.name for m in _pkgutil.iter_modules(__path__)
             if not m.name.startswith("_") and m.name not in _NOT_METHODS}
    for name in [n for n in _BUILT_IN if n in found] + sorted(found - set(_BUILT_IN)):
        _importlib.import_module(f"{__name__}.{name}")


_import_method_files()


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
