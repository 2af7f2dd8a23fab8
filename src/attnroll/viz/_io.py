"""Saving pictures atomically (the write itself lives in ``attnroll._io``)."""

from __future__ import annotations

import os
from typing import Any

from .._io import atomic_write

__all__ = ["atomic_write", "save_image"]


def save_image(image: Any, path: str | os.PathLike) -> str:
    """Save a PIL image atomically; the format follows the extension (".png", ".jpg", ...)."""
    ext = os.path.splitext(os.fspath(path))[1].lower().lstrip(".") or "png"
    fmt = {"jpg": "JPEG", "jpeg": "JPEG", "tif": "TIFF"}.get(ext, ext.upper())
    return atomic_write(
        path, lambda f: image.save(f, format=fmt, optimize=True) if fmt == "PNG" else image.save(f, format=fmt)
    )
