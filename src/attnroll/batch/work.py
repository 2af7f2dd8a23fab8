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

from .._checks import one_line
from .._names import inside, safe_name
from ..targets import similarity_to
from . import store
from .sources import Item


@dataclass
class Job:
    """What every batch of a run shares: methods (in order), each one's resolved options, the model's
    fingerprint, the output folder, whether to write overlays and the class to explain (``target``: None =
    each input's own target, else the predicted class). ``run``: the run's id in the manifest; a batch is
    committed only while the manifest still names this run (None: no check). ``shard_meta``: the JSON each
    shard carries (:func:`attnroll.batch.store.shard_meta`). Picklable (sent to Ray actors)."""

    methods: list[str]
    options: dict[str, dict[str, Any]]
    fingerprint: str
    out: str
    png: bool = False
    target: int | None = None
    run: str | None = None
    shard_meta: str | None = None  # what each shard carries: store.shard_meta (None: nothing)


class Worker:
    """Explains batches of items with one loaded model (``lm``: model, kind, prepare_image, tokenizer, labels)."""

    def __init__(self, lm: Any, job: Job):
        self.lm = lm
        self.job = job
        self.out = Path(job.out)
        self.device = _device_of(lm.model)
        self._prepared: dict[str, Any] = {}  # method -> its Prepared explain (see _explainer)
        #: (ids of the committed rows, one per row; ids of the committed failures), kept by :meth:`commit`
        #: when set to two lists (the local engine on a new output counts it from them), else None
        self.tally: tuple[list[str], list[str]] | None = None
        self._keep: contextlib.ExitStack | None = None  # inside kept_sessions(): where the sessions are held

    @contextlib.contextmanager
    def kept_sessions(self) -> Iterator["Worker"]:
        """Within the block, each method's prepared explain keeps its capture session open from its first batch
        to the end of the block (``explain.explainer.Prepared.keep``), closed also when the block raises: the
        local engine's run, whose batches come one at a time on this thread."""
        with contextlib.ExitStack() as stack:
            self._keep = stack
            try:
                yield self
            finally:
                self._keep = None

    def __call__(self, items: list[Item]) -> dict[str, int]:
        """Explain, write and commit ``items``; returns {"inputs", "rows", "failures"} counts."""
        return self.commit(self.compute(self.load(items)))

    def load(self, items: list[Item]) -> tuple:
        """Read and preprocess ``items`` (the part a prefetching thread can do while the model runs):
        (items, readable items, their inputs, failures of the unreadable, the readable images' pixels
        concatenated (B, C, H, W) or None for texts)."""
        ready, payloads, failures = [], [], []
        for it in items:
            try:
                payloads.append(self._read(it))
                ready.append(it)
            except _Bad as e:
                failures.append(failure(it, None, str(e)))
        return items, ready, payloads, failures, _stack(payloads) if self.lm.kind == "image" else None

    def compute(self, loaded: tuple) -> tuple:
        """Explain what :meth:`load` read with every method: (items, row tables, failures), ready to commit."""
        items, ready, payloads, failures, stacked = loaded
        tables, failures = self.explain_loaded(ready, payloads, failures, stacked)
        return items, tables, failures

    def commit(self, computed: tuple) -> dict[str, int]:
        """Write the batch's shard (the part a writer thread can do while the model runs); the counts."""
        items, tables, failures = computed
        if self.job.run is not None:
            store.check_run(self.out, self.job.run)
        rows = store.commit_tables(self.out, tables, failures, self.job.shard_meta)
        if self.tally is not None:
            self.tally[0].extend(i for t in tables if t.num_rows for i in _ids(t))
            self.tally[1].extend(f["id"] for f in failures)
        return {"inputs": len(items), "rows": rows, "failures": len({f["id"] for f in failures})}

    def explain(self, items: list[Item]) -> tuple[list[Any], list[dict]]:
        """Row tables (one row per readable item and method) and failures (one per unreadable item, or item
        and method)."""
        _, ready, payloads, failures, stacked = self.load(items)
        tables, failures = self.explain_loaded(ready, payloads, failures, stacked)
        return [store.as_table(t) for t in tables], failures

    def explain_loaded(self, ready: list[Item], payloads: list, failures: list[dict],
                       stacked: torch.Tensor | None = None) -> tuple[list[Any], list[dict]]:
        """``explain`` of what :meth:`load` read; ``stacked``: the images' pixels concatenated (or None)."""
        tables: list[Any] = []
        failures = list(failures)
        if ready:
            for method in self.job.methods:
                t, f = self._explain_method(method, ready, payloads, stacked)
                tables += t
                failures += f
        return tables, failures

    # ---------------------------------------------------------------------------------------------- inputs
    def _read(self, it: Item) -> Any:
        if it.kind != self.lm.kind:
            raise _Bad(
                f"a {it.kind} input, but the model is a{'n image' if self.lm.kind == 'image' else ' text'} model"
            )
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
    def _explain_method(self, method: str, items: list[Item], payloads: list[Any],
                        stacked: torch.Tensor | None = None) -> tuple[list[Any], list[dict]]:
        """All items at once; when that fails, one by one, so that one bad input fails alone. ``stacked``:
        the items' pixels concatenated, or None."""
        try:
            return self._tables(method, items, payloads, stacked), []
        except Exception as e:  # noqa: BLE001 - a failing input must not stop the job
            if len(items) == 1:
                return [], [failure(items[0], method, f"{type(e).__name__}: {_one_line(e)}")]
        tables, failures = [], []
        for it, p in zip(items, payloads):
            t, f = self._explain_method(method, [it], [p])
            tables += t
            failures += f
        return tables, failures

    def _tables(
        self, method: str, items: list[Item], payloads: list[Any], stacked: torch.Tensor | None = None
    ) -> list[Any]:
        """One row table per group of items explained in one call (images: those with and without their own
        target; texts: also with and without a pair). ``stacked``: the items' pixels concatenated (by the
        reader thread: the usual batch is one group, which then needs no concatenation here), or None."""
        tables = []
        for group in _groups(items, self.lm.kind, self.job.target):
            pick = [payloads[k] for k in group]
            its = [items[k] for k in group]
            target = _targets(its, self.job.target)
            if self.lm.kind == "image":
                whole = stacked is not None and len(group) == len(items)  # (a group keeps source order)
                x = (stacked if whole else torch.cat([p[1] for p in pick])).to(self.device)
                e, logits = self._run(method, x, target, its[0].index)
                tables.append(self._table(e, its, logits, None))
                if self.job.png:
                    for b, (it, p) in enumerate(zip(its, pick)):
                        write_overlay(self.out, it.id, method, e, b, p[0])
            else:
                tables.append(self._text_table(method, its, target))
        return tables

    def _run(self, method: str, inputs: Any, target: Any, first: int) -> tuple[Any, torch.Tensor | None]:
        """One batched ``explain`` (the shared batching helper, one chunk) with the job's options; also the
        model's class scores of that pass. ``first``: the source index of the batch's first input."""
        explainer = self._explainer(method)
        extra = {}
        if method == "random":  # a distinct seed per batch, so that batches do not repeat one map
            extra["seed"] = int(explainer.options.get("seed") or 0) + first
        with first_logits(self.lm.model, _batch_len(inputs)) as got:
            with torch.set_grad_enabled(explainer.method.needs_grad):  # the others need no graph
                e = explainer(inputs, target, **extra)
        return e, got.get("logits")

    def _explainer(self, method: str) -> Any:
        """``explain`` with the model, method and the job's options resolved once per run
        (:class:`attnroll.explain.explainer.Prepared`), made on the first batch."""
        from ..explain.explainer import Prepared

        if method not in self._prepared:
            self._prepared[method] = Prepared(self.lm.model, method, tokenizer=self.lm.tokenizer,
                                              **self.job.options.get(method, {}))
        prepared = self._prepared[method]
        if self._keep is not None and "keep" not in prepared.memo:
            self._keep.enter_context(prepared.keep())
        return prepared

    def _text_table(self, method: str, items: list[Item], target: Any) -> Any:
        tok = self.lm.tokenizer
        texts = [it.text for it in items]
        pairs = [it.pair for it in items] if items[0].pair is not None else None
        joint = pairs is not None and self._has_logits()
        enc = tok(texts, pairs if joint else None, padding=True, truncation=True, return_tensors="pt")
        if pairs is not None and not joint:
            target = similarity_to(self.lm.model, tok, enc["attention_mask"], pairs)
        enc = {k: v.to(self.device) for k, v in enc.items()}
        e, logits = self._run(method, enc, target, items[0].index)
        return self._table(e, items, logits, enc["attention_mask"].sum(dim=1).tolist())

    def _has_logits(self) -> bool:
        if not hasattr(self, "_logits_known"):
            self._logits_known = has_class_scores(self.lm)
        return self._logits_known

    # ---------------------------------------------------------------------------------------------- rows
    def _table(self, e: Any, items: list[Item], logits: torch.Tensor | None, lengths: list[int] | None) -> Any:
        """The rows of one Explanation (store.row_schema), every value computed here, the Arrow table built
        when the batch is committed (``store.PendingRows``: in the local engine's writer thread, while the
        model runs the next batch)."""
        from ..explain.explanation import jsonable

        B, p = len(items), int(e.prefix)
        full = e.full_row.detach().to("cpu", torch.float32).numpy()
        lengths = [full.shape[1]] * B if lengths is None else [int(v) for v in lengths]
        targets = e.target if isinstance(e.target, list) else [e.target] * B
        labels = getattr(self.lm, "labels", {}) or {}
        is_class = [isinstance(t, int) and not isinstance(t, bool) for t in targets]
        pred, prob = _predictions(logits, B)
        tokens = None if e.tokens is None else [list(e.tokens[b][: lengths[b]]) for b in range(B)]
        same = store.repeated_column  # the columns every row of the Explanation shares, built once per run
        return store.PendingRows({
            "index": [it.index for it in items], "id": [it.id for it in items],
            "source": [it.source for it in items], "method": same(e.method, B, "method"),
            "options": same(json.dumps(jsonable(e.options), sort_keys=True), B, "options"),
            "target": [t if c else None for t, c in zip(targets, is_class)],
            "target_name": [labels.get(t) if c else (None if t is None else str(t)) for t, c in zip(targets, is_class)],
            "prediction": pred, "probability": prob,
            "grid": same(None if e.grid is None else tuple(int(g) for g in e.grid), B, "grid"),
            "tokens": same(None, B, "tokens") if e.tokens is None else tokens,
            "model": same(self.job.fingerprint, B, "model"),
        }, full, p, lengths)


def _ids(rows: Any) -> list[str]:
    """The ``id`` column of a row table (Arrow) or :class:`~attnroll.batch.store.PendingRows`."""
    if isinstance(rows, store.PendingRows):
        return list(rows.columns["id"])
    return rows.column("id").to_pylist()


def _stack(payloads: list[Any]) -> torch.Tensor | None:
    """The images' pixels (1, C, H, W) each, concatenated; None when there are none or they do not
    concatenate (then each group concatenates its own, and a failing one is explained input by input, as
    before)."""
    if not payloads:
        return None
    try:
        return torch.cat([p[1] for p in payloads])
    except (RuntimeError, TypeError, ValueError):
        return None


def _predictions(logits: torch.Tensor | None, B: int) -> tuple[list, list]:
    """Argmax class and its softmax probability per example (None without class scores)."""
    if logits is None:
        return [None] * B, [None] * B
    probs = torch.softmax(logits.detach().to("cpu", torch.float64), dim=-1)
    prob, pred = probs.max(dim=-1)
    return pred.tolist(), prob.tolist()


def _targets(items: list[Item], job_target: int | None) -> Any:
    """explain's ``target`` for a group: the job's class, the items' own classes, or None (predicted)."""
    if job_target is not None:
        return int(job_target)
    own = [it.target for it in items]
    return None if own[0] is None else [int(t) for t in own]


def _groups(items: list[Item], kind: str, job_target: int | None) -> Iterator[list[int]]:
    """Positions of the items explained in one call: the same pairing (texts) and target kind (own class
    or predicted), in source order within each group."""
    keys: dict[tuple, list[int]] = {}
    for k, it in enumerate(items):
        key = (kind == "text" and it.pair is not None, job_target is None and it.target is not None)
        keys.setdefault(key, []).append(k)
    yield from keys.values()


def _device_of(model: Any) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


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


def overlay_name(item_id: str, method: str) -> str:
    """The file name of an input's overlay in ``DIR/png/``: ``<safe id>.<method>.png``, where the safe id is
    the id itself when it is a plain lower-case file name, else its readable part and a hash
    (:func:`attnroll._names.safe_name`): never a folder, never outside ``DIR/png``, one file per id."""
    return f"{safe_name(item_id)}.{safe_name(method)}.png"


def write_overlay(out: Path, item_id: str, method: str, e: Any, b: int, img: Any) -> None:
    """``out/png/<overlay_name>``: the map of example ``b`` over its image (written atomically)."""
    from ..viz import overlay, save_image

    folder = out / "png"
    folder.mkdir(exist_ok=True)
    save_image(overlay(e, img, b), inside(folder, overlay_name(item_id, method)))


def _batch_len(inputs: Any) -> int:
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0])
    return int(inputs["input_ids"].shape[0])


@contextlib.contextmanager
def first_logits(model: torch.nn.Module, batch: int) -> Iterator[dict]:
    """Keep the class scores (batch, C) of the model's first forward pass with ``batch`` examples (the one
    ``explain`` captures), so that the prediction costs no second pass."""
    from ..capture.outputs import main_logits

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
    from ..capture.outputs import main_logits

    probe = lm.tokenizer(["a"], return_tensors="pt")
    with torch.no_grad():
        lg = main_logits(lm.model(**probe))
    return lg is not None and lg.ndim == 2


