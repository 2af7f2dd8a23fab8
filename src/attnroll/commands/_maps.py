"""Precomputed maps for ``evaluate`` and ``audit``: an ``attnroll batch`` output used instead of explaining
again. The output's manifest names the model (checked against its fingerprint) and the source images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ._data import load
from ._output import Failure, one_line

__all__ = ["is_batch_output", "batch_methods", "batch_model", "batch_maps"]


def is_batch_output(path: Any) -> bool:
    """Whether ``path`` is a folder written by ``attnroll batch`` (it holds a manifest)."""
    from ..batch.store import MANIFEST

    return path is not None and (Path(path) / MANIFEST).is_file()


def _manifest(folder: Path, what: str) -> dict:
    from ..batch import read_manifest

    try:
        meta = read_manifest(folder)
    except ValueError as e:
        raise click.UsageError(f"{what} {folder}: {one_line(e)}") from None
    if meta.get("kind") != "image":
        raise click.UsageError(f"{what} {folder}: maps of {meta.get('kind')} inputs; precomputed maps are read "
                               "for image classifiers")
    return meta


def batch_methods(folder: Path, what: str) -> list[str]:
    """The methods whose maps the batch output ``folder`` holds."""
    return list(_manifest(folder, what)["key"]["methods"])


def batch_model(folder: Path, what: str, spec: str | None = None) -> Any:
    """The model that made the batch output ``folder`` (or ``spec``), loaded, its fingerprint checked."""
    from ..batch import model_fingerprint

    meta = _manifest(folder, what)
    made_by = meta.get("model_spec") or {}
    lm = load(spec if spec is not None else made_by.get("name"), made_by.get("weights") if spec is None else None,
              "image")
    if model_fingerprint(lm.model) != meta["key"]["model"]:
        raise click.UsageError(f"{what} {folder}: its maps were made by another model ({meta.get('model_name')}, "
                               f"{meta['key']['model']}) than {lm.name}")
    return lm


def batch_maps(wanted: list[tuple[Path, str]], n: int | None, what: str) -> tuple[list[Path], list[Any]]:
    """For each (batch output, method): an Explanation (B, units) of that method's maps, over the inputs that
    every one of them explained (in the first output's source order; at most ``n``), and their files."""
    from ..batch import explanations

    per = []
    for folder, method in wanted:
        meta = _manifest(folder, what)
        if method not in meta["key"]["methods"]:
            raise click.UsageError(f"{what} {folder}: no {method!r} maps (it holds {', '.join(meta['key']['methods'])})")
        e, ids = explanations(folder, method)
        per.append((Path(meta["key"]["source"]), e, ids))
    common = set(per[0][2]).intersection(*[set(p[2]) for p in per[1:]])
    keep = [i for i in per[0][2] if i in common][:n]
    if not keep:
        raise Failure(f"{what}: the batch outputs have no input in common")
    out = []
    for _, e, ids in per:
        pos = {i: k for k, i in enumerate(ids)}
        out.append(_take(e, [pos[i] for i in keep]))
    return [per[0][0] / i for i in keep], out


def _take(e: Any, rows: list[int]) -> Any:
    from dataclasses import replace

    target = [e.target[r] for r in rows] if isinstance(e.target, list) else e.target
    return replace(e, scores=e.scores[rows], full_row=e.full_row[rows], target=target,
                   tokens=None if e.tokens is None else [e.tokens[r] for r in rows])
