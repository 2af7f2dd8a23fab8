"""Time and peak memory of context attribution at a given prompt length, side by side with one forward +
backward of prompt + answer (RULER needle prompts of about N tokens, gold answer).

    PYTHONPATH=src python -m benchmarks.context.cost --tokens 512,1024 --methods attn_grad,gae,rollout

Peak memory: the process's resident-set high-water mark (VmHWM), reset before each measurement by writing
5 to /proc/self/clear_refs; reported as the rise above the resident set just before.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from attnroll import context_attribution

from . import protocol
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,1024")
    ap.add_argument("--methods", default="attn_grad,gae,rollout")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cost.json"))
    args = ap.parse_args(argv)
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    m, tok = lm.model, lm.tokenizer
    rows = []
    for n in [int(x) for x in args.tokens.split(",")]:
        item = ruler_prompt(tok, "niah", n, 0)
        row = {"tokens": len(tok(item.prompt)["input_ids"]), "load_before": open("/proc/loadavg").read()[:15]}
        row["fwd_bwd_s"], row["fwd_bwd_mib"] = measured(lambda: protocol.fwd_bwd_seconds(m, tok, item))
        for meth in args.methods.split(","):
            s, mib = measured(lambda: context_attribution(m, tok, item.prompt, answer=item.answer,
                                                          segments=item.segments, method=meth))
            row[meth] = {"seconds": s, "peak_mib": mib, "cost": s / row["fwd_bwd_s"]}
        row["load_after"] = open("/proc/loadavg").read()[:15]
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
