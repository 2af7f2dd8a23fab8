"""The interactive viewer: one self-contained HTML page (inline script and styles, data inside, no network).

- :func:`view` — explanations (several methods, layers, heads, long prompts, encoder-decoder matrices, an
  audit's two models) -> a :class:`ViewerPage`.
- :func:`explain_targets` — an encoder-decoder explained at every target position (the matrix rows).
"""

from .page import ViewerPage
from .targets import explain_targets
from .view import view

__all__ = ["view", "ViewerPage", "explain_targets"]
