"""Precomputed maps for ``evaluate`` and ``audit``: an ``attnroll batch`` output used instead of explaining
again. The output's manifest names the model (checked against its fingerprint) and the source images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ._data import load
from ._output import Failure, one_line

__all__ = ["is_batch_output", "batch_kind", "batch_methods", "batch_model", "batch_maps", "batch_text_inputs"]


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
    if meta.get("kind") not in ("image", "text"):
        raise click.UsageError(f"{what} {folder}: maps of {meta.get('kind')} inputs; precomputed maps are read "
                               "for image and text classifiers")
    return meta


def batch_kind(folder: Path, what: str) -> str:
    """"image" or "text": the inputs of the batch output ``folder``."""
    return str(_manifest(folder, what)["kind"])


def batch_methods(folder: Path, what: str) -> list[str]:
    """The methods whose maps the batch output ``folder`` holds."""
    return list(_manifest(folder, what)["key"]["methods"])


def batch_model(folder: Path, what: str, spec: str | None = None) -> Any:
    """The model that made the batch output ``folder`` (or ``spec``), loaded, its fingerprint checked."""
    from ..batch import model_fingerprint

    meta = _manifest(folder, what)
    made_by = meta.get("model_spec") or {}
    lm = load(spec if spec is not None else made_by.get("name"), made_by.get("weights") if spec is None else None,
              meta["kind"])
    if model_fingerprint(lm.model) != meta["key"]["model"]:
        raise click.UsageError(f"{what} {folder}: its maps were made by another model ({meta.get('model_name')}, "
                               f"{meta['key']['model']}) than {lm.name}")
    return lm


def batch_maps(wanted: list[tuple[Path, str]], n: int | None, what: str) -> tuple[list[Any], list[Any]]:
    """For each (batch output, method): an Explanation (B, units) of that method's maps, over the inputs that
    every one of them explained (in the first output's source order; at most ``n``), and those inputs: image
    files, or the source's items for texts (token maps zero-padded to the longest, see ``explanations``)."""
    from ..batch import explanations, list_items

    per = []
    for folder, method in wanted:
        meta = _manifest(folder, what)
        if method not in meta["key"]["methods"]:
            raise click.UsageError(
                f"{what} {folder}: no {method!r} maps (it holds {', '.join(meta['key']['methods'])})"
            )
        e, ids = explanations(folder, method, pad=True)
        per.append((Path(meta["key"]["source"]), e, ids, meta))
    common = set(per[0][2]).intersection(*[set(p[2]) for p in per[1:]])
    keep = [i for i in per[0][2] if i in common][:n]
    if not keep:
        raise Failure(f"{what}: the batch outputs have no input in common")
    out = []
    for _, e, ids, _ in per:
        pos = {i: k for k, i in enumerate(ids)}
        out.append(_take(e, [pos[i] for i in keep]))
    first = per[0][3]
    if first["kind"] == "text":
        try:
            items = {it.id: it for it in list_items(first["key"]["source"], first["key"].get("column"))}
        except ValueError as e:
            raise Failure(f"{what}: cannot read the texts of {wanted[0][0]} again: {one_line(e)}") from None
        return [items[i] for i in keep], out
    from ..batch.read import recorded_sources

    recorded = recorded_sources(wanted[0][0])
    return [_image_path(recorded.get(i), per[0][0], i) for i in keep], out


def _image_path(recorded: str | None, source: Path, item_id: str) -> Path:
    """An input's image file: the path its batch recorded (absolute since paths are recorded so); for an
    output of an earlier version (a path relative to where that run ran) an image folder's ``source/id``."""
    if recorded is not None and (Path(recorded).is_absolute() or not source.is_dir()):
        return Path(recorded)
    return source / item_id


def _take(e: Any, rows: list[int]) -> Any:
    from dataclasses import replace

    target = [e.target[r] for r in rows] if isinstance(e.target, list) else e.target
    return replace(e, scores=e.scores[rows], full_row=e.full_row[rows], target=target,
                   tokens=None if e.tokens is None else [e.tokens[r] for r in rows],
                   attention_mask=None if e.attention_mask is None else e.attention_mask[rows])


def batch_text_inputs(items: list[Any], lm: Any, maps: list[Any], what: str) -> tuple[dict, list[Any]]:
    """The tokenizer's inputs (B, n) for the texts of a batch output (pairs encoded together, as the batch
    job encoded them for a classifier), with ``special_tokens_mask``, and each Explanation's token maps
    placed on those n positions (zeros at padding). Every row's stored tokens must be the tokens here."""
    from dataclasses import replace

    import torch

    pairs = [it.pair for it in items]
    if len({p is None for p in pairs}) > 1:
        raise click.UsageError(f"{what}: the selected texts mix single texts and pairs; evaluate one kind at a time")
    enc = lm.tokenizer([it.text for it in items], None if pairs[0] is None else pairs, padding=True,
                       truncation=True, return_tensors="pt", return_special_tokens_mask=True)
    B, n = enc["input_ids"].shape
    lengths = enc["attention_mask"].sum(dim=1).tolist()
    placed = []
    for e in maps:
        scores = torch.zeros(B, n, dtype=torch.float32)
        for b in range(B):
            ids = enc["input_ids"][b, : lengths[b]].tolist()
            if e.tokens is not None and list(e.tokens[b]) != lm.tokenizer.convert_ids_to_tokens(ids):
                raise click.UsageError(f"{what}: input {items[b].id!r} tokenizes differently now than when its "
                                       "maps were made (another tokenizer?)")
            scores[b, : lengths[b]] = e.full_row[b, : lengths[b]]
        placed.append(replace(e, scores=scores, full_row=scores.clone(), attention_mask=enc["attention_mask"]))
    return dict(enc), placed
