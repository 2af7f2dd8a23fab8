"""Atomic file writes: a temporary file in the destination folder, then a rename, so that a failure (or an
interrupt) never leaves a half-written file under the final name. A leaf module: used by ``Explanation.save``,
``viz`` and the command line alike."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None] | bytes | str, *, mode: str = "wb") -> str:
    """Write ``path`` atomically.

    ``write`` is the content (bytes or str) or a function ``write(fileobj)`` filling an open binary file.
    The data go to ``.<name>.<random>.tmp`` in the same folder, which is renamed over ``path`` only when
    everything was written; on any error the temporary file is removed and the error re-raised. Returns
    the path written.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(write):
                write(f)
            elif isinstance(write, str):
                f.write(write.encode("utf-8"))
            else:
                f.write(write)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
