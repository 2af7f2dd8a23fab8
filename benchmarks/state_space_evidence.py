"""Is composing the token mixers worth it? The full-stack map against the attention-only map and random, on the
trained state-space classifiers whose evidence is known (``bamba-evidence``: attention + Mamba-2;
``mamba2-evidence``: Mamba-2 only; :mod:`attnroll.models.state_space`).

- full stack: ``attnroll evaluate``'s own maps (``explain``: every Mamba-2 mixer composed as its layer's matrix);
- attention only: the same method on the captured record's attention layers alone (the mixer layers left out,
  as if they passed every token straight through); rollout, raw (the last attention layer) and flow;
- random: the ``random`` control.

All maps keep attention sinks (``sinks="keep"``) so that both maps are read the same way; the metrics are those
of ``attnroll evaluate`` on text with evidence masks (comprehensiveness = deletion, sufficiency, evidence mass,
pointing, top-k F1), on ``make_examples(n, TEST_SEED)``.

The mixers' convolution enters their layers as ``--convolution`` says (``capture.mixers.CONVOLUTION``: "apart",
the default, or "folded"); ``--seed`` draws other sentences (validation: 777; the held-out test seed is the default).

Run: ``PYTHONPATH=src python benchmarks/state_space_evidence.py [--n 200] [--model bamba-evidence]
[--convolution apart|folded] [--seed S]``. Prints one markdown table per model.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import torch

import attnroll
from attnroll.capture import mixers
from attnroll.core import mixers as core_mixers
from attnroll.core.flow import attention_flow
from attnroll.core.rollout import rollout
from attnroll.evaluate import evaluate_methods
from attnroll.models import evidence, load_model, state_space

METHODS = ("rollout", "raw", "flow")


def attention_layers(model: Any) -> list[int]:
    """Indices of the softmax-attention layers among the model's layers (Bamba: ``attn_layer_indices``)."""
    return list(getattr(model.config, "attn_layer_indices", None) or [])


def record_maps(model: Any, inputs: dict, layers: list[int] | None, method: str, batch: int = 50) -> torch.Tensor:
    """(B, n) map of ``method`` at the last real token from the captured record's layers ``layers`` (None = all),
    special tokens and padding zeroed."""
    ids, am = inputs["input_ids"], inputs["attention_mask"]
    out = torch.zeros(ids.shape, dtype=torch.float64)
    for s in range(0, ids.shape[0], batch):
        x = {"input_ids": ids[s:s + batch], "attention_mask": am[s:s + batch]}
        streams = attnroll.capture(model, x).streams["self"]
        att = [streams[i].to(torch.float64) for i in (range(len(streams)) if layers is None else layers)]
        last = x["attention_mask"].sum(1) - 1
        for b in range(x["input_ids"].shape[0]):
            one = [a[b:b + 1] for a in att]
            mask = x["attention_mask"][b:b + 1]
            t = int(last[b])
            if method == "rollout":
                row = rollout(one, attention_mask=mask)[0, t]
            elif method == "raw":
                row = one[-1][0].mean(0)[t]
            else:
                row = attention_flow(one, rows=[t], attention_mask=mask)[0, 0]
            out[s + b] = row
    return out * (am.bool() & ~inputs["special_tokens_mask"].bool())


def evaluate(name: str, n: int, folder: str | None = None, seed: int = evidence.TEST_SEED) -> tuple[Any, Any, dict]:
    """(full-stack EvaluationResult, attention-only EvaluationResult or None, facts) for model ``name`` (its
    weights from ``folder``, default the shipped ones) on ``make_examples(n, seed)``."""
    lm = load_model(name)
    if folder is not None:
        lm.model, lm.tokenizer = state_space.load_state_space_model(name, folder)
    ex = evidence.make_examples(n, seed)
    enc, masks = evidence.encode(lm.tokenizer, ex)
    keep = {m: {"sinks": "keep"} for m in METHODS}
    full = evaluate_methods(lm.model, enc, [*METHODS, "random"], labels=ex.labels, masks=masks,
                            method_options=keep)
    attn = attention_layers(lm.model)
    facts = {"accuracy": full.accuracy, "attention_layers": attn}
    if not attn:
        return full, None, facts
    given = {m: record_maps(lm.model, enc, attn, m) for m in METHODS}
    only = evaluate_methods(lm.model, enc, list(METHODS), labels=ex.labels, masks=masks, maps=given)
    # the record read back through core rollout over every layer gives evaluate's own full-stack map
    check = record_maps(lm.model, enc, None, "rollout")
    ref = explain_rollout(lm.model, enc)
    facts["full_stack_matches_record"] = float((check - ref).abs().max())
    facts["paired"] = paired(full, only)
    return full, only, facts


def paired(full: Any, only: Any) -> dict[str, str]:
    """Per method and metric: the mean of (full stack − attention only) over the same sentences ± its standard
    error (the sign of a better full stack: + where higher is better)."""
    out = {}
    for m in METHODS:
        for k in ("comprehensiveness", "evidence_pointing"):
            d = full.per_example[m][k] - only.per_example[m][k]
            d = d[np.isfinite(d)]
            out[f"{m}.{k}"] = f"{d.mean():+.3f} ± {d.std(ddof=1) / np.sqrt(d.size):.3f}"
    return out


def explain_rollout(model: Any, enc: dict) -> torch.Tensor:
    x = {k: v for k, v in enc.items() if k != "special_tokens_mask"}
    e = attnroll.explain(model, x, method="rollout", sinks="keep")
    return e.full_row.to(torch.float64) * (enc["attention_mask"].bool() & ~enc["special_tokens_mask"].bool())


def table(full: Any, only: Any) -> str:
    """Markdown: one row per (map, method), mean ± standard error per metric; chance last."""
    metrics = full.metrics
    lines = ["| map | " + " | ".join(full.heading(k) for k in metrics) + " |",
             "|---|" + "---|" * len(metrics)]
    for m in METHODS:
        lines.append(f"| {m}, full stack | " + " | ".join(full.cell(m, k) for k in metrics) + " |")
        if only is not None:
            lines.append(f"| {m}, attention only | " + " | ".join(only.cell(m, k) for k in metrics) + " |")
    lines.append("| random | " + " | ".join(full.cell("random", k) for k in metrics) + " |")
    lines.append("| chance (m / N) | " + " | ".join(f"{full.chance[k]:.3f}" if k in full.chance else ""
                                                    for k in metrics) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200, help="held-out sentences")
    p.add_argument("--model", action="append", choices=["bamba-evidence", "mamba2-evidence"],
                   help="model (repeatable; default both)")
    p.add_argument("--weights", default=None, help="a folder of weights to use instead of the shipped ones")
    p.add_argument("--convolution", choices=core_mixers.CONVOLUTIONS, default="apart",
                   help="how a mixer's convolution enters its layer (capture.mixers.CONVOLUTION)")
    p.add_argument("--seed", type=int, default=evidence.TEST_SEED, help="seed of the sentences (validation: 777)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    mixers.CONVOLUTION = args.convolution
    for name in args.model or ["bamba-evidence", "mamba2-evidence"]:
        full, only, facts = evaluate(name, args.n, args.weights, args.seed)
        print(f"\n{name} (convolution {args.convolution}, seed {args.seed}): {facts}\n")
        print(table(full, only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
