"""``Explanation``: one method's saliency for a batch of inputs, with what is needed to show and reproduce it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from .._explanation_checks import check_saved_parts, numpy_array, restore_dtypes, stored_dtypes
from .._io import atomic_write, reading
from ..viz.notebook import NotebookView

_FORMAT = "attnroll.Explanation/1"


@dataclass
class Explanation(NotebookView):
    """Saliency over input units (image patches or tokens), batch-first.

    Attributes:
        scores: (B, units) float32 tensor: the method's saliency over the input units, prefix tokens (CLS,
            distillation, registers) removed, in the method's own units (no rescaling; see ``normalized``).
            Image models: units = h·w patches in row-major grid order. Text: one per token, special tokens
            included (text models have ``prefix`` 0). Padded tokens score 0.
        full_row: (B, n) the whole output row over every token, prefix tokens included.
        layers: (L, B, n) the output row after each layer (partial products), when the method was asked for
            it with ``return_layers=True``; else None.
        tokens: token strings per example (text; needs ``tokenizer=``), else None.
        grid: patch grid (h, w) of image models, else None.
        prefix: number of prefix tokens removed from ``full_row`` to give ``scores``.
        method: the registered method name; ``options``: the options it ran with (defaults filled in).
        target: what was explained, per example: class / token indices (list of ints), a description of a
            callable target ("callable: name"), or None for class-agnostic results without a class output.
        positions: the output position (row) explained, per example.
        attention_mask: (B, n) 0/1 padding mask of the explained stream, or None.
        extra: method-specific arrays and lists (e.g. ``heads`` (B, H, n) for per-head rollout,
            ``text_scores`` for CLIP, ``target_scores`` for encoder-decoders); saved with the rest.
        readout: which output rows made the map: ``{"kind": "cls" | "mean" | "last" | "eot" | "position" |
            "weights" | "attention_pool", "source": where it came from, "positions": one row per example or
            None}``; None for input-gradient baselines (they have no rows).
        readout_weights: (B, n) the weights of the output rows (``full_row[b] = Σ_i w[b, i] · R[b, i]``).
        suffix: number of tokens after the units (YOLOS detection tokens) left out of ``scores``.

    In a notebook an Explanation displays itself as the interactive viewer (``_repr_html_``: a sandboxed
    inline frame, offline); ``show()`` displays it there and prints its scores as numbers anywhere else.
    """

    scores: torch.Tensor
    full_row: torch.Tensor
    layers: torch.Tensor | None = None
    tokens: list[list[str]] | None = None
    grid: tuple[int, int] | None = None
    prefix: int = 0
    method: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    target: Any = None
    positions: list[int] | None = None
    attention_mask: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    readout: dict[str, Any] | None = None
    readout_weights: torch.Tensor | None = None
    suffix: int = 0

    _frame_height = 720  # the inline viewer's height in a notebook

    # ----------------------------------------------------------------------------------------- views
    @property
    def batch_size(self) -> int:
        return int(self.scores.shape[0])

    def as_grid(self) -> torch.Tensor:
        """Scores as (B, h, w) patch maps (image models only)."""
        if self.grid is None:
            raise ValueError(
                f"as_grid() needs a patch grid, but this explanation (method {self.method!r}) is over tokens "
                "(grid is None); use .scores (B, tokens) or .to_html()"
            )
        h, w = self.grid
        if self.scores.shape[-1] != h * w:
            raise ValueError(f"scores have {self.scores.shape[-1]} units, the grid {h}x{w} needs {h * w}")
        return self.scores.reshape(self.batch_size, h, w)

    def normalized(self, kind: str = "max") -> "Explanation":
        """A copy whose ``scores`` are rescaled per example: "max" divides by the largest absolute value,
        "minmax" maps to [0, 1], "sum" divides by the sum (so that the scores are shares). Rows that are all
        zero (or constant, for "minmax") become 0. ``full_row`` and ``layers`` are left as they were."""
        from .. import _checks

        _checks.check_choice("kind", kind, ("max", "minmax", "sum"))
        s = self.scores.to(torch.float64)
        if kind == "max":
            d = s.abs().amax(dim=-1, keepdim=True)
        elif kind == "minmax":
            s = s - s.amin(dim=-1, keepdim=True)
            d = s.amax(dim=-1, keepdim=True)
        else:
            d = s.sum(dim=-1, keepdim=True)
        out = torch.where(d != 0, s / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(s))
        return replace(self, scores=out.to(self.scores.dtype), options={**self.options, "normalized": kind})

    # ------------------------------------------------------------------------------------------- I/O
    def save(self, path: str | os.PathLike) -> str:
        """Write the arrays and a JSON metadata record (method, options, target, tokens, grid, ...) to one
        ``.npz`` file, atomically (a temporary file in the same folder, then a rename). Returns the path.
        Arrays of a dtype numpy lacks (bfloat16, float8) are stored as float32 and loaded back as they were."""
        path = os.fspath(path)
        if not path.endswith(".npz"):
            path += ".npz"
        raw = {"scores": self.scores, "full_row": self.full_row, "layers": self.layers,
               "attention_mask": self.attention_mask, "readout_weights": self.readout_weights}
        raw = {k: v for k, v in raw.items() if v is not None}
        extra_meta = {}
        for k, v in self.extra.items():
            if isinstance(v, (torch.Tensor, np.ndarray)):
                raw["extra__" + k] = v
            else:
                extra_meta[k] = jsonable(v)
        arrays: dict[str, np.ndarray] = {k: _np(v) for k, v in raw.items()}
        meta = {
            "format": _FORMAT,
            "method": self.method,
            "options": jsonable(self.options),
            "target": jsonable(self.target),
            "tokens": self.tokens,
            "grid": list(self.grid) if self.grid is not None else None,
            "prefix": self.prefix,
            "positions": self.positions,
            "extra": extra_meta,
            "readout": jsonable(self.readout),
            "suffix": self.suffix,
            "dtypes": stored_dtypes(raw),  # bfloat16 / float8 arrays are stored as float32
        }
        arrays["__meta__"] = np.array(json.dumps(meta))
        return atomic_write(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Explanation":
        """Read a file written by :meth:`save` (no pickles are loaded).

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not a complete Explanation file (empty, truncated, a plain ``.npy``,
                another ``.npz``, metadata or arrays missing), or its metadata contradicts its arrays (prefix
                or suffix outside the row, a grid of another size, tokens / positions / target not one per
                example, layers / mask of other shapes); the message names the file and what is wrong.
        """
        path = os.fspath(path)
        with reading(path, "attnroll Explanation file (.npz)"):
            with open(path, "rb") as fh:  # a missing file or a folder raises here, unchanged
                magic = fh.read(6)
            if magic and not magic.startswith((b"PK", b"\x93NUMPY")):
                raise ValueError(f"{path} is not an .npz archive (not a zip file): not an attnroll Explanation file")
            z = np.load(path, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise ValueError(f"{path} is a plain .npy array, not an attnroll Explanation file (.npz)")
            with z:
                t, meta = _read_npz(path, z)
            t = restore_dtypes(path, t, meta.get("dtypes"))
            check_saved_parts(path, t, meta)  # metadata that contradicts the arrays
            return _from_parts(cls, path, t, meta)

    # ---------------------------------------------------------------------------------------- display
    def to_html(self, index: int | None = None, kind: str = "max", *, interactive: bool = False,
                **view_options: Any) -> str:
        """A self-contained HTML snippet: each token (or patch cell) on a background whose strength is its
        score (``normalized(kind)``; negative scores in blue). ``index`` picks one example (default: all).

        ``interactive=True``: instead, the complete page of the interactive viewer (one file, no network;
        layer slider when ``layers`` were kept, per-head grid, values under the pointer); ``view_options``
        go to :func:`attnroll.viz.view` (``images=``, ``masks=``, ``segments=``, ``skip=``, ``title=``...).
        Drawn by :func:`attnroll.viz.explanation_html` / :func:`attnroll.viz.view`."""
        if interactive:
            from ..viz import view

            return view(self, index=index, **view_options).html
        if view_options:
            raise TypeError(f"to_html() got options {sorted(view_options)} that only interactive=True takes")
        from ..viz import explanation_html

        return explanation_html(self, index, kind)

    def overlay(self, image: Any, index: int | None = None, alpha: float = 0.5, kind: str = "minmax",
                **options: Any) -> Any:
        """The map of example ``index`` upsampled (bilinear) onto ``image`` (a PIL image, or an (H, W, 3)
        array) with a colormap and blended with weight ``alpha``; returns a PIL RGB image. ``index`` may be
        left out for one example; with several it is required (a ValueError otherwise). Drawn by
        :func:`attnroll.viz.overlay`, which takes the further ``options`` (``cmap``, ``size``, ``outline``...).
        Needs the ``viz`` extra."""
        from ..viz import overlay

        return overlay(self, image, index, alpha=alpha, kind=kind, **options)

    def _notebook_html(self) -> str:
        """The viewer's page; an explanation the viewer cannot draw (e.g. scores without tokens or a grid of
        their size) falls back to the static token / patch snippet."""
        from ..viz import explanation_html, view

        try:
            return view(self).html
        except (ValueError, TypeError):
            snippet = explanation_html(self)
            return f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{snippet}</body></html>"

    def _plain_text(self) -> str:
        from ..viz.text import explanation_text

        return explanation_text(self)

    def __repr__(self) -> str:
        where = f"grid={self.grid}" if self.grid is not None else f"tokens={self.tokens is not None}"
        return (
            f"Explanation(method={self.method!r}, scores={tuple(self.scores.shape)}, prefix={self.prefix}, "
            f"{where}, target={self.target!r}, layers={None if self.layers is None else tuple(self.layers.shape)})"
        )


#: Metadata entries of the file format and the types they must have.
_META = {"method": (str,), "options": (dict,), "tokens": (list, type(None)), "grid": (list, type(None)),
         "prefix": (int,), "positions": (list, type(None)), "extra": (dict, type(None))}


def _read_npz(path: str, z: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The arrays and the metadata of an open Explanation archive, checked for completeness."""
    if "__meta__" not in z.files:
        raise ValueError(f"{path} is not an attnroll Explanation file (no metadata record)")
    meta = json.loads(str(z["__meta__"]))
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: unknown format {got!r}, expected {_FORMAT!r}")
    missing = [k for k in ("scores", "full_row") if k not in z.files] + [k for k in _META if k not in meta]
    if missing:
        raise ValueError(f"{path} is an incomplete attnroll Explanation file: {', '.join(missing)} missing")
    bad = [k for k, types in _META.items() if not isinstance(meta[k], types) or isinstance(meta[k], bool)]
    if bad:
        raise ValueError(f"{path}: metadata entries {bad} have the wrong type")
    t = {k: torch.from_numpy(z[k].copy()) for k in z.files if k != "__meta__"}
    if t["scores"].ndim != 2 or t["full_row"].ndim != 2 or t["scores"].shape[0] != t["full_row"].shape[0]:
        raise ValueError(
            f"{path}: scores {tuple(t['scores'].shape)} and full_row {tuple(t['full_row'].shape)} must be "
            "(B, units) and (B, n) with the same B"
        )
    return t, meta


def _from_parts(cls: Any, path: str, t: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Explanation":
    extra = dict(meta.get("extra") or {})
    extra.update({k[len("extra__"):]: v for k, v in t.items() if k.startswith("extra__")})
    grid = meta["grid"]
    if grid is not None and (len(grid) != 2 or not all(isinstance(g, int) for g in grid)):
        raise ValueError(f"{path}: grid must be two ints, got {grid!r}")
    return cls(
        scores=t["scores"],
        full_row=t["full_row"],
        layers=t.get("layers"),
        tokens=meta["tokens"],
        grid=tuple(grid) if grid is not None else None,
        prefix=meta["prefix"],
        method=meta["method"],
        options=meta["options"],
        target=meta.get("target"),
        positions=meta["positions"],
        attention_mask=t.get("attention_mask"),
        extra=extra,
        readout=meta.get("readout"),
        readout_weights=t.get("readout_weights"),
        suffix=_checks_int(path, "suffix", meta.get("suffix", 0)),
    )


def _checks_int(path: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: metadata entry {key!r} must be an integer, got {value!r}")
    return value


def _np(t: Any) -> np.ndarray:
    return numpy_array(t)


def jsonable(x: Any) -> Any:
    """Options and targets as JSON: tensors/arrays become lists, callables and other objects their name."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, range)):
        return [jsonable(v) for v in x]
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return _np(x).tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, torch.dtype):
        return str(x)
    if callable(x):
        return f"callable: {getattr(x, '__qualname__', type(x).__name__)}"
    return repr(x)
