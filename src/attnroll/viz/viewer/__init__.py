"""The interactive viewer: one self-contained HTML page (inline script and styles, data inside, no network).

- :func:`view` — explanations (several methods, layers, heads, long prompts, encoder-decoder matrices, an
  audit's two models) -> a :class:`ViewerPage`.

- :mod:`.context` — the pages of a decoder's context attribution (units ranked) and generation attribution
  (the generated × source matrix), built from their ``to_dict()`` records.

It imports nothing from the package above ``viz`` (explanations are recognised by their fields), so that
``Explanation.to_html(interactive=True)`` can build a page without an import cycle.
"""

from .api import view
from .page import ViewerPage, read_payload
from .quant import decode_rows

__all__ = ["view", "ViewerPage", "read_payload", "decode_rows"]
