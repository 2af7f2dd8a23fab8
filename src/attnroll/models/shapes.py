"""The embedded image model: a small ViT that classifies procedurally generated shapes, and its data.

Data (:func:`make_dataset`): RGB images of one *class object* (a circle, square, triangle or cross) at a random
position and scale, turned by up to 15 degrees, drawn over 1-6 smaller *distractors* (elliptic blobs and line
segments in other colours) on a dark textured background (smooth value noise, stripes or a linear gradient, plus
pixel noise). Every
image comes with the ground-truth mask of its class object, so saliency maps can be scored against it.

Model (:func:`load_shapes_model`): a transformers ``ViTForImageClassification`` (CLS token, 64x64 input,
8x8-pixel patches, so an 8x8 grid and 65 tokens) whose weights ship in ``shapes_vit/`` next to this file
(``model.safetensors`` + ``config.json`` + ``MODEL_CARD.md``), trained by
``tools/train/train_shapes.py`` (in the source repository).
Loading is offline: no model hub, no remote code.

Everything here except :func:`build_model` / :func:`load_shapes_model` needs only numpy and torch;
those two need the ``hf`` extra (transformers, safetensors).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .._io import reading

__all__ = [
    "CLASSES",
    "IMAGE_SIZE",
    "PATCH_SIZE",
    "WEIGHTS_DIR",
    "make_dataset",
    "patch_masks",
    "preprocess",
    "shapes_config",
    "build_model",
    "load_shapes_model",
]

#: Class names, index = label.
CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
#: Side of the images the shipped model takes, in pixels.
IMAGE_SIZE = 64
#: Side of one ViT patch, in pixels (64 / 8 = an 8x8 grid of patches).
PATCH_SIZE = 8
#: Folder of the shipped weights, config and model card.
WEIGHTS_DIR = Path(__file__).resolve().with_name("shapes_vit")

# Images are generated in blocks of this many, each block from its own random stream (SeedSequence spawn
# key = block index). Every parameter is drawn for a whole block, so ``make_dataset(k, seed)`` is exactly
# the first k images of ``make_dataset(n, seed)`` for any k <= n. Changing it changes every dataset.
_BLOCK = 256
_MAX_DISTRACTORS = 6
_BG_VALUE = (0.05, 0.45)  # HSV value of the two background colours
_SCALE = (0.18, 0.32)  # object outer radius, as a fraction of the image side
_ANGLE_JITTER = float(np.deg2rad(15))  # object rotation: uniform in +-this (radians) around the upright pose
# Normalisation of preprocess(): [0, 1] -> [-1, 1].
_MEAN = 0.5
_STD = 0.5


# ----------------------------------------------------------------------------------------------- dataset
def make_dataset(
    n: int, seed: int, *, image_size: int = IMAGE_SIZE, return_params: bool = False
) -> tuple[torch.Tensor, ...]:
    """Generate ``n`` labelled shape images with the ground-truth mask of each image's class object.

    Args:
        n: number of images (>= 0).
        seed: any non-negative int; the same (n, seed, image_size) always gives identical tensors (numpy
            ``Generator`` / PCG64, no global state). Prefix-stable: ``make_dataset(k, seed)`` equals the first
            ``k`` images of ``make_dataset(n, seed)`` for ``k <= n``.
        image_size: side S of the square images in pixels (>= 16). Shapes, distractors and textures scale
            with it; the shipped model expects 64.
        return_params: also return a dict of the drawn parameters (numpy arrays, pixel units, see below).

    Returns:
        ``images``: float32 tensor (n, 3, S, S), RGB in [0, 1] (not normalised; see :func:`preprocess`).
        ``labels``: int64 tensor (n,), indices into :data:`CLASSES`; each block of 256 images holds exactly
        64 of each class, in random order.
        ``masks``: bool tensor (n, S, S), True on the pixels of the class object (pixels whose centre lies
        inside the shape; the object is drawn last, with a one-pixel antialiased edge, so it is never
        occluded and the mask is exactly what is visible of it).
        With ``return_params``: a dict with ``center`` (n, 2) as (x, y) pixels (pixel centres at j + 0.5),
        ``scale`` (n,) the object's outer radius in pixels, ``angle`` (n,) radians, ``color`` (n, 3) the
        object's flat RGB colour, ``background`` (n,) 0 noise / 1 stripes / 2 gradient, ``n_distractors``
        (n,).

    Objects: outer radius r in [0.18 S, 0.32 S] (11.5-20.5 px at S = 64), fully inside the image (at least one
    pixel of margin), upright (triangle apex up) and turned by up to +-15 degrees, in saturated bright colours
    (HSV saturation 0.65-1, value 0.7-1); outer-radius-to-area: circle of radius 0.8 r, square of half side
    0.72 r, equilateral triangle of circumradius r, cross of two 1.9 r x 0.6 r bars. Distractors (1-6 per image):
    ellipses with semi-axes 0.025-0.07 S or line segments 0.1-0.25 S long and 1-2 px wide, hues at least 72
    degrees away from the object's (saturation 0.4-1, value 0.45-1), anywhere, under the object. Backgrounds:
    two dark muted colours (saturation <= 0.4, value 0.05-0.45) mixed by a texture (smooth value noise, stripes
    of 2-8 cycles per image, or a linear gradient), plus uniform pixel noise of standard deviation 0-0.05.

    Speed: about 0.3 ms of one CPU core per 64x64 image (20k images in about 6 s).
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"make_dataset: n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"make_dataset: seed must be a non-negative int, got {seed!r}")
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < 16:
        raise ValueError(f"make_dataset: image_size must be an int >= 16, got {image_size!r}")
    n, s = int(n), int(image_size)
    images = np.empty((n, 3, s, s), np.float32)
    labels = np.empty((n,), np.int64)
    masks = np.empty((n, s, s), bool)
    params: dict[str, list[np.ndarray]] = {}
    for b, start in enumerate(range(0, n, _BLOCK)):
        m = min(_BLOCK, n - start)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=(b,))))
        img, lab, msk, par = _render_block(rng, s, m)
        images[start : start + m], labels[start : start + m], masks[start : start + m] = img, lab, msk
        for k, v in par.items():
            params.setdefault(k, []).append(v)
    out = (torch.from_numpy(images), torch.from_numpy(labels), torch.from_numpy(masks))
    if return_params:
        keys = ("center", "scale", "angle", "color", "background", "n_distractors")
        cat = {k: np.concatenate(params[k]) if params else np.zeros((0,)) for k in keys}
        return out + (cat,)
    return out


def _hsv_to_rgb(h: np.ndarray, s: np.ndarray, v: np.ndarray) -> np.ndarray:
    """HSV in [0, 1] (any equal shapes) -> RGB (..., 3) in [0, 1]."""
    h6 = (h % 1.0) * 6.0
    k = np.stack([(5.0 + h6) % 6.0, (3.0 + h6) % 6.0, (1.0 + h6) % 6.0], axis=-1)
    return (v[..., None] - v[..., None] * s[..., None] * np.clip(np.minimum(k, 4.0 - k), 0.0, 1.0)).astype(
        np.float32
    )


def _rotate(x: np.ndarray, y: np.ndarray, cx, cy, angle) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates relative to (cx, cy), rotated by -angle (per image, broadcast as (m, 1, 1))."""
    dx, dy = x - cx, y - cy
    c, s = np.cos(angle), np.sin(angle)
    return c * dx + s * dy, -s * dx + c * dy


def _shape_distance(label: np.ndarray, u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Signed distance in pixels (negative inside) to the class object, in the object's rotated frame.

    ``u, v`` (m, S, S); ``r`` (m, 1, 1) outer radius. Exact inside and along edges; outside corners it is the
    Chebyshev-style bound, which only affects the one-pixel antialiasing there.
    """
    d = np.empty(u.shape, np.float32)
    for cls in range(len(CLASSES)):
        i = np.nonzero(label == cls)[0]
        if i.size == 0:
            continue
        uu, vv, rr = u[i], v[i], r[i]
        if cls == 0:  # circle, radius 0.8 r (area 2.01 r^2)
            d[i] = np.sqrt(uu * uu + vv * vv) - 0.8 * rr
        elif cls == 1:  # square, half side 0.72 r (area 2.07 r^2, corners at 1.02 r)
            d[i] = np.maximum(np.abs(uu), np.abs(vv)) - 0.72 * rr
        elif cls == 2:  # equilateral triangle, circumradius r (area 1.30 r^2): three half-planes
            e = [np.cos(k * 2 * np.pi / 3) * uu + np.sin(k * 2 * np.pi / 3) * vv for k in range(3)]
            d[i] = np.maximum(np.maximum(e[0], e[1]), e[2]) - 0.5 * rr
        else:  # cross: two bars, half length 0.95 r, half thickness 0.3 r (area 1.92 r^2)
            au, av = np.abs(uu), np.abs(vv)
            a, t = 0.95 * rr, 0.3 * rr
            d[i] = np.minimum(np.maximum(au - a, av - t), np.maximum(au - t, av - a))
    return d


def _value_noise(lattice: np.ndarray, s: int) -> np.ndarray:
    """Smooth noise (m, s, s) in [0, 1] from a random lattice (m, cells+1, cells+1), interpolated with
    smoothstep weights and stretched to the full [0, 1] range per image.

    The interpolation is separable, so it is two small matrix products: ``W @ lattice @ W.T`` with ``W``
    (s, cells+1) holding each pixel's weights on its two neighbouring lattice points.
    """
    cells = lattice.shape[-1] - 1
    t = (np.arange(s, dtype=np.float64) + 0.5) * (cells / s)
    i0 = np.minimum(t.astype(np.int64), cells - 1)
    f = t - i0
    f = f * f * (3 - 2 * f)  # smoothstep: no visible lattice creases
    w = np.zeros((s, cells + 1), np.float32)
    w[np.arange(s), i0] = 1 - f
    w[np.arange(s), i0 + 1] = f
    out = w @ lattice @ w.T
    lo, hi = out.min(axis=(1, 2), keepdims=True), out.max(axis=(1, 2), keepdims=True)
    return (out - lo) / np.maximum(hi - lo, 1e-6)


class _Window:
    """Square windows of side 2 * reach + 1 <= S pixels around one point per image, shifted to lie inside it.

    ``canvas`` (m, c, S, S); ``idx`` (u,) distinct images; ``px, py`` (u,) the points in pixels. A window
    centred on the point is shifted just enough to fit in the image; it still holds every pixel of the image
    within ``reach`` of the point. ``xs, ys`` (u, 1, W) and (u, W, 1) are the coordinates of the window's
    pixel centres. Windows are read and written as whole blocks through a strided view, one window per
    image per call, so writes never overlap.
    """

    def __init__(self, canvas: np.ndarray, idx: np.ndarray, px: np.ndarray, py: np.ndarray, reach: int):
        m, c, h, wd = canvas.shape
        w = 2 * reach + 1
        if w > min(h, wd):
            raise AssertionError(f"window {w} larger than the image {h}x{wd}")
        off = np.arange(w)
        x0 = np.clip(np.floor(px).astype(np.int64) - reach, 0, wd - w)
        y0 = np.clip(np.floor(py).astype(np.int64) - reach, 0, h - w)
        self.xs = (x0[:, None] + off[None, :] + 0.5).astype(np.float32)[:, None, :]
        self.ys = (y0[:, None] + off[None, :] + 0.5).astype(np.float32)[:, :, None]
        self.key = (idx, y0, x0)
        st = canvas.strides
        # (m, H-w+1, W-w+1, c, w, w): the window at (y, x) of image i, every channel
        self.view = np.lib.stride_tricks.as_strided(
            canvas, (m, h - w + 1, wd - w + 1, c, w, w), (st[0], st[2], st[3], st[1], st[2], st[3]), writeable=True
        )

    def paint(self, alpha: np.ndarray, color: np.ndarray) -> None:
        """Paint ``color`` (u, c) with coverage ``alpha`` (u, W, W) over the windows, in place."""
        patch = self.view[self.key]
        patch += alpha[:, None] * (color[:, :, None, None].astype(np.float32) - patch)
        self.view[self.key] = patch


def _draw_block(rng: np.random.Generator, s: int, m: int) -> SimpleNamespace:
    """Every parameter of one block of ``_BLOCK`` images, drawn in a fixed order (changing the order changes
    every dataset), plus the pixel noise of the first ``m`` (drawn last, so the first k images' noise does not
    depend on m: numpy fills arrays in order)."""
    B, K = _BLOCK, _MAX_DISTRACTORS
    f32 = np.float32
    P = SimpleNamespace()
    P.labels = rng.permutation(np.arange(B) % len(CLASSES))
    P.scale = rng.uniform(_SCALE[0], _SCALE[1], B) * s
    margin = 1.05 * P.scale + 1.0
    P.cx = margin + rng.random(B) * (s - 2 * margin)
    P.cy = margin + rng.random(B) * (s - 2 * margin)
    P.angle = rng.uniform(-1.0, 1.0, B) * _ANGLE_JITTER + np.where(P.labels == 2, np.pi / 2, 0.0)  # triangle: apex up
    P.obj_h, P.obj_s, P.obj_v = rng.random(B), rng.uniform(0.65, 1.0, B), rng.uniform(0.7, 1.0, B)
    P.bg_kind = rng.integers(0, 3, B)
    P.bg_h = rng.random((B, 2))
    P.bg_s, P.bg_v = rng.uniform(0.0, 0.4, (B, 2)), rng.uniform(_BG_VALUE[0], _BG_VALUE[1], (B, 2))
    P.noise_std = rng.uniform(0.0, 0.05, B)
    P.stripe_freq = rng.uniform(2.0, 8.0, B)  # cycles per image
    P.stripe_angle, P.stripe_phase = rng.uniform(0, np.pi, B), rng.uniform(0, 2 * np.pi, B)
    P.stripe_sharp = rng.uniform(1.0, 6.0, B)
    P.grad_angle = rng.uniform(0, 2 * np.pi, B)
    P.n_dis = rng.integers(1, K + 1, B)
    P.dis_line = rng.random((B, K)) < 0.5
    P.dis_x, P.dis_y = rng.random((B, K)) * s, rng.random((B, K)) * s
    P.dis_angle = rng.uniform(0, np.pi, (B, K))
    P.dis_a = rng.uniform(0.025, 0.07, (B, K)) * s  # ellipse semi-axes
    P.dis_b = rng.uniform(0.025, 0.07, (B, K)) * s
    P.dis_len = rng.uniform(0.10, 0.25, (B, K)) * s  # line length and width
    P.dis_w = rng.uniform(1.0, 2.0, (B, K))
    P.dis_h = P.obj_h[:, None] + rng.uniform(0.2, 0.8, (B, K))
    P.dis_s, P.dis_v = rng.uniform(0.4, 1.0, (B, K)), rng.uniform(0.45, 1.0, (B, K))
    P.lattice = rng.random((B, 7, 7), dtype=f32)  # value-noise lattice, 6x6 cells
    P.pix_noise = rng.random((m, 3, s, s), dtype=f32)
    return P


def _col(a: np.ndarray, m: int) -> np.ndarray:
    """The first m entries of a per-image parameter as float32 (m, 1, 1)."""
    return a[:m].astype(np.float32)[:, None, None]


def _paint_background(P: SimpleNamespace, s: int, m: int) -> np.ndarray:
    """(m, 3, s, s) backgrounds: t in [0, 1] (value noise, stripes or a gradient) mixes two muted colours,
    plus uniform pixel noise. Reuses ``P.pix_noise`` as the canvas."""
    f32 = np.float32
    sl = slice(0, m)
    xs = (np.arange(s, dtype=f32) + 0.5)[None, None, :]
    ys = (np.arange(s, dtype=f32) + 0.5)[None, :, None]
    kind = P.bg_kind[sl]
    t = np.empty((m, s, s), f32)
    i = np.nonzero(kind == 0)[0]
    if i.size:
        t[i] = _value_noise(P.lattice[sl][i], s)
    i = np.nonzero(kind == 1)[0]
    if i.size:
        a, ph = _col(P.stripe_angle, m)[i], _col(P.stripe_phase, m)[i]
        w = np.sin(2 * np.pi * _col(P.stripe_freq, m)[i] / s * (xs * np.cos(a) + ys * np.sin(a)) + ph)
        t[i] = np.clip(0.5 + 0.5 * w * _col(P.stripe_sharp, m)[i], 0.0, 1.0)
    i = np.nonzero(kind == 2)[0]
    if i.size:
        a = _col(P.grad_angle, m)[i]
        proj = (xs - s / 2) * np.cos(a) + (ys - s / 2) * np.sin(a)
        t[i] = np.clip(0.5 + proj / (s * 1.42), 0.0, 1.0)
    c = _hsv_to_rgb(P.bg_h[sl], P.bg_s[sl], P.bg_v[sl])  # (m, 2, 3)
    # uniform noise in [-sqrt(3) std, sqrt(3) std]: standard deviation noise_std
    amp = (2 * np.sqrt(3.0) * P.noise_std[sl]).astype(f32)[:, None, None, None]
    canvas = P.pix_noise
    canvas -= 0.5
    canvas *= amp
    canvas += c[:, 0, :, None, None]
    canvas += (c[:, 1] - c[:, 0])[:, :, None, None] * t[:, None]
    return canvas


def _paint_distractors(canvas: np.ndarray, P: SimpleNamespace, s: int, m: int) -> None:
    """Ellipses and line segments, slot by slot (slot k is used when k < n_distractors), painted inside
    square windows around their centres (distractors are small: far cheaper than full-image passes)."""
    sl = slice(0, m)
    dis_rgb = _hsv_to_rgb(P.dis_h[sl], P.dis_s[sl], P.dis_v[sl])  # (m, K, 3)
    reach = min(int(math.ceil(0.125 * s + 2)), (s - 1) // 2)  # half a line + width + 1
    for k in range(_MAX_DISTRACTORS):
        use = np.nonzero(P.n_dis[sl] > k)[0]
        if use.size == 0:
            break
        g = lambda a: a[sl, k][use].astype(np.float32)[:, None, None]  # noqa: E731  (u,) -> (u, 1, 1)
        win = _Window(canvas, use, P.dis_x[sl, k][use], P.dis_y[sl, k][use], reach)
        u, v = _rotate(win.xs, win.ys, g(P.dis_x), g(P.dis_y), g(P.dis_angle))
        # ellipse: radial distance scaled back to pixels by the smaller semi-axis (approximate, fine at 1 px)
        ea, eb = g(P.dis_a), g(P.dis_b)
        d_ell = (np.sqrt((u / ea) ** 2 + (v / eb) ** 2) - 1.0) * np.minimum(ea, eb)
        # line segment along u: distance to the segment minus half the width
        d_line = np.sqrt(np.maximum(np.abs(u) - g(P.dis_len) / 2, 0.0) ** 2 + v * v) - g(P.dis_w) / 2
        d = np.where(P.dis_line[sl, k][use][:, None, None], d_line, d_ell)
        win.paint(np.clip(0.5 - d, 0.0, 1.0), dis_rgb[use, k])


def _render_block(rng: np.random.Generator, s: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """One block: draw every parameter for ``_BLOCK`` images (fixed draw order), render the first ``m``."""
    P = _draw_block(rng, s, m)
    sl = slice(0, m)
    canvas = _paint_background(P, s, m)
    _paint_distractors(canvas, P, s, m)
    # the class object, last. Its extent is at most 1.02 r + 0.5 around the centre (inside the image).
    everyone = np.arange(m)
    reach = min(int(math.ceil(_SCALE[1] * s * 1.02 + 1.5)), (s - 1) // 2)
    win = _Window(canvas, everyone, P.cx[sl], P.cy[sl], reach)
    u, v = _rotate(win.xs, win.ys, _col(P.cx, m), _col(P.cy, m), _col(P.angle, m))
    d = _shape_distance(P.labels[sl], u, v, _col(P.scale, m))
    obj_rgb = _hsv_to_rgb(P.obj_h[sl], P.obj_s[sl], P.obj_v[sl])
    win.paint(np.clip(0.5 - d, 0.0, 1.0), obj_rgb)
    mask = np.zeros((m, 1, s, s), bool)
    _Window(mask, everyone, P.cx[sl], P.cy[sl], reach).view[win.key] = (d < 0)[:, None]
    np.clip(canvas, 0.0, 1.0, out=canvas)
    params = {
        "center": np.stack([P.cx[sl], P.cy[sl]], axis=1),
        "scale": P.scale[sl],
        "angle": P.angle[sl],
        "color": obj_rgb,
        "background": P.bg_kind[sl],
        "n_distractors": P.n_dis[sl],
    }
    return canvas, P.labels[sl], mask[:, 0], params


def patch_masks(masks: Any, patch_size: int = PATCH_SIZE, reduce: str = "any") -> torch.Tensor:
    """Pool pixel masks (n, S, S) to the patch grid (n, S/p, S/p).

    ``reduce="any"``: bool, True where the patch holds at least one mask pixel; ``"mean"``: float32, the
    fraction of the patch's pixels inside the mask. ``masks`` may be a torch tensor or numpy array; S must
    be a multiple of ``patch_size``.
    """
    m = torch.as_tensor(masks)
    if m.ndim != 3 or m.shape[-1] % patch_size or m.shape[-2] % patch_size:
        raise ValueError(
            f"patch_masks: masks must be (n, H, W) with H and W multiples of patch_size={patch_size}, "
            f"got shape {tuple(m.shape)}"
        )
    n, h, w = m.shape
    blocks = m.reshape(n, h // patch_size, patch_size, w // patch_size, patch_size)
    if reduce == "any":
        return blocks.bool().any(dim=4).any(dim=2)
    if reduce == "mean":
        return blocks.float().mean(dim=(2, 4))
    raise ValueError(f"patch_masks: reduce must be 'any' or 'mean', got {reduce!r}")


# ------------------------------------------------------------------------------------------------- model
def preprocess(images: Any) -> torch.Tensor:
    """Images -> the model's ``pixel_values``: float32 (B, 3, 64, 64), (x - 0.5) / 0.5, i.e. in [-1, 1].

    Accepts what :func:`make_dataset` returns (float in [0, 1]) or uint8 in [0, 255]; a torch tensor or a
    numpy array; (B, 3, H, W) or a single (3, H, W) image (a batch axis is added).
    """
    x = torch.as_tensor(images)
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"preprocess: images must be (B, 3, H, W) or (3, H, W), got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    elif x.is_floating_point():
        x = x.float()
    else:
        raise TypeError(f"preprocess: images must be float in [0, 1] or uint8, got dtype {x.dtype}")
    return (x - _MEAN) / _STD


def shapes_config(
    *, hidden_size: int = 96, num_layers: int = 5, num_heads: int = 4, mlp_ratio: int = 2, dropout: float = 0.0
) -> Any:
    """The ``transformers.ViTConfig`` of the shapes model (defaults = the shipped architecture)."""
    from transformers import ViTConfig

    return ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_channels=3,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=mlp_ratio * hidden_size,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=0.0,
        qkv_bias=True,
        num_labels=len(CLASSES),
        id2label={i: c for i, c in enumerate(CLASSES)},
        label2id={c: i for i, c in enumerate(CLASSES)},
    )


def build_model(config: Any = None) -> Any:
    """An untrained ``ViTForImageClassification`` for ``config`` (default :func:`shapes_config`); initialised
    from torch's global RNG, so seed it first for reproducible weights."""
    from transformers import ViTForImageClassification

    return ViTForImageClassification(config if config is not None else shapes_config())


def load_shapes_model(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Any:
    """Load the shipped shapes ViT (or one saved by the training script in ``path``), in eval mode.

    Reads ``config.json`` and ``model.safetensors`` from ``path`` (default :data:`WEIGHTS_DIR`) with
    ``safetensors`` only: offline, no model hub, no remote code. Weights stored in float16 are cast to
    ``dtype``. Input: ``preprocess(images)``, (B, 3, 64, 64); output ``.logits`` (B, 4) over :data:`CLASSES`.

    Raises:
        FileNotFoundError: ``config.json`` or ``model.safetensors`` is missing (the message says how to
            rebuild them).
        ValueError: one of them is malformed (empty, truncated, the wrong tensors); the message names it.
    """
    from safetensors.torch import load_file
    from transformers import ViTConfig, ViTForImageClassification

    folder = Path(path) if path is not None else WEIGHTS_DIR
    cfg_file, weights = folder / "config.json", folder / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(
                f"load_shapes_model: {f} not found; rebuild it with `python tools/train/train_shapes.py` "
                "(in the source repository)"
            )
    with reading(cfg_file, "shapes model config (JSON)"):
        config = ViTConfig.from_dict(json.loads(cfg_file.read_text()))
    model = ViTForImageClassification(config)
    with reading(weights, "shapes model weights (.safetensors)"):
        state = {k: v.to(dtype) for k, v in load_file(str(weights)).items()}
        model.load_state_dict(state, strict=True)
    model.to(dtype)
    model.eval()
    return model

