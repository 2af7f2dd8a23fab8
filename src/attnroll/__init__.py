"""attnroll: attention rollout, attention flow and their variants — what did a transformer look at?

The public API is re-exported here and nothing else.
"""

from ._checks import UnsupportedModelError
from .core.fusion import fuse_heads
from .core.residual import add_residual
from .core.sparsify import sparsify
from .core.rollout import rollout, per_head_rollout
from ._system import attention_flow  # core.flow.attention_flow with a progress bar and a memory check

# --- capture (issue 4) ---
# `capture` is the subpackage, callable as its function: attnroll.capture(model, inputs) (see attnroll._callable)
from . import capture
from .capture import AttentionRecord
# --- end capture ---

# --- explain (issue 5) ---
# `methods` is the subpackage, callable as methods(): the registered names (see attnroll._callable)
from . import methods
from . import explain  # the subpackage, callable as explain(model, inputs, ...) (see attnroll._callable)
from .explain import Explainer, Explanation
# --- end explain ---

# --- long prompts (issue 16): context attribution for decoders ---
from .explain.context_attribution import ContextAttribution, context_attribution
# --- end long prompts ---

# --- evaluate (issue 7): the subpackage, as attnroll.evaluate.deletion(...), attnroll.evaluate.audit(...) ---
from . import evaluate

# --- batch (issue 14): whole datasets, read back as a DataFrame ---
from .batch import read_batch
# --- end batch ---

__version__ = "0.1.0"

__all__ = [
    "UnsupportedModelError",
    "fuse_heads",
    "add_residual",
    "sparsify",
    "rollout",
    "per_head_rollout",
    "attention_flow",
    "capture",
    "AttentionRecord",
    "explain",
    "Explainer",
    "Explanation",
    "methods",
    "context_attribution",
    "ContextAttribution",
    "evaluate",
    "read_batch",
    "__version__",
]
