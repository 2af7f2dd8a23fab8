"""Markdown table of a results JSON written by ``run``: per method the share of prompts whose top segment is
LOO's top, mean Spearman with the LOO drops, mean top-k log-prob drops, mean LDS, median cost.

    PYTHONPATH=src python -m benchmarks.context.summarize benchmarks/context/results/qa_heldout*.json
"""

from __future__ import annotations

import json
import sys

import numpy as np


def load(paths: list[str]) -> list[dict]:
    """The prompts of one or more result files (e.g. one split run in parts with ``--start``)."""
    return [it for p in paths for it in json.load(open(p))["items"]]


def summary(paths: list[str]) -> list[dict]:
    """One dict per method with its mean figures over the prompts it ran on."""
    items = load(paths)
    names = list(dict.fromkeys(k for it in items for k in it["methods"]))
    out = []
    for name in names:
        rs = [it["methods"][name] for it in items if name in it["methods"]]
        out.append({"method": name, "n": len(rs), "top1": sum(r["top1"] for r in rs),
                    "gold_top1": sum(r["gold_top1"] for r in rs),
                    **{k: float(np.mean([r[k] for r in rs])) for k in ("spearman", "drop1", "drop3", "drop5",
                                                                      "lds")},
                    "cost": float(np.median([r["cost"] for r in rs]))})
    return out


def table(paths: list[str]) -> str:
    items = load(paths)
    loo_gold = sum(int(np.argmax(it["loo"])) in it["gold"] for it in items)
    fb, lc = np.median([it["fwd_bwd_s"] for it in items]), np.median([it["loo_cost"] for it in items])
    lines = [f"{len(items)} prompts; LOO's top segment is the gold passage in {loo_gold}; median fwd+bwd "
             f"{fb:.1f} s; LOO cost {lc:.1f}; "
             f"load {', '.join(' '.join(it['loadavg']) for it in items)}",
             "| method | top-1 = LOO | Spearman | drop k=1 | k=3 | k=5 | LDS | top-1 = gold | cost |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary(paths):
        lines.append(f"| {r['method']} | {r['top1']}/{r['n']} | {r['spearman']:.2f} | {r['drop1']:.2f} | "
                     f"{r['drop3']:.2f} | {r['drop5']:.2f} | {r['lds']:.2f} | {r['gold_top1']}/{r['n']} | "
                     f"{r['cost']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
