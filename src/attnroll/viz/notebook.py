"""Results that show themselves: in a notebook as a sandboxed inline page, elsewhere as plain text with the
numbers.

:class:`NotebookView` is a mixin for any result class. The class says what its page is
(``_notebook_html()``: a complete HTML page or a snippet, everything inline) and what its plain text is
(``_plain_text()``); the mixin gives it

- ``_repr_html_()``: the page in an ``<iframe sandbox="allow-scripts" srcdoc="...">`` (Jupyter, VS Code and
  Colab call it), so that the page's script and styles neither reach nor are reached by the notebook's own,
  and nothing is fetched (the viewer's pages forbid it in their Content-Security-Policy);
- ``show()``: displays the same frame in a notebook; outside one (a script, a terminal, a pipe) it prints
  the plain text, which always holds the scores as numbers.

It imports nothing above ``viz``, and IPython only inside ``show()``.
"""

from __future__ import annotations

import html
import sys
from typing import Any

__all__ = ["NotebookView", "sandboxed_frame", "in_notebook"]


def sandboxed_frame(page: str, height: int = 420) -> str:
    """``page`` (HTML) inside a sandboxed ``iframe srcdoc``: scripts may run, but in an opaque origin with no
    access to the notebook (no ``allow-same-origin``), no forms, no pop-ups, no navigation of the notebook."""
    return (f"<iframe sandbox=\"allow-scripts\" style=\"width:100%;height:{int(height)}px;border:1px solid #ddd;"
            f"resize:vertical\" srcdoc=\"{html.escape(page, quote=True)}\"></iframe>")


def in_notebook() -> bool:
    """Whether the code runs in a notebook kernel (IPython's ZMQ shell: Jupyter, VS Code, Colab), not in a
    terminal IPython or plain Python."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:  # an IPython too old or broken to ask: treat as no notebook
        return False
    return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell") and hasattr(shell, "kernel")


class NotebookView:
    """Mixin: ``_repr_html_`` and ``show()`` from the class's ``_notebook_html()`` and ``_plain_text()``."""

    #: The inline frame's height in pixels (a class may set its own).
    _frame_height = 420

    def _notebook_html(self) -> str:
        raise NotImplementedError

    def _plain_text(self) -> str:
        raise NotImplementedError

    def _repr_html_(self) -> str:
        return sandboxed_frame(self._notebook_html(), self._frame_height)

    def show(self, file: Any = None) -> None:
        """In a notebook: display the inline page. Elsewhere: print the plain text (scores as numbers) to
        ``file`` (default stdout)."""
        if in_notebook():
            from IPython.display import HTML, display

            display(HTML(self._repr_html_()))
            return
        print(self._plain_text(), file=file or sys.stdout)

