"""Pictures as plain (H, W, 3) uint8 arrays, from whatever the caller holds (a leaf module: pillow only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._checks import one_line
from . import deps


def to_rgb_array(image: Any) -> np.ndarray:
    """An image as an (H, W, 3) uint8 array.

    Accepts a PIL image; a numpy array or torch tensor (H, W, 3) or (3, H, W) (channels-first, as
    ``make_dataset`` returns), uint8 in [0, 255] or float in [0, 1]; (H, W) grey images are repeated to RGB.
    """
    Image = deps.pil()
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=-1)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"image must be a PIL image or an (H, W, 3) / (3, H, W) array, got shape {arr.shape}")
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    arr = arr[..., :3]
    if arr.dtype != np.uint8:
        arr = arr.astype(np.float64)
        if arr.size and arr.max() <= 1.0:
            arr = arr * 255.0
        arr = np.clip(np.round(arr), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(arr)


def read_image(path: Any, who: str = "attnroll") -> Any:
    """Decode the image file ``path`` fully and return it as a PIL RGB image.

    A missing file raises FileNotFoundError; an unreadable, truncated or corrupt file (or a decompression bomb)
    raises ValueError ``"cannot read image PATH: why"``. ``who`` names the caller in the install hint for Pillow.
    """
    Image = deps.pil(who)
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except FileNotFoundError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # UnidentifiedImageError, truncated files
        why = "not an image or corrupt" if "identify" in str(e) else one_line(e)[:500]
        raise ValueError(f"cannot read image {path}: {why or type(e).__name__}") from None
