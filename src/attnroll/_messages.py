"""Formatting of messages, with no dependency: the command line's usage errors and ``--help`` use it without
importing torch (:mod:`attnroll._checks` re-exports it for the rest of the package)."""

from __future__ import annotations

from typing import Any

__all__ = ["one_line"]


def one_line(msg: Any) -> str:
    """``msg`` as text with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(msg).split())
