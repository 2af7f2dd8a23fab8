"""alti_logit's two post-LN MLP rules against rollout, alti and decompx on the text benchmark's
**validation** sentences (any seed but the held-out 12345), paired per sentence; `attnroll evaluate`'s protocol
(minilm-evidence, predicted class, the five text metrics). Usage:

    python text_val_alti_logit.py N SEEDS          # e.g. 200 777,778

Per-sentence scores go to $VA_OUT/text_{name}_{seed}.npy (metrics x sentences)."""
import os, sys, time
import numpy as np
from attnroll.evaluate.suite import evaluate_methods
from attnroll.models import evidence, load_model

KEYS = ["comprehensiveness", "sufficiency", "evidence_mass", "evidence_pointing", "evidence_f1"]
LOWER = {"sufficiency"}
n, seeds = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
assert 12345 not in seeds, "validation seeds only"
out = os.environ.get("VA_OUT", "/tmp")
lm = load_model("minilm-evidence")
RUNS = [("base", ["rollout", "alti", "decompx", "alti_logit"], {"alti_logit": {"mlp": "linearised"}}),
        ("upd", ["alti_logit"], {"alti_logit": {"mlp": "update"}})]
per = {}
for seed in seeds:
    ex = evidence.make_examples(n, seed)
    enc, masks = evidence.encode(lm.tokenizer, ex)
    for tag, methods, opts in RUNS:
        t0 = time.time()
        res = evaluate_methods(lm.model, enc, methods, labels=ex.labels, masks=masks, method_options=opts)
        for m in methods:
            nm = "al_update" if tag == "upd" else ("al_linearised" if m == "alti_logit" else m)
            a = np.stack([res.per_example[m][key] for key in KEYS])
            np.save(f"{out}/text_{nm}_{seed}.npy", a)
            per.setdefault(nm, []).append(a)
        print(f"seed {seed} {tag} accuracy {res.accuracy} ({time.time() - t0:.0f} s)", flush=True)
for nm, parts in per.items():
    C = np.concatenate(parts, axis=1)
    print(f"{nm:14s}" + "  ".join(f"{key} {np.nanmean(C[j]):.4f}±{np.nanstd(C[j], ddof=1) / np.sqrt(C.shape[1]):.4f}"
                                   for j, key in enumerate(KEYS)), f"(n={C.shape[1]})")
A, U = (np.concatenate(per[k], axis=1) for k in ("al_linearised", "al_update"))
wins = 0
for j, key in enumerate(KEYS):
    d = U[j] - A[j]
    d = d[~np.isnan(d)]
    se = d.std(ddof=1) / np.sqrt(len(d))
    better = (-1 if key in LOWER else 1) * d.mean()
    wins += better > se
    print(f"update - linearised {key}: {d.mean():+.4f} ± {se:.4f} ({'update better' if better > se else 'not better by > 1 SE'})")
print(f"update better by > 1 SE on {wins} of 5 metrics -> default {'update' if wins >= 3 else 'linearised'}")
