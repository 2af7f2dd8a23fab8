"""The viewer page: one HTML file holding its data, script and styles (nothing fetched, ever)."""

from __future__ import annotations

import html
import json
import os
from importlib import resources
from typing import Any

from ..._io import atomic_write

#: The page may load nothing: its script and styles are inline, its pictures data: URIs.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def render(payload: dict[str, Any]) -> str:
    """The complete page for ``payload`` (see :mod:`.payload`)."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    data = data.replace("<", "\\u003c")  # no "</script>" can end the data block early
    title = html.escape(str(payload.get("title", "attnroll viewer")))
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{title}</title><style>{_asset('viewer.css')}</style></head><body>"
        "<div id='attnroll-app' class='ar'><noscript>This viewer needs JavaScript.</noscript></div>"
        f"<script type='application/json' id='attnroll-data'>{data}</script>"
        f"<script>{_asset('viewer.js')}</script></body></html>\n"
    )


def read_payload(page: str) -> dict[str, Any]:
    """The data a viewer page carries (the inverse of :func:`render`'s embedding), e.g. to check a page or
    to take its rows back out (:func:`~attnroll.viz.viewer.quant.decode_rows`)."""
    start_tag = "<script type='application/json' id='attnroll-data'>"
    i = page.find(start_tag)
    if i < 0:
        raise ValueError("page is not an attnroll viewer page (no attnroll-data block)")
    j = page.index("</script>", i)
    return json.loads(page[i + len(start_tag):j])


class ViewerPage:
    """An interactive viewer page. ``html``: the page (str); ``save(path)`` writes it; in a notebook the
    object displays itself (``_repr_html_``: the page in a sandboxed ``iframe srcdoc``, so that several
    viewers and the notebook's own styles do not interfere)."""

    def __init__(self, page: str, height: int = 720):
        self.html = page
        self.height = int(height)

    @property
    def nbytes(self) -> int:
        """Size of the page in bytes (UTF-8)."""
        return len(self.html.encode("utf-8"))

    def save(self, path: str | os.PathLike) -> str:
        """Write the page atomically (a temporary file, then a rename); ".html" is added when missing."""
        path = os.fspath(path)
        if not path.lower().endswith((".html", ".htm")):
            path += ".html"
        return atomic_write(path, self.html.encode("utf-8"))

    def _repr_html_(self) -> str:
        return (f"<iframe sandbox='allow-scripts' style='width:100%;height:{self.height}px;border:1px solid #ddd;"
                f"resize:vertical' srcdoc=\"{html.escape(self.html, quote=True)}\"></iframe>")

    def show(self) -> None:
        """Display in a notebook (IPython); outside one, say where to look instead."""
        try:
            from IPython.display import display
        except ImportError:
            raise RuntimeError(
                "show() needs IPython (a notebook); use .save('viewer.html') and open the file"
            ) from None
        display(self)

    def __repr__(self) -> str:
        return f"ViewerPage({self.nbytes:,} bytes)"
