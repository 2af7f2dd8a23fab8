"""attnroll: attention rollout, attention flow and their variants — what did a transformer look at?

The public API is re-exported here and nothing else. Every name is imported when first used (PEP 562), so
``import attnroll`` and the ``attnroll`` command's ``--help`` start at once: torch and the optional libraries
load with the first function that needs them. ``from attnroll import rollout`` and ``attnroll.rollout`` work
as always; ``__all__`` and ``dir(attnroll)`` list every public name.
"""

import importlib as _importlib
import importlib.util as _importlib_util
from typing import TYPE_CHECKING as _TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> the module that defines it (the attribute of the same name there). A name mapped to ``None``
#: is a subpackage, imported as a whole.
_LAZY: dict[str, str | None] = {
    # errors
    "UnsupportedModelError": "._checks",
    # the maths of rollout and flow (torch tensors or numpy arrays in, the same kind out)
    "fuse_heads": ".core.fusion",
    "add_residual": ".core.residual",
    "sparsify": ".core.sparsify",
    "rollout": ".core.rollout",
    "per_head_rollout": ".core.rollout",
    "attention_flow": "._system",  # core.flow.attention_flow with a progress bar and a memory check
    # recording a model's attention: `capture` is the subpackage, callable as its function,
    # attnroll.capture(model, inputs) (see attnroll._callable)
    "capture": None,
    "AttentionRecord": ".capture",
    # explaining a model: `explain` is the subpackage, callable as explain(model, inputs, ...), and `methods`
    # the subpackage of method files, callable as methods(): the registered names (see attnroll._callable)
    "explain": None,
    "Explainer": ".explain",
    "Explanation": ".explain",
    "methods": None,
    # long prompts: which parts of a decoder's context an answer relies on
    "context_attribution": ".explain.context_attribution",
    "ContextAttribution": ".explain.context_attribution",
    "generation_attribution": ".explain.generation_attribution",
    "GenerationAttribution": ".explain.generation_attribution",
    "vlm_generation_attribution": ".explain.vlm_generation_attribution",
    "VLMGenerationAttribution": ".explain.vlm_generation_attribution",
    # scoring explanations: attnroll.evaluate.deletion(...), attnroll.evaluate.audit(...)
    "evaluate": None,
    # whole datasets, read back as a DataFrame
    "read_batch": ".batch",
}

__all__ = [*_LAZY, "__version__"]

if _TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports on first use
    from . import capture, evaluate, explain, methods
    from ._checks import UnsupportedModelError
    from ._system import attention_flow
    from .batch import read_batch
    from .capture import AttentionRecord
    from .core.fusion import fuse_heads
    from .core.residual import add_residual
    from .core.rollout import per_head_rollout, rollout
    from .core.sparsify import sparsify
    from .explain import Explainer, Explanation
    from .explain.context_attribution import ContextAttribution, context_attribution
    from .explain.generation_attribution import GenerationAttribution, generation_attribution
    from .explain.vlm_generation_attribution import VLMGenerationAttribution, vlm_generation_attribution


def __getattr__(name: str) -> object:
    """The public name ``name`` (or the submodule ``attnroll.<name>``), imported on first use and kept."""
    if name in _LAZY:
        where = _LAZY[name]
        value = _importlib.import_module(f".{name}" if where is None else where, __name__)
        if where is not None:
            value = getattr(value, name)
    elif not name.startswith("__") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        value = _importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
