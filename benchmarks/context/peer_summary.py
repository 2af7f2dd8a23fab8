"""attnroll's methods beside the peers on the same prompts: top-k log-prob drops (k = 1, 3, 5) as a % of a
reference's (ContextCite-256 by default), and side by side with each peer (FlashTrace, AT2, AttnTrace, mean
last-layer attention) on the prompts both were run on. Inputs are run.py-format JSON files (peer_run.py's,
run.py's); rows are matched by prompt (metadata, answer, gold). Rows that hold only scores and the LOO drops
(``{"scores": {method: [...]}, "loo": [...]}``, e.g. ``checked collect``'s) give drop@1 exactly (the LOO drop of
the top-scored passage) and top-1; their drop@3 / @5 need forwards and show as "–".

    cd benchmarks/context/results && PYTHONPATH=../../../src:../../.. python -m benchmarks.context.peer_summary \\
        --attnroll qa_heldout-b_report_*.json -- peers_heldout-b_*.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

KS = (1, 3, 5)
PEERS = ("flashtrace", "at2", "attntrace_B30", "last_attention", "contextcite_32")


def prompt_key(row: dict) -> str:
    """A row's prompt identity (run.same_prompt's fields)."""
    return json.dumps([row.get("meta"), row.get("answer"), row.get("gold")], sort_keys=True)


def merge(files: list[dict]) -> dict[str, dict]:
    """prompt key -> {method: figures} over every file's rows (a later file's method replaces an earlier's;
    figures derived from stored scores only fill methods no file measured in full)."""
    out: dict[str, dict] = {}
    for data in files:
        if "items" not in data:
            raise ValueError("expected a run.py-format results JSON with an 'items' list")
        for row in data["items"]:
            methods = out.setdefault(prompt_key(row), {})
            methods.update(row.get("methods", {}))
            for name, figures in from_scores(row).items():
                if name not in methods or np.isnan(methods[name]["drop3"]):
                    methods[name] = figures
    return out


def from_scores(row: dict) -> dict:
    """Figures that a row's stored scores and LOO drops give without forwards: top-1 and drop@1 (the LOO drop of
    the top passage, ties to the first as in protocol.topk_drop); drop@3 / @5 NaN."""
    if "scores" not in row or "loo" not in row:
        return {}
    loo = np.asarray(row["loo"], dtype=float)
    out = {}
    for name, s in row["scores"].items():
        top = int(np.argmax(np.asarray(s, dtype=float)))
        out[name] = {"top1": top == int(np.argmax(loo)), "drop1": float(loo[top]), "drop3": np.nan, "drop5": np.nan}
    return out


def mean_drops(rows: dict[str, dict], method: str, keys: list[str]) -> np.ndarray:
    """(3,) mean drop@k of ``method`` over the prompts ``keys``."""
    return np.array([[rows[k][method][f"drop{k_}"] for k_ in KS] for k in keys]).mean(axis=0)


def common(rows: dict[str, dict], *methods: str) -> list[str]:
    """The prompts on which every one of ``methods`` was run, in a fixed order."""
    return sorted(k for k, m in rows.items() if all(x in m for x in methods))


def versus(rows: dict[str, dict], method: str, other: str) -> dict | None:
    """``method``'s and ``other``'s mean drops on their common prompts, with ``method``'s as a % of the
    other's, and top-1 agreement with LOO counts; None when no prompt has both."""
    keys = common(rows, method, other)
    if not keys:
        return None
    a, b = mean_drops(rows, method, keys), mean_drops(rows, other, keys)
    top1 = [sum(bool(rows[k][m]["top1"]) for k in keys) for m in (method, other)]
    return {"n": len(keys), "method": a, "other": b, "percent": 100 * a / np.where(b == 0, np.nan, b), "top1": top1}


def _fmt(v: np.ndarray, pct: bool = False) -> str:
    return " / ".join("–" if np.isnan(x) else f"{x:.0f} %" if pct else f"{x:.2f}" for x in v)


def report(rows: dict[str, dict], attnroll: list[str], reference: str = "contextcite_256") -> list[str]:
    """The printed lines: each attnroll method against the reference, then against each peer present."""
    lines = [f"drops k = {'/'.join(map(str, KS))} (nats); % = of the other method's mean drop on the same prompts"]
    for m in attnroll:
        v = versus(rows, m, reference)
        if v:
            lines.append(f"{m} vs {reference} (n={v['n']}): {_fmt(v['method'])} vs {_fmt(v['other'])} = "
                         f"{_fmt(v['percent'], True)}; top-1 = LOO {v['top1'][0]} vs {v['top1'][1]}")
    present = sorted({p for r in rows.values() for p in r if p in PEERS})
    for peer in present:
        for m in attnroll:
            v = versus(rows, m, peer)
            if v:
                known = ~np.isnan(v["method"] + v["other"])
                wins = int((v["method"][known] > v["other"][known]).sum())
                lines.append(f"{m} vs {peer} (n={v['n']}): {_fmt(v['method'])} vs {_fmt(v['other'])}; "
                             f"higher at {wins}/{int(known.sum())} k; top-1 = LOO {v['top1'][0]} vs {v['top1'][1]}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peers", nargs="+", help="peer results JSON files (run.py format)")
    ap.add_argument("--attnroll", required=True, nargs="+",
                    help="attnroll's results JSON files on the same prompts (run.py's or checked report's output)")
    ap.add_argument("--reference", default="contextcite_256")
    args = ap.parse_args(argv)
    files = [json.load(open(p)) for p in args.peers]
    ours = {"items": [r for p in args.attnroll for r in json.load(open(p))["items"]]}
    rows = merge(files + [ours])
    names = sorted({m for r in ours["items"] for m in {**r.get("methods", {}), **r.get("scores", {})}}
                   - set(PEERS) - {args.reference})
    print("\n".join(report(rows, names, args.reference)))


if __name__ == "__main__":
    main()
