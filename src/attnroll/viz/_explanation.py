"""Recognising an :class:`~attnroll.Explanation` without importing :mod:`attnroll.methods`: the Explanation
draws its own pictures through ``viz`` (``overlay``, ``to_html``), so ``viz`` must not import it back (that
would be an import cycle). An Explanation is known by what it has."""

from __future__ import annotations

from typing import Any

_ATTRIBUTES = ("scores", "full_row", "prefix", "as_grid", "normalized")


def is_explanation(x: Any) -> bool:
    """Whether ``x`` is an Explanation (has its scores, full row, prefix, ``as_grid`` and ``normalized``)."""
    return not isinstance(x, type) and all(hasattr(x, a) for a in _ATTRIBUTES)
