"""RULER-style rows, and the cost and memory of context attribution at a given prompt length: needle (niah)
and variable-tracking (vt) prompts of about N tokens (gold answer); whether each method ranks a gold chunk
first, Recall@10 % (share of the gold chunks among the top 10 % of chunks), and time and peak memory beside
one forward + backward of prompt + answer, measured side by side in the same process.

    PYTHONPATH=src python -m benchmarks.context.ruler --cases niah:1024,vt:1024

Peak memory: the process's resident-set high-water mark (VmHWM), reset before each measurement by writing
5 to /proc/self/clear_refs; reported as the rise above the resident set just before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from . import methods, protocol
from .data import ruler_prompt


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def measured(fn) -> tuple[float, float]:
    """(seconds, peak MiB above the resident set before) of ``fn()``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kb("VmRSS:")
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, (_rss_kb("VmHWM:") - before) / 1024


def recall_at(scores: np.ndarray, gold: list[int], frac: float = 0.1) -> float:
    k = max(1, math.ceil(frac * len(scores)))
    top = set(np.argsort(-scores, kind="stable")[:k].tolist())
    return len(top & set(gold)) / len(gold)


def run_case(m, tok, task: str, tokens: int, names: list[str]) -> dict:
    item = ruler_prompt(tok, task, tokens, 0)
    row = {"task": task, "tokens": len(tok(item.prompt)["input_ids"]), "segments": len(item.segments),
           "gold": item.gold, "load_before": open("/proc/loadavg").read()[:15]}
    row["fwd_bwd_s"], row["fwd_bwd_mib"] = measured(lambda: protocol.fwd_bwd_seconds(m, tok, item))
    for name in names:
        box = {}
        if name == "last_attention":
            s, mib = measured(lambda: box.update(s=methods.last_layer_attention(m, tok, item)))
        else:
            s, mib = measured(lambda: box.update(methods.attnroll_pooled(m, tok, item, name)))
        for key, scores in box.items():
            key = name if key == "s" else key
            row[key] = {"hit1": int(np.argmax(scores)) in item.gold, "recall10": recall_at(scores, item.gold),
                        "seconds": s, "peak_mib": mib, "cost": s / row["fwd_bwd_s"]}
    row["load_after"] = open("/proc/loadavg").read()[:15]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="niah:1024,vt:1024")
    ap.add_argument("--methods", default="attn_grad,gae,rollout,last_attention")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ruler.json"))
    args = ap.parse_args(argv)
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    rows = []
    for case in args.cases.split(","):
        task, n = case.split(":")
        rows.append(run_case(lm.model, lm.tokenizer, task, int(n), args.methods.split(",")))
        print(json.dumps(rows[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
