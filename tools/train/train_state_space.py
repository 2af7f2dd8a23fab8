"""Train the small state-space classifiers of :mod:`attnroll.models.state_space` from scratch on the evidence
sentences: ``--model bamba-evidence`` (attention + Mamba-2 hybrid) or ``--model mamba2-evidence`` (pure Mamba-2).

Data: ``make_examples(--train-size, seed=--data-seed)`` of :mod:`attnroll.models.evidence`, minus every sentence
that also occurs in the held-out test set (``make_examples(--test-size, TEST_SEED)``), one word per token with
``[END]`` appended; seeded batch order. The test set is scored once, after training; nothing is chosen on it.

Deterministic: torch seeded, ``torch.use_deterministic_algorithms(True)``, ``--threads`` CPU threads (1).
Writes ``model.safetensors`` (float32), ``vocab.json`` and ``MODEL_CARD.md`` into ``--out`` (default the model's
folder in the package).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnroll.models import evidence
from attnroll.models import state_space as ss


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python tools/train/train_state_space.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(ss.MODELS), required=True)
    p.add_argument("--out", type=Path, default=None, help="output folder (default: the model's package folder)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    p.add_argument("--data-seed", type=int, default=1, help="seed of the training sentences")
    p.add_argument("--train-size", type=int, default=20000, help="training sentences generated")
    p.add_argument("--test-size", type=int, default=2000, help="held-out test sentences (seed TEST_SEED)")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warm-up 5%%, linear decay)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    return p.parse_args(argv)


def training_set(args: argparse.Namespace) -> evidence.EvidenceExamples:
    """``make_examples(train_size, data_seed)`` without any sentence of the test set."""
    test = set(evidence.make_examples(args.test_size, evidence.TEST_SEED).texts)
    ex = evidence.make_examples(args.train_size, args.data_seed)
    keep = [i for i, t in enumerate(ex.texts) if t not in test]
    return evidence.EvidenceExamples([ex.words[i] for i in keep], ex.labels[keep], [ex.evidence[i] for i in keep],
                                     ex.negated[keep], ex.distractors[keep])


def _batch(tok: Any, words: list[list[str]]) -> dict[str, torch.Tensor]:
    enc = tok(words, is_split_into_words=True, padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def train(model: Any, tok: Any, data: evidence.EvidenceExamples, args: argparse.Namespace) -> list[float]:
    """AdamW (weight decay 0.01, clipping at norm 1), linear warm-up then decay; returns the mean loss per 100
    steps."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (args.steps - s) / max(1, args.steps - warm))))
    labels = torch.as_tensor(data.labels)
    model.train()
    losses, run = [], []
    for step in range(args.steps):
        idx = torch.randint(len(data), (args.batch_size,), generator=gen)
        logits = model(**_batch(tok, [data.words[i] for i in idx])).logits
        loss = torch.nn.functional.cross_entropy(logits, labels[idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        run.append(float(loss.detach()))
        if (step + 1) % 100 == 0:
            losses.append(float(np.mean(run)))
            run = []
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    return losses


def predict(model: Any, tok: Any, ex: evidence.EvidenceExamples, batch: int = 250) -> np.ndarray:
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(ex), batch):
            out.append(model(**_batch(tok, ex.words[i:i + batch])).logits.argmax(1).numpy())
    return np.concatenate(out)


def accuracy_table(pred: np.ndarray, ex: evidence.EvidenceExamples) -> list[tuple[str, float, int]]:
    ok = pred == ex.labels
    neg_distractor = np.array([any(w in evidence.NEGATORS for w, f in zip(ws, fl) if not f)
                               for ws, fl in zip(ex.words, ex.evidence)])
    rows = [("all", np.ones_like(ok)), ("main clause negated", ex.negated), ("not negated", ~ex.negated),
            ("a distractor holds a negator", neg_distractor)]
    rows += [(f"{d} distractor clause{'s' if d != 1 else ''}", ex.distractors == d) for d in range(4)]
    return [(name, float(ok[sel].mean()), int(sel.sum())) for name, sel in rows]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    out = args.out or ss.model_dir(args.model)
    out.mkdir(parents=True, exist_ok=True)
    vocab = ss.vocabulary()
    tok = ss.word_tokenizer(vocab)
    model = ss.build_model(ss.MODELS[args.model][1], len(vocab))
    data = training_set(args)
    t0, c0 = time.perf_counter(), time.process_time()
    losses = train(model, tok, data, args)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "vocab.json").write_text(json.dumps(vocab) + "\n")
    loaded, tok2 = ss.load_state_space_model(args.model, out)
    test = evidence.make_examples(args.test_size, evidence.TEST_SEED)
    table = accuracy_table(predict(loaded, tok2, test), test)
    for name, acc, n in table:
        print(f"{name}: {acc:.4f} ({n})")
    _card(out, args, len(data), loaded, table, losses, wall, cpu)
    return 0


def _card(out: Path, args: argparse.Namespace, n_train: int, model: Any, table: list, losses: list[float],
          wall: float, cpu: float) -> None:
    """Write MODEL_CARD.md from the template beside this script, filled with this run's facts."""
    size = (out / "model.safetensors").stat().st_size
    n_params = sum(p.numel() for p in model.parameters())
    rows = "\n".join(f"| {name} | {n} | {acc:.4f} |" for name, acc, n in table)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    template = (Path(__file__).with_name("state_space_card.md")).read_text()
    text = template.format(
        name=args.model, arch=type(model).__mro__[2].__name__, kind=ss.MODELS[args.model][1], params=n_params,
        size_kb=size / 1024, steps=args.steps, batch=args.batch_size, lr=args.lr, n_train=n_train,
        train_size=args.train_size, data_seed=args.data_seed, seed=args.seed, threads=args.threads,
        test_size=args.test_size, test_seed=evidence.TEST_SEED, rows=rows, wall=wall, cpu=cpu, load=load,
        losses=", ".join(f"{100 * (i + 1)}: {v:.3f}" for i, v in enumerate(losses)), machine=platform.machine(),
        python=platform.python_version(), torch=torch.__version__, layers=_layers(model))
    (out / "MODEL_CARD.md").write_text(text)


def _layers(model: Any) -> str:
    cfg = model.config
    if getattr(cfg, "model_type", "") == "bamba":
        kinds = ["attention" if i in cfg.attn_layer_indices else "Mamba-2" for i in range(cfg.num_hidden_layers)]
        return ", ".join(f"{i}: {k}" for i, k in enumerate(kinds))
    return ", ".join(f"{i}: Mamba-2" for i in range(cfg.num_hidden_layers))


if __name__ == "__main__":
    sys.exit(main())
