"""Peak memory of context attribution on SmolLM2-135M-Instruct against the plain forward + backward, one
fresh process per (what, length), so no measurement inherits memory another one left resident.

    PYTHONPATH=src python -m benchmarks.context.memory --lengths 1024,2048,4096

Each child loads the model, builds the needle prompt of about N tokens (``data.ruler_prompt``), resets the
resident-set high-water mark (writes 5 to /proc/self/clear_refs), runs one thing and reports the rise of
VmHWM above the resident set just before (the model's own weights excluded), with the process's
``ru_maxrss`` beside it (weights and loading included). "fwd_bwd": one forward + backward of prompt + answer
with log p(answer) as the target (``protocol.fwd_bwd_seconds``); a method name: one ``context_attribution``
call with that method (``methods.attnroll_pooled``). One torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys


def child(what: str, tokens: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from attnroll.models import load_model

    from . import methods, protocol, ruler
    from .data import ruler_prompt

    lm = load_model("smollm2-135m-instruct")
    item = ruler_prompt(lm.tokenizer, "niah", tokens, 0)
    n = len(lm.tokenizer(item.prompt)["input_ids"])
    impl = getattr(lm.model.config, "_attn_implementation", None)
    if what == "fwd_bwd":
        s, mib = ruler.measured(lambda: protocol.fwd_bwd_seconds(lm.model, lm.tokenizer, item))
    else:
        s, mib = ruler.measured(lambda: methods.attnroll_pooled(lm.model, lm.tokenizer, item, what))
    return {"what": what, "tokens": n, "attn_implementation": impl, "seconds": s, "peak_mib": mib,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--what", default="fwd_bwd,attn_grad")
    ap.add_argument("--one", nargs=2, metavar=("WHAT", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory.json"))
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(child(args.one[0], int(args.one[1]))), flush=True)
        return
    rows = []
    for n in args.lengths.split(","):
        for what in args.what.split(","):
            load = open("/proc/loadavg").read()[:15]
            out = subprocess.run([sys.executable, "-m", "benchmarks.context.memory", "--one", what, n],
                                 check=True, capture_output=True, text=True).stdout
            rows.append({**json.loads(out.strip().splitlines()[-1]), "load_before": load})
            print(json.dumps(rows[-1]), flush=True)
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
