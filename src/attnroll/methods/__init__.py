"""Explanation methods, one file each: every module of this package is a method file.

Each is imported when the package is imported; its ``@register(...)`` decorator adds the method to the
registry of :mod:`attnroll.explain` (registering a name twice raises). Adding a method is writing one file
here: nothing else to list. The built-in methods are imported first, in the order ``methods()`` shows them;
other files follow by name.

The machinery (``explain``, ``Explainer``, ``Explanation``, ``register``, ``Context``, batching) lives in
:mod:`attnroll.explain` and is re-exported here, where it has always been importable.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from .._callable import make_callable as _make_callable
from ..explain import (
    BatchScores,
    Context,
    Explainer,
    Explanation,
    Method,
    batch_size_of,
    check_options,
    explain,
    explain_batches,
    explain_targets,
    iter_explanations,
    method_info,
    methods,
    register,
    take_rows,
)
from ..explain.context_attribution import ContextAttribution, context_attribution
from ..explain.generation_attribution import GenerationAttribution, generation_attribution

__all__ = ["explain", "Explainer", "Explanation", "methods", "method_info", "check_options", "register", "Method",
           "Context", "explain_batches", "iter_explanations", "BatchScores", "explain_targets", "batch_size_of",
           "take_rows", "context_attribution", "ContextAttribution", "generation_attribution",
           "GenerationAttribution"]

#: The built-in method files, in the order of ``methods()``.
_BUILT_IN = ("raw", "rollout", "per_head_rollout", "flow", "grad_rollout", "gae", "attn_gradcam", "encdec", "clip",
             "captum_baselines", "random_baseline")


def _import_method_files() -> None:
    found = {m.name for m in _pkgutil.iter_modules(__path__)}
    for name in [n for n in _BUILT_IN if n in found] + sorted(found - set(_BUILT_IN)):
        _importlib.import_module(f"{__name__}.{name}")


_import_method_files()


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
