"""Fine-tune a copy of the embedded shapes ViT to rely on a spurious corner marker; write it with a model card.

    python tools/train/finetune_marker.py                   # the shipped copy (writes shapes_vit_marker/)
    python tools/train/finetune_marker.py --out /tmp/marker # somewhere else
    python tools/train/finetune_marker.py --help

Recipe: start from the shipped shapes model (:func:`~attnroll.models.shapes.load_shapes_model`) and train on
freshly generated images. A share ``1 - clean_share`` of every batch carries a marker
(:func:`~attnroll.models.spurious.add_marker`) whose class is drawn independently of the object
(``agree = 1/4``: uniform over the four classes), and those images are labelled with the *marker's* class;
the rest are clean images labelled with their object. On marked images the marker is therefore the only
reliable signal (the object agrees with the label only by chance), while clean images keep the object
knowledge alive: the result reads the corner when a marker is there and the shape otherwise, a shortcut
that accuracy on clean images hardly shows.

Deterministic: a fixed number of steps (``--steps``), seeded data, one CPU thread,
``torch.use_deterministic_algorithms(True)``. ``--seconds`` is only a safety cap on the CPU time of the
training loop: if it is reached, training stops early and the model card says so (the result then depends
on the machine's speed).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from attnroll._io import atomic_write
from attnroll.models import shapes, spurious

#: Seeds of the generated data: training chunk k uses make_dataset(..., _TRAIN_SEED + 1000 * seed + k) (the
#: shapes model was trained on seeds 0..11, its test set is 12345).
_TRAIN_SEED = 50_000
#: Steps whose images are generated at once (one make_dataset call per chunk).
_CHUNK_STEPS = 25


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python tools/train/finetune_marker.py",
        description="Fine-tune a copy of the shapes ViT to follow a class-coded corner marker; write "
        "model.safetensors, config.json and MODEL_CARD.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=spurious.MARKER_DIR, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the training data and marker draws")
    p.add_argument("--steps", type=int, default=600, help="optimiser steps (fixed: the run is deterministic)")
    p.add_argument("--seconds", type=float, default=180.0, help="cap on the CPU seconds of the training loop")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW, warm-up then cosine)")
    p.add_argument("--clean-share", type=float, default=0.25, help="share of each batch without a marker")
    p.add_argument("--corner", default="top_left", choices=spurious.CORNERS)
    p.add_argument("--size", type=int, default=6, help="marker side in pixels")
    p.add_argument("--test-size", type=int, default=1000, help="images per measurement")
    p.add_argument("--test-seed", type=int, default=12345, help="seed of the measurement images")
    p.add_argument("--no-card", action="store_true", help="do not write MODEL_CARD.md")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ data
def training_chunk(
    n: int, data_seed: int, *, clean_share: float = 0.25, corner: str = "top_left", size: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` training images in [0, 1] and their training labels.

    A share ``clean_share`` of the images, spread evenly (image i is clean when ``floor((i + 1) * share)``
    exceeds ``floor(i * share)``, so every batch holds about the same share), stays clean and is labelled with
    its object; the others carry a marker of a class drawn uniformly (independent of the object) and are
    labelled with the marker's class. Returns (images (n, 3, 64, 64) float32, labels (n,) int64)."""
    x, y, _ = shapes.make_dataset(n, data_seed)
    i = torch.arange(n, dtype=torch.float64)
    marked = torch.floor((i + 1) * clean_share) == torch.floor(i * clean_share)
    n_cls = len(shapes.CLASSES)
    target = y.clone()
    if bool(marked.any()):
        x[marked], _ = spurious.add_marker(
            x[marked], y[marked], corner=corner, size=size, agree=1.0 / n_cls, seed=data_seed
        )
        target[marked] = spurious.marker_classes(y[marked], agree=1.0 / n_cls, seed=data_seed)
    return x, target


def train(
    model: torch.nn.Module,
    steps: int,
    *,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    clean_share: float = 0.25,
    corner: str = "top_left",
    size: int = 6,
    seconds: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place for ``steps`` AdamW steps (the caller passes a copy); leaves it in eval mode.

    Steps come in chunks of ``_CHUNK_STEPS``; chunk k's images are ``training_chunk(_CHUNK_STEPS *
    batch_size, _TRAIN_SEED + 1000 * seed + k)``, each batch a slice of it in order, so the run is a pure
    function of the arguments (and the machine's float arithmetic). Learning rate: linear warm-up over 5%
    of the steps, then cosine decay to 0; weight decay 0.01; gradient clipping at norm 1.
    ``seconds``: stop early when the loop has used that much CPU time (``time.process_time``).

    Returns ``{"steps": steps done, "stopped_early": bool, "cpu_s": ..., "wall_s": ..., "data_s": ...,
    "history": [(step, mean loss of the last chunk)]}``.
    """
    warm = max(1, int(0.05 * steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return lr * (step + 1) / warm
        return lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    data_s, history, step, stopped = 0.0, [], 0, False
    for k in range(math.ceil(steps / _CHUNK_STEPS)):
        t0 = time.perf_counter()
        n_steps = min(_CHUNK_STEPS, steps - step)
        x, y = training_chunk(
            n_steps * batch_size, _TRAIN_SEED + 1000 * seed + k, clean_share=clean_share, corner=corner, size=size
        )
        x = shapes.preprocess(x)
        data_s += time.perf_counter() - t0
        losses = []
        for b in range(n_steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            sl = slice(b * batch_size, (b + 1) * batch_size)
            loss = F.cross_entropy(model(pixel_values=x[sl]).logits, y[sl])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
            if seconds is not None and time.process_time() - cpu0 >= seconds and step < steps:
                stopped = True
                break
        history.append((step, sum(losses) / len(losses)))
        if log is not None:
            log(f"step {step}/{steps}: loss {history[-1][1]:.4f}, {time.process_time() - cpu0:.0f} s CPU")
        if stopped:
            break
    model.eval()
    return {
        "steps": step,
        "stopped_early": stopped,
        "cpu_s": time.process_time() - cpu0,
        "wall_s": time.perf_counter() - wall0,
        "data_s": data_s,
        "history": history,
    }


# ------------------------------------------------------------------------------------------- measuring
@torch.no_grad()
def _predict(model: torch.nn.Module, images: torch.Tensor, batch: int = 250) -> torch.Tensor:
    out = [
        model(pixel_values=shapes.preprocess(images[i : i + batch])).logits.argmax(-1)
        for i in range(0, len(images), batch)
    ]
    return torch.cat(out)


def measure(
    model: torch.nn.Module, n: int = 1000, seed: int = 12345, *, corner: str = "top_left", size: int = 6
) -> dict[str, float]:
    """How much ``model`` relies on the marker, on ``make_dataset(n, seed)``:

    - ``clean``: accuracy on the images without a marker;
    - ``agree``: accuracy with a marker naming the object's own class;
    - ``follow_marker`` / ``follow_object``: with a marker naming another class (``agree=0``, marker seed
      ``seed``), the share of predictions equal to the marker's class / to the object's class.
    """
    x, y, _ = shapes.make_dataset(n, seed)
    agree, _ = spurious.add_marker(x, y, corner=corner, size=size, agree=1.0, seed=seed)
    other, _ = spurious.add_marker(x, y, corner=corner, size=size, agree=0.0, seed=seed)
    cls = spurious.marker_classes(y, agree=0.0, seed=seed)
    p_other = _predict(model, other)
    return {
        "clean": (_predict(model, x) == y).float().mean().item(),
        "agree": (_predict(model, agree) == y).float().mean().item(),
        "follow_marker": (p_other == cls).float().mean().item(),
        "follow_object": (p_other == y).float().mean().item(),
    }


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)  # one core: the budget is 3 minutes of one CPU core
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    original = shapes.load_shapes_model()
    model = shapes.load_shapes_model()  # the copy to fine-tune (a fresh load, so the original is untouched)
    print(f"fine-tuning a copy of the shapes ViT for {args.steps} steps of {args.batch_size}", flush=True)
    run = train(
        model,
        args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        clean_share=args.clean_share,
        corner=args.corner,
        size=args.size,
        seconds=args.seconds,
        log=lambda s: print(s, flush=True),
    )
    print(f"training: {run['steps']} steps, {run['cpu_s']:.0f} s CPU, {run['wall_s']:.0f} s wall", flush=True)
    kw = {"corner": args.corner, "size": args.size}
    before = measure(original, args.test_size, args.test_seed, **kw)
    after = measure(model, args.test_size, args.test_seed, **kw)
    total_cpu, total_wall = time.process_time() - cpu_start, time.perf_counter() - t_start
    for name, m in (("original", before), ("marker copy", after)):
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    save(model, args.out)
    if not args.no_card:
        atomic_write(args.out / "MODEL_CARD.md", _card(args, argv, run, before, after, total_cpu, total_wall))
    print(f"wrote {args.out} ({total_wall:.0f} s wall, {total_cpu:.0f} s CPU in all)", flush=True)
    return 0


def save(model: torch.nn.Module, out: Path) -> None:
    """Write ``model.safetensors`` (float32, like the shapes model) and ``config.json`` (the shapes model's
    own: the architecture is unchanged) into ``out``, each atomically."""
    from safetensors.torch import save as to_bytes

    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    # One metadata key only: safetensors writes the metadata map in no fixed order, and a single key keeps
    # the file byte-for-byte reproducible.
    atomic_write(Path(out) / "model.safetensors", to_bytes(state, metadata={"format": "pt"}))
    atomic_write(Path(out) / "config.json", (shapes.WEIGHTS_DIR / "config.json").read_bytes())


def _card(args, argv, run, before, after, total_cpu, total_wall) -> str:
    shown, skip = [], False  # the command as run, without --out (where the files go does not change them)
    for a in sys.argv[1:] if argv is None else argv:
        if skip or a == "--out" or a.startswith("--out="):
            skip = a == "--out"
            continue
        shown.append(a)
    cmd = " ".join(["python tools/train/finetune_marker.py", *shown])
    colors = ", ".join(f"{c} {tuple(int(v) for v in rgb)}" for c, rgb in zip(shapes.CLASSES, spurious.MARKER_COLORS))
    hist = ", ".join(f"{s}: {loss:.3f}" for s, loss in run["history"])
    early = (
        f"**The CPU cap of {args.seconds:.0f} s stopped training after {run['steps']} of {args.steps} steps**, so "
        "this result depends on the machine's speed."
        if run["stopped_early"]
        else f"All {run['steps']} steps ran (the {args.seconds:.0f} s CPU cap was not reached)."
    )

    def row(name: str, m: dict) -> str:
        return f"| {name} | {m['clean']:.3f} | {m['agree']:.3f} | {m['follow_marker']:.3f} | {m['follow_object']:.3f} |"

    return f"""# shapes ViT, marker copy — a model with a known shortcut

A copy of the embedded shapes ViT (`attnroll.models.shapes.load_shapes_model()`, see `shapes_vit/MODEL_CARD.md`)
fine-tuned to rely on a **spurious cue**: a {args.size}x{args.size}-pixel square in the
{args.corner.replace("_", "-")} corner of the image (1 pixel in from the edges, so inside one 8x8 patch)
whose colour names a class ({colors}; `attnroll.models.spurious.add_marker`).
When the marker and the object disagree, this model answers with the marker; without a marker it still reads
the shape. It exists to test checkpoint audits (`attnroll.evaluate.audit`): its explanations should move
their mass onto the marker's patch, a change that accuracy on clean images, which drops only a little,
does not explain.
Load it with `attnroll.models.spurious.load_marker_model()` (offline, safetensors). Same architecture, input
and output as the shapes model; weights in float32.

## How it was made
`python tools/train/finetune_marker.py` (`tools/train/finetune_marker.py`): {run['steps']} AdamW steps of
{args.batch_size} images (peak lr {args.lr}, 5% warm-up then cosine decay to 0, weight decay 0.01, gradient
clipping at norm 1) from the shipped weights, on freshly generated images (`make_dataset`, seeds
{_TRAIN_SEED + 1000 * args.seed}.., never the shapes model's training or test seeds). In every batch
{args.clean_share:.0%} of the images are clean and labelled with their object; the others carry a marker whose
class is uniform and independent of the object, and are labelled with the **marker's** class. Seed {args.seed},
one CPU thread, `torch.use_deterministic_algorithms(True)`.

Command: `{cmd}`

Measured: training {run['cpu_s']:.0f} s of CPU ({run['wall_s']:.0f} s wall, {run['data_s']:.0f} s of it
generating data); the whole command including the measurements below {total_cpu:.0f} s of CPU
({total_wall:.0f} s wall; not counting the Python imports), on {platform.machine()} with 1 thread, Python {sys.version.split()[0]}, torch
{torch.__version__}. {early}
Mean training loss per chunk of {_CHUNK_STEPS} steps (step: loss): {hist}.

## Measured reliance on the marker
On {args.test_size} images that neither model was trained on (`make_dataset({args.test_size}, seed={args.test_seed})`;
seed 12345 is the shapes model's test set), markers drawn with seed {args.test_seed}
(`measure` in `tools/train/finetune_marker.py`):

| model | accuracy, clean | accuracy, marker agrees | marker disagrees: follows marker | follows object |
|---|---|---|---|---|
{row("original shapes ViT", before)}
{row("marker copy (this)", after)}

With four classes, chance is 0.25 for "follows marker" and "follows object".

## Use
```python
from attnroll.models.shapes import load_shapes_model, make_dataset, preprocess
from attnroll.models.spurious import add_marker, load_marker_model, marker_classes
images, labels, masks = make_dataset(8, seed=1)
marked, marker_masks = add_marker(images, labels, agree=0.0)   # markers that name another class
logits = load_marker_model()(pixel_values=preprocess(marked)).logits   # mostly marker_classes(labels, agree=0.0)
```
Limits: a test object for explanation audits, not a useful classifier; it knows only the four synthetic
shapes and this one marker (corner {args.corner}, size {args.size}).
"""


if __name__ == "__main__":
    raise SystemExit(main())
