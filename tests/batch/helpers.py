"""Shared inputs of the batch tests: embedded-shapes images written as PNG files in nested folders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def write_shapes(root: Path, n: int = 40, seed: int = 3) -> list[Path]:
    """``n`` generated shapes images as PNGs under ``root`` (half of them one folder deeper); their paths."""
    from PIL import Image

    from attnroll.models import shapes

    images, _, _ = shapes.make_dataset(n, seed)
    paths = []
    for i, im in enumerate(images):
        folder = root / "deeper" if i % 2 else root
        folder.mkdir(parents=True, exist_ok=True)
        p = folder / f"img{i:03d}.png"
        Image.fromarray(to_uint8(im)).save(p)
        paths.append(p)
    return paths


def to_uint8(im: torch.Tensor) -> np.ndarray:
    """(3, H, W) floats in [0, 1] -> (H, W, 3) uint8."""
    return (im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def pixel_input(path: Path) -> torch.Tensor:
    """The shapes model's input for one PNG, computed independently of attnroll's loaders: [0, 1] -> [-1, 1]."""
    from PIL import Image

    arr = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    return (torch.from_numpy(arr).permute(2, 0, 1)[None] - 0.5) / 0.5


def assert_same_rows(a, b, atol=1e-6):
    """Two read_batch frames hold the same rows: equal ids, methods, options, targets, predictions, model
    fingerprints and grids, and scores equal within ``atol`` (batches of another size may round differently)."""
    cols = ["id", "method", "options", "target", "target_name", "prediction", "model"]
    a = a.sort_values(["id", "method"]).reset_index(drop=True)
    b = b.sort_values(["id", "method"]).reset_index(drop=True)
    assert a[cols].astype(str).values.tolist() == b[cols].astype(str).values.tolist()
    assert [list(g) for g in a["grid"]] == [list(g) for g in b["grid"]]
    for x, y in zip(a["scores"], b["scores"]):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)
    np.testing.assert_allclose(a["probability"].to_numpy(float), b["probability"].to_numpy(float), atol=1e-6)
