"""gate_grad's gate points compared on the validation prompts: per prompt, ∂ log p(answer)/∂m_j at every gate
value of ``--points`` in one forward + backward (one copy per point on the batch axis, as ``gate_grad`` does);
a candidate's scores are the mean over its points (exactly ``gate_grad`` with those ``scales``: the unit scores
are sums of token derivatives, linear in them). LOO and attn_grad's scores are the stored ones.

    PYTHONPATH=src python -m benchmarks.context.gate_points --start 0 --count 5 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from attnroll import context_attribution
from attnroll.explain import key_gates

from . import methods, protocol
from .data import SPLITS, qa_set

HERE = os.path.join(os.path.dirname(__file__), "results")
CANDIDATES = {"gate_grad@1,0.5": (1.0, 0.5), "gate_grad@0.5,0.1": (0.5, 0.1), "gate_grad@1,0.25": (1.0, 0.25),
              "gate_grad@1,0.1": (1.0, 0.1)}


HELDOUT = ("qa_heldout_0_4.json", "qa_heldout_4_12.json", "qa_heldout_8_16.json")


def stored_rows(split: str) -> list[dict]:
    """The prompts' stored LOO and attn_grad scores (validation: prompts 0-3 and 4-9 in two files; held-out:
    the three parts of its run)."""
    files = ("qa_validation.json",) if split == "validation" else HELDOUT
    rows = [{"meta": r["meta"], "answer": r["answer"], "loo": r["loo"],
             "attn_grad": r["methods"]["attn_grad"]["scores"]}
            for f in files for r in json.load(open(os.path.join(HERE, f)))["items"]]
    if split == "validation":
        rows += [{"meta": r["meta"], "loo": r["loo"], "attn_grad": r["scores"]["attn_grad"]}
                 for r in json.load(open(os.path.join(HERE, "qa_validation_gates.json")))["items"]]
    return rows


def per_point(points: list[float], store: dict):
    """A stand-in for ``key_gates.gate_gradients`` that keeps every point's (n,) derivative in ``store``."""
    def grads(model, ids, rows, answer_ids, gated, scales=(1.0, 0.5), per_row=False):
        n = ids.shape[1]
        point = torch.tensor(points).log().reshape(-1, 1) * gated.to(torch.float32).reshape(1, n)
        zero = torch.zeros(point.shape, requires_grad=True)
        with torch.enable_grad():
            f = key_gates.answer_logprob(model, ids, rows, answer_ids, zero + point)
            (g,) = torch.autograd.grad(f.sum(), zero)
        store["g"] = (g / point.exp()).detach()
        return store["g"].mean(dim=0)
    return grads


def run_item(model, tok, item, old: dict, points: list[float], candidates: dict) -> dict:
    store: dict = {}
    original = key_gates.gate_gradients
    key_gates.gate_gradients = per_point(points, store)
    try:
        ca = context_attribution(model, tok, item.prompt, answer=item.answer, segments=item.segments,
                                 method="gate_grad", sinks="drop")
    finally:
        key_gates.gate_gradients = original
    n_p, n = len(ca.token_scores), len(item.segments)
    own = methods.owners(tok, item.prompt, item.segments)
    g = store["g"][:, :n_p].clone()
    g[:, ca.sinks] = 0.0
    unit = np.stack([[float(g[p, own == i].sum()) for i in range(n)] for p in range(len(points))])
    mean_all = np.array([u["score"] for u in ca.units[:n]])
    assert np.allclose(unit.mean(axis=0), mean_all, atol=1e-4), (unit.mean(axis=0), mean_all)
    scorer, drops = protocol.Scorer(model, tok, item), np.array(old["loo"])
    cands = {"attn_grad": np.array(old["attn_grad"])}
    cands.update({k: unit[[points.index(s) for s in v]].mean(axis=0) for k, v in candidates.items()})
    figs = {}
    for k, s in cands.items():
        figs[k] = {"top1": bool(np.argmax(s) == np.argmax(drops)), "spearman": protocol._spearman(s, drops),
                   **{f"drop{j}": protocol.topk_drop(scorer, s, j) for j in (1, 3, 5)}, "scores": s.tolist()}
    return {"meta": item.meta, "loo": old["loo"], "points": points, "per_point": unit.tolist(), "methods": figs}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--split", choices=tuple(SPLITS), default="validation")
    ap.add_argument("--candidates", default=";".join(CANDIDATES), help="names among " + ", ".join(CANDIDATES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    candidates = {k: CANDIDATES[k] for k in args.candidates.split(";")}
    points = sorted({p for v in candidates.values() for p in v}, reverse=True)
    stored = stored_rows(args.split)
    items = qa_set(lm.tokenizer, args.split, args.start + args.count, 16)[args.start:]
    rows = []
    for i, item in enumerate(items):  # the stored rows are in the split's order (two prompts may share a meta)
        old = stored[args.start + i]
        if old["meta"] != item.meta or old.get("answer", item.answer) != item.answer:
            raise ValueError(f"stored row {args.start + i} is not this prompt: {old['meta']} vs {item.meta}")
        rows.append(run_item(lm.model, lm.tokenizer, item, old, points, candidates))
        json.dump({"split": args.split, "candidates": candidates, "items": rows}, open(args.out, "w"))
        print(item.meta, {k: (v["top1"], round(v["spearman"], 2), round(v["drop1"], 2))
                          for k, v in rows[-1]["methods"].items()}, flush=True)


if __name__ == "__main__":
    main()
