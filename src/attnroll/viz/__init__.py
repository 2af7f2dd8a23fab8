"""Pictures of explanations: overlays, method panels, per-layer and per-head figures, token highlights.

Every function takes an :class:`~attnroll.Explanation` (or a plain map) and returns a PIL image (or an
HTML string / rich Text for tokens); nothing is shown on screen, so it runs headless. Needs the ``viz``
extra (matplotlib on the Agg backend, pillow, rich), imported only when a function is called.

- :func:`overlay` — a patch map upsampled over its image with a colormap and alpha (optionally an outline).
- :func:`panel` — several methods side by side over several images.
- :func:`plot_layers` — the rollout row after each layer (``explain(..., return_layers=True)``).
- :func:`plot_heads` — one map per head (``per_head_rollout``, or a layer's raw attention).
- :func:`tokens_html` / :func:`print_tokens` / :func:`tokens_text` — token highlights (HTML page / terminal);
  :func:`explanation_html` — one Explanation as an HTML snippet (``Explanation.to_html``).
- :func:`view` — the interactive viewer: one self-contained HTML page (layers, methods, heads, pointer
  values, long prompts, encoder-decoder matrices (rows from ``attnroll.methods.explain_targets``), two models
  side by side).
- :func:`save_image` / :func:`atomic_write` — atomic file writes (temporary file, then rename).
"""

# `overlay` and `panel` are the modules, callable as their functions (see attnroll._callable)
from . import overlay, panel
from ._io import atomic_write, save_image
from .heads import plot_heads
from .layers import plot_layers
from .text import explanation_html, print_tokens, score_color, token_scores, tokens_html, tokens_text
from .viewer import ViewerPage, view

__all__ = [
    "overlay",
    "panel",
    "plot_layers",
    "plot_heads",
    "tokens_html",
    "explanation_html",
    "score_color",
    "tokens_text",
    "print_tokens",
    "token_scores",
    "view",
    "ViewerPage",
    "save_image",
    "atomic_write",
]
