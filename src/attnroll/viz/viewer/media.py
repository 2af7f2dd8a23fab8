"""Pictures and ground-truth masks packed into the page: a PNG data URI and a bit-packed mask."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch

#: Pictures are shrunk to at most this many pixels on their longer side (the page shows them at 320).
MAX_SIDE = 640


def image_uri(image: Any) -> tuple[str, int, int]:
    """An image (PIL, (H, W, 3) / (3, H, W) array or tensor, uint8 or float in [0, 1]) -> (PNG data URI,
    width, height), shrunk to :data:`MAX_SIDE` on its longer side when larger. Needs pillow."""
    from .. import deps
    from ..pixels import to_rgb_array

    Image = deps.pil("attnroll.viz.view (images)")
    arr = to_rgb_array(image)
    im = Image.fromarray(arr, mode="RGB")
    if max(im.size) > MAX_SIDE:
        k = MAX_SIDE / max(im.size)
        im = im.resize((max(1, round(im.width * k)), max(1, round(im.height * k))), Image.LANCZOS)
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"), im.width, im.height


def mask_bits(mask: Any) -> dict[str, Any]:
    """A (H, W) boolean mask -> {"w", "h", "data": base64 of the row-major bits, most significant first}."""
    m = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if m.ndim != 2:
        raise ValueError(f"masks must be (B, H, W) boolean masks, got one of shape {m.shape}")
    bits = np.packbits(m.astype(bool).reshape(-1))
    return {"w": int(m.shape[1]), "h": int(m.shape[0]), "data": base64.b64encode(bits.tobytes()).decode("ascii")}


def as_list(images: Any, single_ndim: int) -> list | None:
    """Images or masks as a per-example list: a batched array / tensor (B, ...), a list, or one item (an
    array with ``single_ndim`` dimensions: 3 for a picture, 2 for a mask; or a PIL image); None stays None."""
    if images is None:
        return None
    if isinstance(images, (torch.Tensor, np.ndarray)):
        if images.ndim == single_ndim:
            return [images]
        return [images[i] for i in range(images.shape[0])]
    if hasattr(images, "getpixel"):  # one PIL image
        return [images]
    return list(images)
