"""G1 (a value-aware map beats rollout on every metric)'s shapes half on 2,000 fresh images, pre-registered in PREREG_G1_2000.md (read it first).

``attnroll evaluate``'s protocol (the embedded shapes ViT, generated shapes data, black fill, one deletion /
insertion step per patch, batch 64, the predicted class) run on slices of ``make_dataset(2000, SEED)`` so that
no single run holds the benchmark lock for long. Each part is the command's own code path (the same loaders,
``patch_masks``, ``fill_tensor`` and ``evaluate_methods`` call) on images [a, b); the per-image scores of every
part are saved to $VA_OUT (default /tmp/g1_2000) and ``report`` pools them, checks that the parts tile
[0, N) exactly, and prints the means ± SE, the paired differences and the verdict of the pre-registered rule.

    python g1_2000.py run primary 0-500          # rollout and measured_rollout(class_blocks=1) on images 0..499
    python g1_2000.py run secondary 0-500        # the descriptive rows (measured_rollout, alti_logit, ...)
    python g1_2000.py run primary 0-50 777 50    # a cost estimate on validation images (seed 777), not the set
    python g1_2000.py report                     # pooled table, paired differences, McNemar, the verdict
"""
from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

#: The pre-registered set: ``make_dataset(N, SEED)`` (PREREG_G1_2000.md); no code or doc used this seed before.
SEED, N = 20261202, 2000
KEYS = ("deletion", "insertion", "positive", "negative", "pointing", "mass", "iou")
HIGHER = {"deletion": False, "insertion": True, "positive": False, "negative": True, "pointing": True,
          "mass": True, "iou": True}
REF, CAND = "rollout", "measured_rollout(class_blocks=1)"
#: group -> [(label, method, options)]; one evaluate_methods call per group and part (a method appears once
#: per call, so the two measured_rollout rows are in different groups).
GROUPS = {
    "primary": [(REF, "rollout", {}), (CAND, "measured_rollout", {"class_blocks": 1})],
    "secondary": [("measured_rollout", "measured_rollout", {}), ("alti_logit", "alti_logit", {}),
                  ("decompx", "decompx", {}), ("norm_rollout", "norm_rollout", {}), ("gae", "gae", {})],
}
_PART = re.compile(r"^g1_(\d+)_(\w+?)_(\d+)-(\d+)\.npz$")


def _out() -> Path:
    return Path(os.environ.get("VA_OUT", "/tmp/g1_2000"))


def run_part(group: str, a: int, b: int, seed: int = SEED, n: int = N, out: Path | None = None) -> Path:
    """Score one group's methods on images [a, b) of make_dataset(n, seed) exactly as ``attnroll evaluate``
    does (defaults: --model shapes --data shapes --fill black, steps one per patch, batch 64); save the
    per-image scores (and the part's wall time and load) to out/g1_{seed}_{group}_{a}-{b}.npz."""
    from attnroll.commands._data import fill_tensor, load_data, load_eval_model
    from attnroll.evaluate.suite import evaluate_methods
    from attnroll.models.shapes import patch_masks

    if group not in GROUPS:
        raise ValueError(f"group must be one of {sorted(GROUPS)}, got {group!r}")
    if not 0 <= a < b <= n:
        raise ValueError(f"part {a}-{b}: need 0 <= a < b <= n = {n}")
    lm = load_eval_model("shapes")
    d = load_data("shapes", lm, n, seed)
    x, labels, masks = d["x"][a:b], d["labels"][a:b], patch_masks(d["masks"][a:b])
    fill = fill_tensor("black", lm, x)
    arrays: dict[str, Any] = {"labels": labels.numpy(), "range": np.array([a, b]), "seed": np.array(seed),
                              "n": np.array(n), "load_before": np.array(os.getloadavg()[0])}
    t0 = time.time()
    for label, method, opts in GROUPS[group]:
        res = evaluate_methods(lm.model, x, [method], labels=labels, masks=masks, fill=fill,
                               method_options={method: opts} if opts else None, batch_size=64)
        for k in KEYS:
            arrays[f"{label}__{k}"] = res.per_example[method][k]
        arrays[f"{label}__seconds"] = np.array(res.seconds[method])
        print(f"{label:34s} " + "  ".join(f"{k} {res.values[method][k]:.4f}" for k in KEYS)
              + f"  ({time.time() - t0:.0f} s so far)", flush=True)
    arrays["wall"], arrays["load_after"] = np.array(time.time() - t0), np.array(os.getloadavg()[0])
    out = out or _out()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"g1_{seed}_{group}_{a}-{b}.npz"
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return path


def pool(out: Path, group: str, seed: int = SEED, n: int = N) -> dict[str, np.ndarray]:
    """label__metric -> (n,) per-image scores of one group, concatenated from its parts in image order. The
    parts must tile [0, n) exactly (no gap, no overlap), else a ValueError naming what is wrong."""
    parts = []
    for f in out.iterdir():
        m = _PART.match(f.name)
        if m and int(m.group(1)) == seed and m.group(2) == group:
            parts.append((int(m.group(3)), int(m.group(4)), f))
    if not parts:
        raise ValueError(f"no parts of group {group!r}, seed {seed} in {out}")
    parts.sort()
    at = 0
    for a, b, f in parts:
        if a != at:
            raise ValueError(f"group {group!r}: parts do not tile [0, {n}): "
                             f"{'gap' if a > at else 'overlap'} at image {min(a, at)} ({f.name})")
        at = b
    if at != n:
        raise ValueError(f"group {group!r}: parts end at image {at}, not {n}")
    loaded = [np.load(f) for _, _, f in parts]
    keys = [k for k in loaded[0].files if "__" in k and not k.endswith("__seconds")]
    pooled = {k: np.concatenate([z[k] for z in loaded]) for k in keys}
    pooled["labels"] = np.concatenate([z["labels"] for z in loaded])
    for k, v in pooled.items():
        if v.shape != (n,):
            raise ValueError(f"group {group!r}: {k} has shape {v.shape}, expected ({n},)")
    return pooled


def mean_se(v: np.ndarray) -> tuple[float, float]:
    """Mean and standard error over the finite entries (the library's nanmean and its SE, ddof = 1)."""
    v = np.asarray(v, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))


def _stats() -> Any:
    """attnlrp_paired.py's paired statistics (one implementation for both scripts; it imports lxt
    only when its own run asks for it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("attnlrp_paired", Path(__file__).with_name("attnlrp_paired.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def paired(c: np.ndarray, r: np.ndarray) -> tuple[float, float, int]:
    """Paired difference c − r: mean, its standard error (ddof = 1) and the number of images where both exist."""
    s = _stats().paired(r, c)
    return s["diff"], s["diff_se"], s["n"]


def mcnemar(hc: np.ndarray, hr: np.ndarray) -> tuple[int, int, float]:
    """Exact McNemar test on 0/1 hits: (gained b = images c hits and r misses, lost c, two-sided p from
    scipy.stats.binomtest(b, b + c, 0.5); p = 1 with no discordant image)."""
    return _stats().mcnemar(hr, hc)


def verdict(cand: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> tuple[bool, dict[str, dict[str, Any]]]:
    """The pre-registered rule: met iff the candidate's mean is strictly better than the reference's on every
    metric of KEYS (means as ``attnroll evaluate`` reports them). Per metric: both means ± SE, the paired
    difference ± SE, that difference in SE signed so that better is positive, and whether it is beyond 2 SE."""
    rows = {}
    for k in KEYS:
        mc, sc = mean_se(cand[k])
        mr, sr = mean_se(ref[k])
        d, se, npair = paired(cand[k], ref[k])
        sign = 1.0 if HIGHER[k] else -1.0
        z = sign * d / se if se > 0 else (math.inf * np.sign(sign * d) if d else 0.0)
        rows[k] = {"cand": (mc, sc), "ref": (mr, sr), "diff": (d, se), "n": npair, "z": z,
                   "better": sign * (mc - mr) > 0, "beyond_2se": z > 2}
    return all(r["better"] for r in rows.values()), rows


def _split(pooled: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, v in pooled.items():
        if "__" in key:
            label, metric = key.split("__")
            out.setdefault(label, {})[metric] = v
    return out


def report(out: Path | None = None, seed: int = SEED, n: int = N, groups: Sequence[str] = ("primary", "secondary")) -> bool:
    """Print the pooled table, the paired differences against rollout, pointing's McNemar tests and the verdict
    (of the primary comparison only); returns the verdict."""
    out = out or _out()
    methods: dict[str, dict[str, np.ndarray]] = {}
    labels = None
    for g in groups:
        try:
            p = pool(out, g, seed, n)
        except ValueError as e:
            if g == "primary":
                raise
            print(f"(secondary rows not complete: {e})")
            continue
        if labels is not None and not np.array_equal(labels, p["labels"]):
            raise ValueError(f"group {g!r} was scored on other images (labels differ)")
        labels = p["labels"]
        methods.update(_split(p))
    print(f"make_dataset({n}, {seed}), black fill, attnroll evaluate's protocol; mean ± SE over {n} images")
    print("| method | " + " | ".join(f"{k} {'↑' if HIGHER[k] else '↓'}" for k in KEYS) + " |")
    print("|---|" + "---|" * len(KEYS))
    for label, d in methods.items():
        print(f"| {label} | " + " | ".join("{:.4f} ± {:.4f}".format(*mean_se(d[k])) for k in KEYS) + " |")
    ref = methods[REF]
    print("\npaired difference − rollout ± SE [in SE, better positive]; pointing: hits, gained / lost, McNemar p")
    for label, d in methods.items():
        if label == REF:
            continue
        met, rows = verdict(d, ref)
        cells = [f"{r['diff'][0]:+.4f} ± {r['diff'][1]:.4f} [{r['z']:+.1f}]" for r in rows.values()]
        b, c, p = mcnemar(d["pointing"], ref["pointing"])
        tag = "PRIMARY" if label == CAND else "descriptive"
        print(f"| {label} ({tag}) | " + " | ".join(cells) + f" | hits {int(d['pointing'].sum())} vs "
              f"{int(ref['pointing'].sum())}, +{b} / −{c}, p = {p:.3g} | better on all 7: {met} |")
    met, rows = verdict(methods[CAND], ref)
    print(f"\nPRE-REGISTERED VERDICT ({CAND} vs {REF}, {n} images of seed {seed}): the shapes half of G1 is "
          f"{'MET' if met else 'NOT MET'} on this set.")
    for k, r in rows.items():
        print(f"  {k:9s} cand {r['cand'][0]:.4f} ± {r['cand'][1]:.4f}  rollout {r['ref'][0]:.4f} ± {r['ref'][1]:.4f}"
              f"  diff {r['diff'][0]:+.5f} ± {r['diff'][1]:.5f} ({r['z']:+.2f} SE)  better: {r['better']}"
              f"  beyond 2 SE: {r['beyond_2se']}")
    return met


def main(argv: Sequence[str]) -> None:
    import torch

    torch.set_num_threads(1)
    if argv and argv[0] == "run":
        a, b = (int(v) for v in argv[2].split("-"))
        seed = int(argv[3]) if len(argv) > 3 else SEED
        n = int(argv[4]) if len(argv) > 4 else N
        print(f"saved {run_part(argv[1], a, b, seed, n)}")
    elif argv and argv[0] == "report":
        report()
    else:
        raise SystemExit("usage: g1_2000.py run GROUP A-B [SEED N] | report")


if __name__ == "__main__":
    main(sys.argv[1:])
