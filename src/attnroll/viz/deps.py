"""Lazy imports of the picture libraries (the ``viz`` extra), with one clear error when they are missing:
``pil()``, ``pyplot()`` (Agg backend), ``colormap(name)``, ``rich()``, ``figure_to_image(fig)``."""

from __future__ import annotations

from typing import Any

_HINT = "pip install 'attnroll[viz]' (matplotlib, pillow, rich)"


def _need(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{what} needs the 'viz' extra ({module} is not installed): {_HINT}") from None


def pil(what: str = "attnroll.viz") -> Any:
    """The ``PIL.Image`` module."""
    _need("PIL", what)
    from PIL import Image

    return Image


def pyplot(what: str = "attnroll.viz") -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    mpl = _need("matplotlib", what)
    mpl.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def colormap(name: str, what: str = "attnroll.viz") -> Any:
    """A matplotlib colormap by name (e.g. "jet", "inferno", "viridis")."""
    mpl = _need("matplotlib", what)
    try:
        return mpl.colormaps[name]
    except KeyError:
        raise ValueError(f"cmap must be a matplotlib colormap name, got {name!r} (e.g. 'jet', 'inferno')") from None


def rich(what: str = "attnroll.viz") -> Any:
    return _need("rich", what)


def figure_to_image(fig: Any) -> Any:
    """Render a matplotlib figure (Agg) to a PIL RGB image of size figsize·dpi pixels, and close it."""
    Image = pil()
    plt = pyplot()
    import numpy as np

    try:
        fig.canvas.draw()
        buf = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    finally:
        plt.close(fig)
    return Image.fromarray(buf, mode="RGB")
