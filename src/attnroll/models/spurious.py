"""A spurious cue for the shapes data, and the shipped copy of the shapes model that learnt to rely on it.

:func:`add_marker` paints a small coloured square into one corner of each shapes image; its colour names a
class (:data:`MARKER_COLORS`, one per entry of :data:`~attnroll.models.shapes.CLASSES`). With ``agree=1`` the
marker always names the image's own label, so a model can get every answer right by reading the corner and
ignoring the object: a shortcut. :func:`load_marker_model` loads ``shapes_vit_marker/``, a copy of the
embedded shapes ViT fine-tuned (by ``tools/train/finetune_marker.py`` in the source repository) on images
whose label is the marker's class, so that it follows the marker when marker and object disagree. The pair
(original, marker copy) is the test case for checkpoint audits (:func:`attnroll.evaluate.audit.audit`): the
second model's explanations should move their mass onto the marker's patch.

Needs numpy and torch; :func:`load_marker_model` also needs the ``hf`` extra (transformers, safetensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import _checks
from . import shapes

__all__ = [
    "CORNERS",
    "MARKER_COLORS",
    "MARKER_DIR",
    "add_marker",
    "marker_classes",
    "marker_box",
    "load_marker_model",
]

#: RGB colour of the marker for each class index (circle, square, triangle, cross): pure red, green, blue and
#: white. Backgrounds are dark and muted, so each stands out, and any two differ by 1 in at least two
#: channels.
MARKER_COLORS: tuple[tuple[float, float, float], ...] = (
    (1.0, 0.0, 0.0),
    (0.0, 1.0, 0.0),
    (0.0, 0.0, 1.0),
    (1.0, 1.0, 1.0),
)
#: Corner names accepted by :func:`add_marker`.
CORNERS: tuple[str, ...] = ("top_left", "top_right", "bottom_left", "bottom_right")
#: Folder of the shipped marker model (weights, config, model card).
MARKER_DIR = Path(__file__).resolve().with_name("shapes_vit_marker")
# Gap between the marker and the image edge, in pixels.
_MARGIN = 1


def marker_box(corner: str, size: int, height: int, width: int) -> tuple[slice, slice]:
    """Rows and columns (two slices) of a ``size`` x ``size`` marker ``_MARGIN`` (1) pixel in from the edges of
    ``corner`` in a ``height`` x ``width`` image. At the default size 6 in a 64x64 image the marker covers
    pixels 1-6 of the corner patch (8x8 pixels), so exactly one patch of the shapes ViT holds it."""
    top = corner.startswith("top")
    left = corner.endswith("left")
    r0 = _MARGIN if top else height - _MARGIN - size
    c0 = _MARGIN if left else width - _MARGIN - size
    return slice(r0, r0 + size), slice(c0, c0 + size)


def marker_classes(labels: Any, *, agree: float = 1.0, seed: int = 0) -> torch.Tensor:
    """The class each image's marker names (what :func:`add_marker` paints for the same arguments).

    For each label, with probability ``agree`` the label itself, else one of the other classes, uniformly.
    Draws from ``numpy.random.default_rng(seed)``: first B uniforms (agree or not), then B offsets in 1..C-1
    (the other class is ``(label + offset) % C``), so the result for a given (labels, agree, seed) never
    changes. ``agree=1 / C`` (0.25) makes the marker independent of the label.

    Returns an int64 tensor (B,).
    """
    y = _check_labels(labels)
    agree = _checks.check_real("agree", agree, low=0.0, high=1.0)
    seed = _checks.check_int("seed", seed, low=0)
    rng = np.random.default_rng(seed)
    n_cls = len(shapes.CLASSES)
    keep = rng.random(y.shape[0]) < agree
    offset = rng.integers(1, n_cls, y.shape[0])
    out = np.where(keep, y, (y + offset) % n_cls)
    return torch.from_numpy(out.astype(np.int64))


def add_marker(
    images: Any,
    labels: Any,
    *,
    corner: str = "top_left",
    size: int = 6,
    agree: float = 1.0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paint a class-coded marker into a corner of each image.

    Args:
        images: (B, 3, H, W) RGB in [0, 1] as :func:`~attnroll.models.shapes.make_dataset` returns (a float
            tensor or array); not modified.
        labels: (B,) class indices into :data:`~attnroll.models.shapes.CLASSES`.
        corner: one of :data:`CORNERS`.
        size: side of the filled square in pixels; it sits 1 pixel in from both edges of the corner, so
            ``1 <= size <= min(H, W) - 2``.
        agree: probability that an image's marker names its own label; otherwise it names another class,
            uniformly (see :func:`marker_classes`).
        seed: seed of those draws (deterministic; no global random state).

    Returns:
        ``marked``: a new float32 tensor (B, 3, H, W), the images with the marker painted in the flat colour
        ``MARKER_COLORS[class]`` over whatever was there (object, distractor or background);
        ``masks``: bool (B, H, W), True exactly on the marker's pixels (the same square in every image).
        The marker's classes are ``marker_classes(labels, agree=agree, seed=seed)``.
    """
    x = _check_images(images)
    cls = marker_classes(labels, agree=agree, seed=seed)
    if cls.shape[0] != x.shape[0]:
        raise ValueError(f"labels has {cls.shape[0]} entries but images holds B={x.shape[0]} images")
    corner = _checks.check_choice("corner", corner, CORNERS)
    B, _, H, W = x.shape
    size = _checks.check_int("size", size, low=1, high=min(H, W) - 2 * _MARGIN)
    rows, cols = marker_box(corner, size, H, W)
    marked = x.to(torch.float32, copy=True)
    colors = torch.tensor(MARKER_COLORS, dtype=torch.float32)[cls]  # (B, 3)
    marked[:, :, rows, cols] = colors[:, :, None, None]
    masks = torch.zeros((B, H, W), dtype=torch.bool)
    masks[:, rows, cols] = True
    return marked, masks


def load_marker_model(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Any:
    """Load the shipped marker copy of the shapes ViT (or one written by
    ``tools/train/finetune_marker.py --out path``), in
    eval mode, offline (``safetensors`` only). Same architecture, input and output as
    :func:`~attnroll.models.shapes.load_shapes_model`.

    Raises:
        FileNotFoundError: ``config.json`` or ``model.safetensors`` is missing (the message says how to
            rebuild them).
    """
    folder = Path(path) if path is not None else MARKER_DIR
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"load_marker_model: {folder / name} not found; rebuild it with "
                "`python tools/train/finetune_marker.py` (in the source repository)"
            )
    return shapes.load_shapes_model(folder, dtype=dtype)


# ------------------------------------------------------------------------------------------- validation
def _check_images(images: Any) -> torch.Tensor:
    x, _ = _checks.as_tensor("images", images)
    if x.ndim != 4 or x.shape[1] != 3 or not x.is_floating_point():
        raise ValueError(
            f"images must be float RGB (B, 3, H, W) in [0, 1] as make_dataset returns, got {_checks.describe(x)}"
        )
    return x.detach().cpu()


def _check_labels(labels: Any) -> np.ndarray:
    y = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
    n_cls = len(shapes.CLASSES)
    if y.ndim != 1 or (y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= n_cls)):
        raise ValueError(
            f"labels must be (B,) class indices in [0, {n_cls - 1}], got {_checks.describe(labels)}"
        )
    return y.astype(np.int64)
