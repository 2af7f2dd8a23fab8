"""Recognising an :class:`~attnroll.Explanation` without importing :mod:`attnroll.methods`: the Explanation
draws its own pictures through ``viz`` (``overlay``, ``to_html``), so ``viz`` must not import it back (that
would be an import cycle). An Explanation is known by what it has."""

from __future__ import annotations

from typing import Any

_ATTRIBUTES = ("scores", "full_row", "prefix", "as_grid", "normalized")


def is_explanation(x: Any) -> bool:
    """Whether ``x`` is an Explanation (has its scores, full row, prefix, ``as_grid`` and ``normalized``)."""
    return not isinstance(x, type) and all(hasattr(x, a) for a in _ATTRIBUTES)


def image_index(index: Any, batch: int, what: str) -> int:
    """The example that one image shows: ``index`` checked against ``batch`` examples; ``index=None`` is
    example 0 only when there is one example. A batch of maps and one picture name no pairing, so guessing
    example 0 would draw another picture's map over it: that is a ValueError asking for ``index=``."""
    from .. import _checks

    if index is None:
        if batch == 1:
            return 0
        raise ValueError(
            f"{what}: the explanation holds {batch} examples and one image is given: pass index= (0 to "
            f"{batch - 1}), the example the image shows"
        )
    return _checks.check_index("index", index, batch, "examples")
