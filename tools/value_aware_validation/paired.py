"""Paired differences (candidate − reference) over the saved per-image scores of g2cands.py, pooled over seeds.

    python paired.py REF NAMES STEPS SEEDS        # e.g. rollout mr,top1_gae 16 777,778,779,780
"""
import os, sys
import numpy as np

KEYS = ['deletion', 'insertion', 'positive', 'negative', 'pointing', 'mass', 'iou']
ref, names, steps, seeds = sys.argv[1], sys.argv[2].split(','), sys.argv[3], sys.argv[4].split(',')
d = os.environ.get('VA_OUT', '/tmp')
load = lambda nm: np.concatenate([np.load(f'{d}/g2_{nm}_{s}_{steps}.npy') for s in seeds], axis=1)
R = load(ref)
print(f"{ref:14s} " + "  ".join(f"{k} {np.nanmean(R[i]):.4f}" for i, k in enumerate(KEYS)), f"(n={R.shape[1]})")
for nm in names:
    C = load(nm); diff = C - R
    cells = []
    for i, k in enumerate(KEYS):
        v = diff[i][~np.isnan(diff[i])]
        cells.append(f"{k} {np.nanmean(C[i]):.4f} ({v.mean():+.4f}±{v.std(ddof=1) / np.sqrt(len(v)):.4f})")
    print(f"{nm:14s} " + "  ".join(cells))
