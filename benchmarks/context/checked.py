"""Method "checked" (a gradient ranking whose top r passages are verified by exact leave-one-out) against its
bases, on SmolLM2-135M-Instruct QA prompts.

``collect``: per prompt, exact LOO (``protocol.Scorer``) and the gradient scores every candidate starts from, in
one pass each: gate_grad's derivative at the gate points 1 and 0.25 (one two-copy forward + backward: the
(1, ¼) default and the single point 1), attn_grad, and with ``--methods`` the comparators (gae, rollout, mean
last-layer attention, random). A checked candidate's scores follow from these by the library's own rule
(``attnroll.explain.checked.choose`` / ``combine``), its exact drops being the LOO drops of the same prompts
without the passage (the library removes the passage's text and the whitespace after it, which is the LOO
prompt: ``--verify`` checks it end to end on a prompt).

``history``: ``checked`` rebuilt the same way on the first held-out split's stored rows (no forwards).
``choose``: the candidates' top-1 agreement with LOO and Spearman on validation files (no forwards).
``report``: the named methods on a held-out file: top-1, Spearman, drop k = 1 (the LOO forwards), 3, 5; and the
cost of each, end to end through ``context_attribution``, timed alongside one forward + backward on the first
``--timed`` prompts.

    PYTHONPATH=src python -m benchmarks.context.checked collect --split validation-b --count 20 --out X.json
    PYTHONPATH=src python -m benchmarks.context.checked choose X.json ...
    PYTHONPATH=src python -m benchmarks.context.checked report --split heldout-b --use checked@3 Y.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from attnroll import context_attribution
from attnroll.explain import checked as lib

from . import gate_points, methods, protocol
from .data import SPLITS, qa_set

HERE = os.path.join(os.path.dirname(__file__), "results")
BASES = ("gate_grad", "gate_grad@1", "attn_grad")
COMPARATORS = ("gae", "rollout", "last_attention", "random")


def gate_points_scores(model, tok, item) -> dict:
    """{"gate_grad": mean of the points (1, ¼), "gate_grad@1": point 1} from one two-copy pass."""
    store: dict = {}
    original = gate_points.key_gates.gate_gradients
    gate_points.key_gates.gate_gradients = gate_points.per_point([1.0, 0.25], store)
    try:
        ca = context_attribution(model, tok, item.prompt, answer=item.answer, segments=item.segments,
                                 method="gate_grad", sinks="drop")
    finally:
        gate_points.key_gates.gate_gradients = original
    own, n = methods.owners(tok, item.prompt, item.segments), len(item.segments)
    g = store["g"][:, :len(ca.token_scores)].clone()
    g[:, ca.sinks] = 0.0
    unit = np.stack([[float(g[p, own == i].sum()) for i in range(n)] for p in range(2)])
    assert np.allclose(unit.mean(axis=0), [u["score"] for u in ca.units[:n]], atol=1e-4)
    return {"gate_grad": unit.mean(axis=0).tolist(), "gate_grad@1": unit[0].tolist()}


def collect_item(model, tok, item, extra: list[str]) -> dict:
    scorer = protocol.Scorer(model, tok, item)
    drops = protocol.loo(scorer)
    scores = gate_points_scores(model, tok, item)
    for name in ["attn_grad"] + extra:
        if name == "random":
            s = np.random.default_rng(len(item.prompt)).random(len(item.segments))
        elif name == "last_attention":
            s = methods.last_layer_attention(model, tok, item)
        else:
            s = methods.attnroll_pooled(model, tok, item, name)[name]
        scores[name] = np.asarray(s, float).tolist()
    return {"meta": item.meta, "answer": item.answer, "gold": item.gold, "loo": drops.tolist(),
            "full_logp": scorer.full(), "scores": scores}


def candidate(row: dict, name: str) -> np.ndarray:
    """A candidate's segment scores: a stored base, or ``checked@r`` / ``checked@r:base`` from the stored base
    scores and the LOO drops of the r passages the base ranks highest (the library's rule)."""
    if not name.startswith("checked"):
        return np.array(row["scores"][name])
    spec = name.partition("@")[2]
    r, _, base = spec.partition(":")
    g = row["scores"][base or "gate_grad"]
    chosen = lib.choose(g, int(r))
    return np.array(lib.combine(g, {j: row["loo"][j] for j in chosen}))


def load_rows(paths: list[str]) -> list[dict]:
    return [r for p in paths for r in json.load(open(p))["items"]]


def old_validation_rows() -> list[dict]:
    """The first validation split's stored LOO with its stored per-point gate_grad (points 1, ½, ¼, 0.1) and
    attn_grad scores, in this script's row layout."""
    rows = []
    for f in ("qa_validation_points_0.json", "qa_validation_points_5.json"):
        for r in json.load(open(os.path.join(HERE, f)))["items"]:
            pp = np.array(r["per_point"])
            at = {p: i for i, p in enumerate(r["points"])}
            rows.append({"meta": r["meta"], "loo": r["loo"], "scores": {
                "gate_grad": ((pp[at[1.0]] + pp[at[0.25]]) / 2).tolist(), "gate_grad@1": pp[at[1.0]].tolist(),
                "attn_grad": r["methods"]["attn_grad"]["scores"]}})
    return rows


def old_heldout_rows() -> list[dict]:
    """The first held-out split's stored LOO with its stored gate_grad (1, ¼) and attn_grad scores (14 prompts)."""
    return [{"meta": r["meta"], "loo": r["loo"], "scores": {
        "gate_grad": r["methods"]["gate_grad@1,0.25"]["scores"], "attn_grad": r["methods"]["attn_grad"]["scores"]}}
        for f in ("qa_heldout_points_0.json", "qa_heldout_points_7.json")
        for r in json.load(open(os.path.join(HERE, f)))["items"]]


def history(args) -> None:
    """``checked`` rebuilt on the first held-out split from its stored scores and LOO (no forwards): top-1,
    Spearman and drop k = 1 (the LOO drop of the passage ranked first)."""
    rows = old_heldout_rows()
    print(f"{len(rows)} prompts of the first held-out split")
    print("| method | top-1 = LOO | Spearman | drop k=1 |\n|---|---|---|---|")
    for name in ("checked@4", "gate_grad", "attn_grad"):
        a = agreement(rows, name)
        d1 = np.mean([r["loo"][int(np.argmax(candidate(r, name)))] for r in rows])
        print(f"| {name} | {a['top1']}/{a['n']} | {a['spearman']:.2f} | {d1:.2f} |")


def agreement(rows: list[dict], name: str) -> dict:
    top1 = [int(np.argmax(candidate(r, name)) == np.argmax(r["loo"])) for r in rows]
    rho = [protocol._spearman(candidate(r, name), np.array(r["loo"])) for r in rows]
    return {"n": len(rows), "top1": int(sum(top1)), "spearman": float(np.mean(rho))}


def choose_table(args) -> None:
    rows = load_rows(args.files) + (old_validation_rows() if args.old else [])
    names = list(BASES) + [f"checked@{r}:{b}" for b in BASES for r in (2, 3, 4)]
    print(f"{len(rows)} validation prompts")
    print("| candidate | top-1 = LOO | Spearman |\n|---|---|---|")
    for name in names:
        a = agreement(rows, name)
        print(f"| {name} | {a['top1']}/{a['n']} | {a['spearman']:.3f} |")


def library_call(name: str) -> tuple[str, dict]:
    """(method, options) of ``context_attribution`` for a candidate name (``checked@3:attn_grad``)."""
    if name.startswith("checked"):
        r, _, base = name.partition("@")[2].partition(":")
        return "checked", {"r": int(r), "base": base or "gate_grad"}
    return methods.method_options(name)


def timed_costs(model, tok, item, names: list[str]) -> dict:
    """{name: (seconds / one forward + backward timed before and after, the segment scores)} end to end."""
    fb, out = [protocol.fwd_bwd_seconds(model, tok, item)], {}
    for name in names:
        t0 = time.perf_counter()
        if name == "last_attention":
            s = methods.last_layer_attention(model, tok, item)
        else:
            method, opts = library_call(name)
            ca = context_attribution(model, tok, item.prompt, answer=item.answer, segments=item.segments,
                                     method=method, sinks="drop", **opts)
            s = np.array([u["score"] for u in ca.units[:len(item.segments)]])
        out[name] = [time.perf_counter() - t0, s]
    fb.append(protocol.fwd_bwd_seconds(model, tok, item))
    return {k: (v[0] / float(np.median(fb)), v[1]) for k, v in out.items()}


def report_item(model, tok, item, row: dict, names: list[str], timed: bool) -> dict:
    scorer = protocol.Scorer(model, tok, item)
    scorer.prefill(row["full_logp"], row["loo"])
    drops = np.array(row["loo"])
    costs = timed_costs(model, tok, item, [n for n in names if n != "random"]) if timed else {}
    out = {"meta": item.meta, "answer": item.answer, "gold": item.gold, "methods": {},
           "loadavg": open("/proc/loadavg").read().split()[:3]}
    for name in names:
        s = candidate(row, name)
        res = {"top1": bool(np.argmax(s) == np.argmax(drops)), "spearman": protocol._spearman(s, drops),
               **{f"drop{k}": protocol.topk_drop(scorer, s, k) for k in (1, 3, 5)}, "scores": s.tolist()}
        if name in costs:  # the end-to-end call's scores against the ones rebuilt from the stored pass
            res["cost"], res["e2e_max_diff"] = costs[name][0], float(np.abs(costs[name][1] - s).max())
        out["methods"][name] = res
    return out


def report(args) -> None:
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    rows = {d.get("start", 0) + k: r
            for p in args.files for d in [json.load(open(p))] for k, r in enumerate(d["items"])}
    wanted = [i for i in sorted(rows) if args.start <= i < args.start + args.count]
    items = qa_set(lm.tokenizer, args.split, max(wanted) + 1, 16)
    names = args.use.split(",")
    out = []
    for i in wanted:
        item, row = items[i], rows[i]
        if row["meta"] != item.meta or row["answer"] != item.answer:
            raise ValueError(f"stored row {i} is not prompt {i} of {args.split}: {row['meta']} vs {item.meta}")
        out.append(report_item(lm.model, lm.tokenizer, item, row, names, i < args.start + args.timed))
        json.dump({"split": args.split, "items": out}, open(args.out, "w"))
        print(i, {k: (v["top1"], round(v["spearman"], 2)) for k, v in out[-1]["methods"].items()}, flush=True)


def collect(args) -> None:
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    extra = [m for m in args.methods.split(",") if m]
    items = qa_set(lm.tokenizer, args.split, args.start + args.count, 16)[args.start:]
    rows = []
    for item in items:
        rows.append(collect_item(lm.model, lm.tokenizer, item, extra))
        json.dump({"split": args.split, "start": args.start, "items": rows}, open(args.out, "w"))
        print(len(rows), item.meta, flush=True)


def costs(args) -> None:
    """End-to-end costs of the bases and of checked@4 (base + 4 checks) on a few prompts, side by side with one
    forward + backward; one check's cost = (checked@4 − gate_grad) / 4."""
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    names = ["gate_grad", "gate_grad@1", "attn_grad", "checked@4"]
    rows = []
    for item in qa_set(lm.tokenizer, args.split, args.count, 16):
        c = {k: v[0] for k, v in timed_costs(lm.model, lm.tokenizer, item, names).items()}
        c["one check"] = (c["checked@4"] - c["gate_grad"]) / 4
        rows.append({**c, "loadavg": open("/proc/loadavg").read().split()[:3]})
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    json.dump({"split": args.split, "items": rows}, open(args.out, "w"))


def report_table(args) -> None:
    """Markdown rows of ``report`` files: per method top-1 = LOO, mean Spearman, mean drops, median cost (timed
    prompts), and the largest gap between the end-to-end scores and those rebuilt from the stored pass."""
    items = load_rows(args.files)
    timed = [" ".join(it["loadavg"]) for it in items if any("cost" in m for m in it["methods"].values())]
    print(f"{len(items)} prompts; load (timed prompts) {', '.join(timed)}")
    print("| method | top-1 = LOO | Spearman | drop k=1 | k=3 | k=5 | cost (prompts) | e2e gap |")
    print("|---|---|---|---|---|---|---|---|")
    for name in items[0]["methods"]:
        rs = [it["methods"][name] for it in items]
        c = [r["cost"] for r in rs if "cost" in r]
        gap = max((r["e2e_max_diff"] for r in rs if "e2e_max_diff" in r), default=float("nan"))
        print(f"| {name} | {sum(r['top1'] for r in rs)}/{len(rs)} | {np.mean([r['spearman'] for r in rs]):.2f} | "
              + " | ".join(f"{np.mean([r[f'drop{k}'] for r in rs]):.2f}" for k in (1, 3, 5))
              + f" | {'–'.join(f'{v:.1f}' for v in sorted(c)) or '–'} ({len(c)}) | {gap:.1e} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--split", choices=tuple(SPLITS), required=True)
    c.add_argument("--start", type=int, default=0)
    c.add_argument("--count", type=int, default=20)
    c.add_argument("--methods", default="", help="comparators to score too, among " + ", ".join(COMPARATORS))
    c.add_argument("--out", required=True)
    h = sub.add_parser("choose")
    h.add_argument("files", nargs="*")
    h.add_argument("--old", action="store_true", help="add the first validation split's stored rows")
    r = sub.add_parser("report")
    r.add_argument("files", nargs="+")
    r.add_argument("--split", choices=tuple(SPLITS), required=True)
    r.add_argument("--use", required=True, help="comma-separated candidate names")
    r.add_argument("--start", type=int, default=0, help="the prompts reported: --start, then --count of them")
    r.add_argument("--count", type=int, default=1000)
    r.add_argument("--timed", type=int, default=3, help="time the methods end to end on this many prompts")
    r.add_argument("--out", required=True)
    k = sub.add_parser("costs")
    k.add_argument("--split", choices=tuple(SPLITS), default="validation-b")
    k.add_argument("--count", type=int, default=2)
    k.add_argument("--out", required=True)
    sub.add_parser("history", help="checked rebuilt on the first held-out split's stored rows")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.cmd == "table":
        return report_table(args)
    {"collect": collect, "choose": choose_table, "report": report, "costs": costs, "history": history}[args.cmd](args)


if __name__ == "__main__":
    main()
