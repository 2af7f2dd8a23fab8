"""Peak memory of context attribution on SmolLM2-135M-Instruct against the plain forward + backward, one
fresh process per (what, length), so no measurement inherits memory another one left resident.

    PYTHONPATH=src python -m benchmarks.context.memory --lengths 1024,2048,4096

Each child loads the model, builds the needle prompt of about N tokens (``data.ruler_prompt``), resets the
resident-set high-water mark (writes 5 to /proc/self/clear_refs), runs one thing and reports the rise of
VmHWM above the resident set just before (the model's own weights excluded), with the process's
``ru_maxrss`` beside it (weights and loading included). A child whose resident set passes ``--limit-mib`` is
stopped there and reported as ``"stopped_at_mib"`` (a run that would not fit the machine). "fwd_bwd": one
forward + backward of prompt + answer with log p(answer) as the target (``protocol.fwd_bwd_seconds``); a method
name: one ``context_attribution`` call with that method (``methods.attnroll_pooled``). One torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time


def _watch(limit_mib: float, row: dict) -> None:
    """Stop this process (exit 3) once its resident set passes ``limit_mib``, printing ``row`` with where."""
    t0 = time.perf_counter()
    while True:
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        if rss > limit_mib:
            print(json.dumps({**row, "stopped_at_mib": rss, "seconds": time.perf_counter() - t0}), flush=True)
            os._exit(3)
        time.sleep(0.1)


def child(what: str, tokens: int, limit_mib: float = float("inf")) -> dict:
    import torch

    torch.set_num_threads(1)
    from attnroll.models import load_model

    from . import methods, protocol, ruler
    from .data import ruler_prompt

    lm = load_model("smollm2-135m-instruct")
    item = ruler_prompt(lm.tokenizer, "niah", tokens, 0)
    n = len(lm.tokenizer(item.prompt)["input_ids"])
    impl = getattr(lm.model.config, "_attn_implementation", None)
    row = {"what": what, "tokens": n, "attn_implementation": impl}
    threading.Thread(target=_watch, args=(limit_mib, row), daemon=True).start()
    if what == "fwd_bwd":
        s, mib = ruler.measured(lambda: protocol.fwd_bwd_seconds(lm.model, lm.tokenizer, item))
    else:
        s, mib = ruler.measured(lambda: methods.attnroll_pooled(lm.model, lm.tokenizer, item, what))
    return {**row, "seconds": s, "peak_mib": mib,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--what", default="fwd_bwd,attn_grad")
    ap.add_argument("--limit-mib", type=float, default=float("inf"),
                    help="stop a child whose resident set passes this many MiB")
    ap.add_argument("--one", nargs=2, metavar=("WHAT", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory.json"))
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(child(args.one[0], int(args.one[1]), args.limit_mib)), flush=True)
        return
    rows = []
    for n in args.lengths.split(","):
        for what in args.what.split(","):
            load = open("/proc/loadavg").read()[:15]
            cmd = [sys.executable, "-m", "benchmarks.context.memory", "--one", what, n,
                   "--limit-mib", str(args.limit_mib)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if not done.stdout.strip():
                raise RuntimeError(f"{what} at {n} tokens failed: {done.stderr[-2000:]}")
            out = done.stdout
            rows.append({**json.loads(out.strip().splitlines()[-1]), "load_before": load})
            print(json.dumps(rows[-1]), flush=True)
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
