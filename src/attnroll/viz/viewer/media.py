"""Pictures and ground-truth masks packed into the page: a PNG data URI and a bit-packed mask."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch


def image_uri(image: Any) -> tuple[str, int, int]:
    """An image (PIL, (H, W, 3) / (3, H, W) array or tensor, uint8 or float in [0, 1]) -> (PNG data URI,
    width, height). Needs pillow."""
    from .. import deps
    from ..pixels import to_rgb_array

    Image = deps.pil("attnroll.viz.view (images)")
    arr = to_rgb_array(image)
    buf = io.BytesIO()
    Image.fromarray(arr, mode="RGB").save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"), arr.shape[1], arr.shape[0]


def mask_bits(mask: Any) -> dict[str, Any]:
    """A (H, W) boolean mask -> {"w", "h", "data": base64 of the row-major bits, most significant first}."""
    m = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if m.ndim != 2:
        raise ValueError(f"masks must be (B, H, W) boolean masks, got one of shape {m.shape}")
    bits = np.packbits(m.astype(bool).reshape(-1))
    return {"w": int(m.shape[1]), "h": int(m.shape[0]), "data": base64.b64encode(bits.tobytes()).decode("ascii")}


def as_list(images: Any) -> list | None:
    """Images or masks as a per-example list: a batched array / tensor (B, ...) or a list; None stays None."""
    if images is None:
        return None
    if isinstance(images, (torch.Tensor, np.ndarray)):
        return [images[i] for i in range(images.shape[0])]
    return list(images)
