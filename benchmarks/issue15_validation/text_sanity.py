"""Session 8: cascading randomisation (value component) of value-aware maps on the text benchmark's model.
`attnroll sanity` takes image models only; this calls `attnroll.evaluate.cascading_randomization` on the first
N held-out sentences (seed 12345), one call per token length so that no sentence is padded (padded positions
score 0 in both maps and would inflate the rank correlation). Usage:

    python text_sanity.py N SEEDS METHODS          # e.g. 64 0,1,2 rollout,alti,decompx,alti_logit
"""
import sys
import numpy as np
from attnroll.evaluate import cascading_randomization
from attnroll.models import evidence, load_model

n, seeds, methods = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], sys.argv[3].split(",")
lm = load_model("minilm-evidence")
ex = evidence.make_examples(n, 12345)
enc, _ = evidence.encode(lm.tokenizer, ex)
lengths = enc["attention_mask"].sum(-1)
groups = {int(k): (lengths == k).nonzero().flatten() for k in lengths.unique()}
steps, per = None, {m: [] for m in methods}
for seed in seeds:
    rows = {m: [] for m in methods}
    for k, idx in groups.items():
        sub = {key: v[idx][:, :k] for key, v in enc.items()}
        res = cascading_randomization(lm.model, sub, methods, component="value", seed=seed)
        steps = res.steps
        for m in methods:
            rows[m].append(res.per_example[m])  # (steps, examples of this length)
    for m in methods:
        per[m].append(np.nanmean(np.concatenate(rows[m], axis=1), axis=1))
print("step".ljust(12) + "".join(m.rjust(24) for m in methods))
for s, name in enumerate(steps):
    cells = []
    for m in methods:
        v = np.array([p[s] for p in per[m]])
        cells.append(f"{v.mean():.2f} ({v.min():.2f}..{v.max():.2f})".rjust(24))
    print(name.ljust(12) + "".join(cells))
