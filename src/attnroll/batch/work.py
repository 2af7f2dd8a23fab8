"""Explaining one batch of inputs into rows and failures: the step both engines run.

A :class:`Worker` holds a loaded model and the job's settings (methods, options, output folder). Calling it
on a list of items reads them (a corrupt image or an empty text becomes a failure), explains the readable
ones with every method in one batched ``explain`` call each, writes the overlays (``png``) and commits the
batch's shard. The same code runs in-process (local engine) and inside each Ray actor.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from . import store
from .._checks import one_line
from ..targets import similarity_to
from .sources import Item


@dataclass
class Job:
    """What every batch of a run shares: methods (in order), each one's resolved options, the model's
    fingerprint, the output folder and whether to write overlays. Picklable (sent to Ray actors)."""

    methods: list[str]
    options: dict[str, dict[str, Any]]
    fingerprint: str
    out: str
    png: bool = False


class Worker:
    """Explains batches of items with one loaded model (``lm``: model, kind, prepare_image, tokenizer, labels)."""

    def __init__(self, lm: Any, job: Job):
        self.lm = lm
        self.job = job
        self.out = Path(job.out)

    def __call__(self, items: list[Item]) -> dict[str, int]:
        """Explain, write and commit ``items``; returns {"inputs", "rows", "failures"} counts."""
        return self.finish(self.load(items))

    def load(self, items: list[Item]) -> tuple:
        """Read and preprocess ``items`` (the part a prefetching thread can do while the model runs):
        (items, readable items, their inputs, failures of the unreadable)."""
        ready, payloads, failures = [], [], []
        for it in items:
            try:
                payloads.append(self._read(it))
                ready.append(it)
            except _Bad as e:
                failures.append(failure(it, None, str(e)))
        return items, ready, payloads, failures

    def finish(self, loaded: tuple) -> dict[str, int]:
        """Explain what :meth:`load` read with every method, commit the shard, return the counts."""
        items, ready, payloads, failures = loaded
        rows, failures = self.explain_loaded(ready, payloads, failures)
        store.commit(self.out, rows, failures)
        return {"inputs": len(items), "rows": len(rows), "failures": len({f["id"] for f in failures})}

    def explain(self, items: list[Item]) -> tuple[list[dict], list[dict]]:
        """Rows (one per readable item and method) and failures (one per unreadable item, or item and method)."""
        _, ready, payloads, failures = self.load(items)
        return self.explain_loaded(ready, payloads, failures)

    def explain_loaded(self, ready: list[Item], payloads: list, failures: list[dict]) -> tuple[list[dict], list[dict]]:
        rows: list[dict] = []
        failures = list(failures)
        if ready:
            for method in self.job.methods:
                r, f = self._explain_method(method, ready, payloads)
                rows += r
                failures += f
        return rows, failures

    # ---------------------------------------------------------------------------------------------- inputs
    def _read(self, it: Item) -> Any:
        if it.kind != self.lm.kind:
            raise _Bad(f"a {it.kind} input, but the model is a{'n image' if self.lm.kind == 'image' else ' text'} model")
        if it.kind == "text":
            if not it.text.strip():
                raise _Bad("empty text")
            if it.pair is not None and not it.pair.strip():
                raise _Bad("empty pair text")
            return it
        img = read_image(it.path)
        try:
            return img, self.lm.prepare_image(img)
        except Exception as e:  # noqa: BLE001 - any preprocessing problem belongs to this input
            raise _Bad(f"cannot preprocess the image: {_one_line(e)}") from None

    # ------------------------------------------------------------------------------------------ explaining
    def _explain_method(self, method: str, items: list[Item], payloads: list[Any]) -> tuple[list[dict], list[dict]]:
        """All items at once; when that fails, one by one, so that one bad input fails alone."""
        try:
            return self._rows(method, items, payloads), []
        except Exception as e:  # noqa: BLE001 - a failing input must not stop the job
            if len(items) == 1:
                return [], [failure(items[0], method, f"{type(e).__name__}: {_one_line(e)}")]
        rows, failures = [], []
        for it, p in zip(items, payloads):
            r, f = self._explain_method(method, [it], [p])
            rows += r
            failures += f
        return rows, failures

    def _rows(self, method: str, items: list[Item], payloads: list[Any]) -> list[dict]:
        if self.lm.kind == "image":
            x = torch.cat([p[1] for p in payloads])
            e, logits = self._run(method, x, None, items[0].index)
            rows = [self._row(e, b, it, logits) for b, it in enumerate(items)]
            if self.job.png:
                for b, (it, p) in enumerate(zip(items, payloads)):
                    write_overlay(self.out, it.id, method, e, b, p[0])
            return rows
        rows = []
        for group in _text_groups(items):
            rows += self._text_rows(method, group)
        return sorted(rows, key=lambda r: r["index"])

    def _run(self, method: str, inputs: Any, target: Any, first: int) -> tuple[Any, torch.Tensor | None]:
        """One batched ``explain`` (the shared batching helper, one chunk) with the job's options; also the
        model's class scores of that pass. ``first``: the source index of the batch's first input."""
        from ..methods import iter_explanations

        batch = _batch_len(inputs)
        opts = dict(self.job.options.get(method, {}))
        if method == "random":  # a distinct seed per batch, so that batches do not repeat one map
            opts["seed"] = int(opts.get("seed") or 0) + first
        with first_logits(self.lm.model, batch) as got:
            ((_, e),) = iter_explanations(self.lm.model, inputs, method, target=target, batch_size=batch,
                                          tokenizer=self.lm.tokenizer, **opts)
        return e, got.get("logits")

    def _text_rows(self, method: str, items: list[Item]) -> list[dict]:
        tok = self.lm.tokenizer
        texts = [it.text for it in items]
        pairs = [it.pair for it in items] if items[0].pair is not None else None
        joint = pairs is not None and self._has_logits()
        enc = tok(texts, pairs if joint else None, padding=True, truncation=True, return_tensors="pt")
        target = None
        if pairs is not None and not joint:
            target = similarity_to(self.lm.model, tok, enc["attention_mask"], pairs)
        e, logits = self._run(method, enc, target, items[0].index)
        lengths = enc["attention_mask"].sum(dim=1).tolist()
        return [self._row(e, b, it, logits, int(lengths[b])) for b, it in enumerate(items)]

    def _has_logits(self) -> bool:
        if not hasattr(self, "_logits_known"):
            self._logits_known = has_class_scores(self.lm)
        return self._logits_known

    # ---------------------------------------------------------------------------------------------- rows
    def _row(self, e: Any, b: int, it: Item, logits: torch.Tensor | None, length: int | None = None) -> dict:
        from ..methods.explanation import jsonable

        full = e.full_row[b].to(torch.float32)
        if length is not None:
            full = full[:length]
        p = e.prefix
        target = e.target[b] if isinstance(e.target, list) else e.target
        pred = prob = None
        if logits is not None:
            probs = torch.softmax(logits[b].to(torch.float64), dim=-1)
            pred = int(probs.argmax())
            prob = float(probs[pred])
        tokens = None
        if e.tokens is not None:
            tokens = list(e.tokens[b][: length if length is not None else None])
        is_class = isinstance(target, int) and not isinstance(target, bool)
        labels = getattr(self.lm, "labels", {}) or {}
        return {
            "index": it.index, "id": it.id, "source": it.source, "method": e.method,
            "options": json.dumps(jsonable(e.options), sort_keys=True),
            "target": target if is_class else None,
            "target_name": labels.get(target, None) if is_class else (None if target is None else str(target)),
            "prediction": pred, "probability": prob,
            "scores": full[p:].tolist(), "prefix_scores": full[:p].tolist(),
            "grid": None if e.grid is None else [int(g) for g in e.grid],
            "tokens": tokens, "model": self.job.fingerprint,
        }


class _Bad(Exception):
    """An input that cannot be explained; the message is the failure's reason."""


def failure(it: Item, method: str | None, reason: str) -> dict:
    """A row of the failures table."""
    return {"index": it.index, "id": it.id, "source": it.source, "method": method, "reason": reason}


def _one_line(e: Any) -> str:
    return one_line(e)[:500] or type(e).__name__


def read_image(path: str) -> Any:
    """A fully decoded PIL RGB image; a missing, unreadable or corrupt file raises :class:`_Bad`."""
    from ..viz.pixels import read_image as decode

    try:
        return decode(path, "attnroll batch")
    except FileNotFoundError:
        raise _Bad("file not found") from None
    except ValueError as e:
        raise _Bad(str(e)) from None


def write_overlay(out: Path, item_id: str, method: str, e: Any, b: int, img: Any) -> None:
    """``out/png/<id>.<method>.png``: the map of example ``b`` over its image (written atomically)."""
    from ..viz import overlay, save_image

    path = out / "png" / f"{item_id}.{method}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(overlay(e, img, b), path)


def _batch_len(inputs: Any) -> int:
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0])
    return int(inputs["input_ids"].shape[0])


def _text_groups(items: list[Item]) -> Iterator[list[Item]]:
    """Texts with a pair and texts without, as two groups (they are tokenised differently)."""
    with_pair = [it for it in items if it.pair is not None]
    alone = [it for it in items if it.pair is None]
    for g in (alone, with_pair):
        if g:
            yield g


@contextlib.contextmanager
def first_logits(model: torch.nn.Module, batch: int) -> Iterator[dict]:
    """Keep the class scores (batch, C) of the model's first forward pass with ``batch`` examples (the one
    ``explain`` captures), so that the prediction costs no second pass."""
    from ..methods.base import main_logits

    got: dict[str, torch.Tensor] = {}

    def hook(module: Any, args: Any, output: Any) -> None:
        if "logits" not in got:
            lg = main_logits(output)
            if lg is not None and lg.ndim == 2 and lg.shape[0] == batch:
                got["logits"] = lg.detach()

    handle = model.register_forward_hook(hook)
    try:
        yield got
    finally:
        handle.remove()


def has_class_scores(lm: Any) -> bool:
    """Whether a text model outputs class scores (B, C) (else it is a bare encoder: sentence embeddings)."""
    from ..methods.base import main_logits

    probe = lm.tokenizer(["a"], return_tensors="pt")
    with torch.no_grad():
        lg = main_logits(lm.model(**probe))
    return lg is not None and lg.ndim == 2


