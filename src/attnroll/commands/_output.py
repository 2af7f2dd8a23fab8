"""What every command shares for its output: the one-line failure, the output folder, atomic file writes
and a progress bar. A failure raised anywhere under a command becomes ``error: <one line>`` on stderr with
exit code 1 (see :mod:`._group`); click's usage errors exit 2."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import click

from .._io import held_signals
from .._messages import one_line

__all__ = ["Failure", "one_line", "prepare_out", "output_file", "write", "save_npz", "figure_png", "png_bytes",
           "progress", "echo_written"]


class Failure(click.ClickException):
    """A failure (exit 1) reported as one line."""

    exit_code = 1


def prepare_out(out: Path) -> Path:
    """Create the output folder and check that it can be written (a probe file is created and removed)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise Failure(f"output folder {out} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with held_signals():  # an interrupt cannot leave the probe behind
            fd, probe = tempfile.mkstemp(prefix=".attnroll-probe-", dir=out)
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise Failure(f"cannot write to output folder {out}: {e.strerror or e}") from None
    return out


def output_file(out: Path, name: str) -> Path:
    """``out / name`` for a file about to be written, checked to stay in ``out`` (``name`` one plain
    component: make names from data with :func:`attnroll._names.safe_name`); a one-line failure otherwise."""
    from .._names import UnsafePathError, inside

    try:
        return inside(out, name)
    except UnsafePathError as e:
        raise Failure(one_line(e)) from None


def write(path: Path, content: Any) -> Path:
    """Write bytes / str, or a PIL image (format by suffix), atomically; a failure is one line."""
    from ..viz import atomic_write, save_image

    try:
        if hasattr(content, "save") and hasattr(content, "size"):
            save_image(content, path)
        else:
            atomic_write(path, content)
    except OSError as e:
        raise Failure(f"cannot write {path}: {e.strerror or e}") from None
    return path


def save_npz(expl: Any, path: Path) -> Path:
    """``Explanation.save`` (atomic) with a one-line failure."""
    try:
        expl.save(path)
    except OSError as e:
        raise Failure(f"cannot write {path}: {e.strerror or e}") from None
    return path


def png_bytes(img: Any, text: dict[str, str] | None = None) -> bytes:
    """A PIL image as PNG file content; ``text``: tEXt entries (e.g. which model made the map)."""
    info = None
    if text:
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        for k, v in text.items():
            info.add_text(k, v)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True, pnginfo=info)
    return buf.getvalue()


def figure_png(fig: Any, plt: Any, dpi: int = 110) -> bytes:
    """A matplotlib figure as PNG file content; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def progress(total: int) -> Any:
    """A rich progress bar on stderr over ``total`` items (a null context for one item or without rich)."""
    if total <= 1:
        return contextlib.nullcontext(None)
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return contextlib.nullcontext(None)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def echo_written(paths: list[Path]) -> None:
    """One ``wrote PATH`` line per file written."""
    for p in paths:
        click.echo(f"wrote {p}")
