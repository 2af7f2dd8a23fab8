"""Candidates against rollout on the text benchmark's **validation** sentences (any seed but the
held-out 12345), paired per sentence; `attnroll evaluate`'s protocol (minilm-evidence, predicted class, the
five text metrics). Usage:

    python text_val.py K[,K...] N SEEDS          # e.g. 1,2 200 777,778  (K = measured_rollout's class_blocks)

Per-sentence scores go to $VA_OUT/text_{name}_{seed}.npy (metrics x sentences)."""
import os, sys, time
import numpy as np
from attnroll.evaluate.suite import evaluate_methods
from attnroll.models import evidence, load_model

KEYS = ["comprehensiveness", "sufficiency", "evidence_mass", "evidence_pointing", "evidence_f1"]
LOWER = {"sufficiency"}
ks, n, seeds = [int(k) for k in sys.argv[1].split(",")], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
assert 12345 not in seeds, "validation seeds only"
out = os.environ.get("VA_OUT", "/tmp")
lm = load_model("minilm-evidence")
per = {}
for seed in seeds:
    ex = evidence.make_examples(n, seed)
    enc, masks = evidence.encode(lm.tokenizer, ex)
    for i, k in enumerate(ks):
        t0 = time.time()
        res = evaluate_methods(lm.model, enc, ["rollout", "measured_rollout"] if i == 0 else ["measured_rollout"],
                               labels=ex.labels, masks=masks, method_options={"measured_rollout": {"class_blocks": k}})
        names = {"measured_rollout": f"mr_k{k}"} | ({"rollout": "rollout"} if i == 0 else {})
        for m, nm in names.items():
            a = np.stack([res.per_example[m][key] for key in KEYS])
            np.save(f"{out}/text_{nm}_{seed}.npy", a)
            per.setdefault(nm, []).append(a)
        print(f"seed {seed} k={k} accuracy {res.accuracy} ({time.time() - t0:.0f} s)", flush=True)
R = np.concatenate(per["rollout"], axis=1)
print("rollout   " + "  ".join(f"{key} {np.nanmean(R[j]):.4f}" for j, key in enumerate(KEYS)), f"(n={R.shape[1]})")
for k in ks:
    C = np.concatenate(per[f"mr_k{k}"], axis=1)
    cells = []
    for j, key in enumerate(KEYS):
        d = C[j] - R[j]
        d = d[~np.isnan(d)]
        se = d.std(ddof=1) / np.sqrt(len(d))
        z = (-1 if key in LOWER else 1) * d.mean() / se if se > 0 else float("inf") * np.sign(d.mean())
        cells.append(f"{key} {np.nanmean(C[j]):.4f} ({d.mean():+.4f}±{se:.4f}, {z:+.1f} SE)")
    print(f"mr_k{k}    " + "  ".join(cells), flush=True)
