"""`attnroll evaluate ARGS...` run once in-process, exactly as the command, that also keeps the
per-example scores (per_example.npz in --out) for paired differences, then prints candidate − reference
paired over the examples. Usage: python heldout.py REF CAND -- attnroll-evaluate-args..."""
import sys
import numpy as np
import attnroll.commands.evaluate as ev
from attnroll.commands import main

ref, cand, args = sys.argv[1], sys.argv[2], sys.argv[4:]
_orig = ev._write_results


def _write(out, result, meta):
    _orig(out, result, meta)
    np.savez(out / "per_example.npz", **{f"{m}__{k}": v for m, d in result.per_example.items() for k, v in d.items()})
    for k in result.metrics:
        d = result.per_example[cand][k] - result.per_example[ref][k]
        d = d[~np.isnan(d)]
        print(f"{k:18s} {ref} {result.values[ref][k]:.5f}  {cand} {result.values[cand][k]:.5f}  "
              f"paired {d.mean():+.5f} ± {d.std(ddof=1) / np.sqrt(len(d)):.5f} (n={len(d)})", flush=True)


ev._write_results = _write
sys.exit(main(args))
