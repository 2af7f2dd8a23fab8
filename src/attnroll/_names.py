"""File names made from data (an input's id, an image's stem, a page name) and the check that a file written
under an output folder stays in it. A leaf module.

:func:`safe_name` maps any string to one file name component that is the same on every run, readable (safe
characters kept) and never the name of another string, also on a case-insensitive file system (macOS,
Windows) or under Windows' rules (reserved device names, trailing dots and spaces). :func:`inside` is the
last check before a write: the name must be one component of the folder.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

__all__ = ["safe_name", "inside", "UnsafePathError", "MAX_NAME_BYTES"]

#: The longest name :func:`safe_name` returns, in bytes (file systems allow 255; a suffix such as
#: ``.<method>.png`` is added to it).
MAX_NAME_BYTES = 200
#: Characters kept as they are: ASCII lower-case letters, digits and ``. _ - + = , @``. Everything else
#: (upper case included, so that names differing only in case stay apart on case-insensitive disks) makes
#: the name take a hash.
_KEEP = re.compile(r"[a-z0-9._\-+=,@]")
_UNSAFE = re.compile(r"[^a-z0-9._\-+=,@A-Z]")
#: Names Windows reserves for devices, whatever the extension (``con.png`` too).
_RESERVED = {"con", "prn", "aux", "nul", "conin$", "conout$", *(f"com{i}" for i in range(10)),
             *(f"lpt{i}" for i in range(10))}
#: Separates the readable part from the hash; never kept from the original, so a name without it is the
#: original string itself.
_MARK = "~"
_HASH_HEX = 12


def _digest(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_HEX]


def _kept_as_is(s: str) -> bool:
    """Whether ``s`` is already a safe name: non-empty, short, only kept characters, no leading or trailing
    dot, not a reserved device name."""
    return (0 < len(s) <= MAX_NAME_BYTES and all(_KEEP.fullmatch(c) for c in s) and not s.startswith(".")
            and not s.endswith(".") and s.split(".")[0] not in _RESERVED)


def safe_name(s: str) -> str:
    """One file name component for the string ``s`` (any string: ``..``, absolute paths, NUL, newlines,
    control characters, ``CON``, very long or empty ones).

    A string made only of lower-case ASCII letters, digits and ``. _ - + = , @`` (not starting or ending
    with a dot, not a Windows device name, at most :data:`MAX_NAME_BYTES` long) is its own name. Any other
    becomes its readable part (unsafe characters as ``_``, upper case kept, cut to length) followed by ``~``
    and 12 hex digits of the SHA-256 of ``s``: stable across runs, and two different strings never share a
    name, also when compared without case (up to a hash collision, about 2**-48 per pair)."""
    if not isinstance(s, str):
        raise TypeError(f"safe_name takes a str, got {type(s).__name__}")
    if _kept_as_is(s):
        return s
    readable = _UNSAFE.sub("_", s)
    if not readable or readable.startswith(".") or readable.split(".")[0].lower() in _RESERVED:
        readable = "_" + readable  # not hidden, not a device name
    return f"{readable[: MAX_NAME_BYTES - len(_MARK) - _HASH_HEX]}{_MARK}{_digest(s)}"


class UnsafePathError(ValueError):
    """A file about to be written would not be a file of its output folder."""


def inside(folder: str | os.PathLike, name: str) -> Path:
    """``folder / name``, after checking that ``name`` is one component (no separator, not ``.`` / ``..``,
    no NUL) and that the path, symbolic links resolved, is in ``folder``; else :class:`UnsafePathError`,
    and nothing is written."""
    seps = {os.sep, "/", "\\"} | ({os.altsep} if os.altsep else set())
    if not name or name in (".", "..") or "\0" in name or any(c in name for c in seps):
        raise UnsafePathError(f"refusing to write {name!r} into {os.fspath(folder)}: a file name there must "
                              "be one plain component (no folder, '..' or NUL)")
    base = Path(folder).resolve()
    path = Path(folder) / name
    real = path.resolve()
    if real.parent != base and base not in real.parents:
        raise UnsafePathError(f"refusing to write {path}: it resolves to {real}, outside the output folder {base}")
    return path
