"""The old name of :mod:`attnroll.viz.deps` (kept so that code written against it keeps working)."""

from .deps import colormap, figure_to_image, pil, pyplot, rich  # noqa: F401
