"""Run peer tools (FlashTrace, AT2, and the protocol's baselines) on QA prompts, in run.py's JSON format: per
prompt the LOO drops, each peer's scores per passage, top-k drops, LDS, and cost over a forward + backward
timed alongside (with the load), so any attnroll method run later on the same prompts can be compared.

    PYTHONPATH=src python -m benchmarks.context.peer_run --split heldout-b --count 10 \\
        --methods flashtrace,last_attention,attntrace_B30 --out benchmarks/context/results/peers_heldout-b_ft.json
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager

import torch

from . import peer_at2, peers, run
from .data import SPLITS, qa_set

#: Peers run here on top of run.py's table: name -> fn(model, tok, item) returning passage scores.
PEER_TABLE = {
    "flashtrace": lambda m, t, it: peers.flashtrace(m, t, it, hops=1),
    "at2": lambda m, t, it: peer_at2.scores(m, t, it, AT2_WEIGHTS[0]),  # weights from --at2-weights
}
AT2_WEIGHTS: list = [None]


@contextmanager
def with_peers(extra: dict):
    """run.py's method table extended with ``extra`` while the block runs."""
    base = run.method_table

    def table(names):
        return {**base(names), **{k: v for k, v in extra.items() if k in names}}

    run.method_table = table
    try:
        yield
    finally:
        run.method_table = base


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=tuple(SPLITS), default="heldout-b")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--passages", type=int, default=16)
    ap.add_argument("--methods", default="flashtrace,last_attention,attntrace_B30")
    ap.add_argument("--lds", type=int, default=16, help="held-out random 50%% ablations for LDS")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reuse", default=None, help="a results JSON whose rows of the same prompts give the LOO")
    ap.add_argument("--at2-weights", default=None, help="AT2 estimator weights saved by peer_at2 (for 'at2')")
    args = ap.parse_args(argv)
    if "at2" in args.methods.split(","):
        if not args.at2_weights:
            raise SystemExit("method 'at2' needs --at2-weights (a file written by benchmarks.context.peer_at2)")
        AT2_WEIGHTS[0] = torch.load(args.at2_weights)["weights"].numpy().astype(float)
    torch.set_num_threads(1)
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    names, run.LDS[0] = args.methods.split(","), args.lds
    unknown = [n for n in names if n not in PEER_TABLE and n not in run.method_table(names)]
    if unknown:
        raise SystemExit(f"unknown peer(s) {unknown}; expected names among {sorted(PEER_TABLE)} or run.py's table")
    items = qa_set(lm.tokenizer, args.split, args.start + args.count, args.passages)[args.start:]
    stored = json.load(open(args.reuse))["items"] if args.reuse else []
    rows = []
    with with_peers(PEER_TABLE):
        for i, item in enumerate(items):
            old = next((r for r in stored if run.same_prompt(r, item)), None)
            old = {**old, "methods": {}} if old else None  # its LOO only
            rows.append(run.run_item(lm.model, lm.tokenizer, item, names, True, old, top5=False))
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"split": args.split, "start": args.start, "methods": names, "items": rows}, f)
            print(args.start + i, item.meta, {k: (v["top1"], round(v["drop1"], 2), round(v["cost"], 1))
                                              for k, v in rows[-1]["methods"].items()}, flush=True)


if __name__ == "__main__":
    main()
