"""Run the context-attribution protocol on SmolLM2-135M-Instruct and save the raw figures as JSON.

    PYTHONPATH=src python -m benchmarks.context.run --split validation --count 12
    PYTHONPATH=src python -m benchmarks.context.run --split heldout --count 24 --cc 8
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from . import methods, peers, protocol
from .data import SPLITS, qa_set

LDS = [16]


def method_table(names: list[str]) -> dict:
    """The baselines and peers among ``names``: name -> fn(model, tok, item) returning segment scores
    (attnroll's methods are run by ``methods.attnroll_pooled``)."""
    table = {
        "last_attention": methods.last_layer_attention,
        "attntrace_B30": lambda m, t, it: methods.attntrace(m, t, it, B=30),
        "attntrace_B5": lambda m, t, it: methods.attntrace(m, t, it, B=5),
        "contextcite_32": lambda m, t, it: peers.context_cite(m, t, it, 32),
        "contextcite_256": lambda m, t, it: peers.context_cite(m, t, it, 256),
    }
    return {k: v for k, v in table.items() if k in names}


def same_prompt(old: dict, item) -> bool:
    """Whether a stored result row was measured on this very prompt (its metadata, answer and gold agree)."""
    return old.get("meta") == item.meta and old.get("answer") == item.answer and old.get("gold") == item.gold


def run_item(model, tok, item, names: list[str], cc: bool, old: dict | None = None, top5: bool = True) -> dict:
    """Every method's protocol figures on one prompt; costs relative to a forward+backward timed alongside.
    ``old``: a stored row of the same prompt: its LOO drops are reused and its methods not in ``names`` kept."""
    scorer = protocol.Scorer(model, tok, item)
    if old and "full_logp" in old:  # the stored LOO forwards put back in the cache (top-1 drops reuse them)
        scorer.prefill(old["full_logp"], old["loo"])
    t0 = time.perf_counter()
    drops = np.array(old["loo"]) if old else protocol.loo(scorer)
    loo_s = time.perf_counter() - t0 if not old else old["loo_cost"] * old["fwd_bwd_s"]
    masks = protocol.lds_masks(len(item.segments), LDS[0])
    table = method_table(names)
    kept = {k: v for k, v in (old or {}).get("methods", {}).items() if k.split("/")[0] not in names}
    out = {"meta": item.meta, "answer": item.answer, "gold": item.gold, "loo": drops.tolist(),
           "full_logp": scorer.full(),
           "n_tokens": len(tok(item.prompt)["input_ids"]), "methods": {}}
    fb = [protocol.fwd_bwd_seconds(model, tok, item)]
    cc_cache: dict = {}  # ContextCite-256's ablations, whose first 32 are ContextCite-32's (same seeds)
    for name in sorted(names, key=lambda n: n != "contextcite_256"):
        if name.startswith("contextcite") and not cc:
            continue
        t0 = time.perf_counter()
        if name == "random":
            scores = {name: np.random.default_rng(len(item.prompt)).random(len(item.segments))}
        elif name.startswith("contextcite_") and "contextcite_256" in names:
            scores = {name: peers.context_cite(model, tok, item, int(name.split("_")[1]), cc_cache)}
        elif name in table:
            scores = {name: table[name](model, tok, item)}
        else:  # one attnroll call, pooled two ways (sum = the library's; top5 = mean of 5 largest tokens)
            scores = methods.attnroll_pooled(model, tok, item, name)
            scores = scores if top5 else {name: scores[name]}
        dt = time.perf_counter() - t0
        if name == "contextcite_32" and "contextcite_256" in names:
            dt = out["methods"]["contextcite_256"]["seconds"] * 32 / 256  # its share of the 256 ablations
        for key, s in scores.items():
            res = protocol.evaluate(scorer, s, drops, masks)
            out["methods"][key] = {**res, "seconds": dt, "scores": np.asarray(s, float).tolist()}
    fb.append(protocol.fwd_bwd_seconds(model, tok, item))
    base = float(np.median(fb))
    for r in out["methods"].values():
        r["cost"] = r["seconds"] / base
    out["methods"].update(kept)  # stored methods keep their own costs (timed beside their own fwd+bwd)
    out.update(fwd_bwd_s=base, loo_cost=loo_s / base, loadavg=open("/proc/loadavg").read().split()[:3])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=tuple(SPLITS), default="validation")
    ap.add_argument("--count", type=int, default=12)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--methods", default="random,rollout,gae,attn_grad,gate_grad,last_attention,"
                                        "attntrace_B30,contextcite_32", help="comma-separated; 'none': LOO only")
    ap.add_argument("--cc", type=int, default=2, help="run ContextCite on the first N prompts only")
    ap.add_argument("--passages", type=int, default=16)
    ap.add_argument("--lds", type=int, default=16, help="held-out random 50%% ablations for LDS (0: no LDS)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reuse", default=None, help="a results JSON: LOO and methods not re-run are taken from "
                                                 "its rows of the same prompts")
    ap.add_argument("--no-top5", action="store_true", help="skip the top-5 pooling of attnroll's methods")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # a shared machine: one core per run
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    names, LDS[0] = ([] if args.methods == "none" else args.methods.split(",")), args.lds
    items = qa_set(lm.tokenizer, args.split, args.start + args.count, args.passages)[args.start:]
    path = args.out or os.path.join(os.path.dirname(__file__), "results", f"qa_{args.split}.json")
    stored = json.load(open(args.reuse))["items"] if args.reuse else []
    rows = []
    for i, item in enumerate(items):
        old = next((r for r in stored if same_prompt(r, item)), None)
        rows.append(run_item(lm.model, lm.tokenizer, item, names, i < args.cc, old, not args.no_top5))
        with open(path, "w") as f:
            json.dump({"split": args.split, "methods": names, "items": rows}, f)
        print(i, item.meta, {k: (v["top1"], round(v["spearman"], 2), round(v["cost"], 1))
                             for k, v in rows[-1]["methods"].items()}, flush=True)


if __name__ == "__main__":
    main()
