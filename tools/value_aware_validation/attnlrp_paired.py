"""AttnLRP (lxt 2.1) on the 200 held-out shapes images, scored with `attnroll evaluate`'s own metrics
and paired per image against attnroll's methods. A MEASUREMENT: nothing is selected here.

    LXT_PATH=/work/pkgs-lrp VA_OUT=/tmp/lrp python attnlrp_paired.py      # ~4 min on 2 cores

BENCHMARK ONLY. lxt is not a dependency of attnroll and is never imported by the package or its tests (LRP is
patented per lxt's README, free only for personal and scientific use, so nothing of it ships). Install it
apart, without touching the environment's torch / transformers:
``pip install --no-deps --target DIR lxt==2.1`` and point LXT_PATH at DIR (default /work/pkgs-lrp).
lxt 2.1's ``lxt.efficient`` package cannot be imported whole on transformers 5 (its BERT model file imports
``transformers.modeling_attn_mask_utils``, which is gone), and it ships no rule map for transformers' ViT; so
only its two rule modules are loaded (``lxt.efficient.rules``, ``lxt.efficient.patches``) and their functions
are put on the shapes ViT's module *instances* of a float64 copy (the loaded model stays unpatched).

Pre-registered (committed before any held-out score of an LRP map was computed):
* The map "attnlrp": lxt 2.1's AttnLRP rules as its transformers rule maps (llama, gpt2, bert) apply them:
  every LayerNorm gets ``patches.layer_norm_forward`` (identity rule: the standard deviation detached), the
  MLP's GELU gets ``patches.non_linear_forward`` (identity rule through ``rules.identity_rule_implicit``), and
  attention gets the uniform rule of ``patches.wrap_attention_forward``: the gradient of the query and of the
  key divided by 4, of the value by 2 (``rules.divide_gradient``). lxt's ``patch_attention`` replaces
  transformers' attention registry with a plain dict, which transformers 5's ViT cannot call
  (``get_interface``), so the division is put on the outputs of ``q_proj`` / ``k_proj`` / ``v_proj`` (forward
  hooks): the same tensors as the wrapper's query / key / value up to a view and a transpose, which do not
  change a gradient scaling. Linear layers, the patch projection and the classifier: plain gradient x input
  (LRP-0); no zennit / gamma rules (lxt's torchvision-ViT recipe adds those; they need zennit, and the map is
  read above the patch projection anyway). Dropout is 0 (eval mode).
* Target: the logit of the class predicted on the clean image by the float32 model, exactly as
  `attnroll evaluate` picks it (its ``_predictions``); one backward from that logit (not the probability),
  batched (images do not interact in a ViT).
* Relevance read: at the output of ``vit.embeddings`` (CLS token, patch projections, position embeddings added:
  the input of block 0, where the rule-patched backward ends), R_t = sum_d e_td * g_td with g the patched
  backward's gradient; the map = R at the 64 patch tokens (1..64, row-major = the library's 8 x 8 grid),
  SIGNED (negative relevance = evidence against the class, ranked last, as every signed attnroll map).
* Diagnostics, reported, never used in the paired table: "cp_lrp" (lxt's CP-LRP variant: query and key
  detached, value undivided, as its torchvision-ViT map does inside attention), "attnlrp@proj" (read at the
  patch projection's output, before CLS and position embeddings: R minus the position embedding's share) and
  "|attnlrp|" (absolute value).
* Sanity, printed: the patched float64 copy's logits against the unpatched float64 and float32 models'; LRP
  conservation: sum of all 65 token relevances (CLS included) / target logit, per image (mean, median,
  quartiles, min, max), and the same at the patch projection.
* The table: attnlrp against decompx(start_layer=1), decompx (default), alti_logit, gae, grad_rollout,
  rollout, the 7 metrics: both means +- SE, paired mean difference (method - attnlrp) +- SE over the images
  where both are defined, and for pointing the exact McNemar test (scipy's binomtest on the discordant
  images). The library methods are run by ``evaluate_methods`` exactly as `attnroll evaluate` runs them; the
  LRP maps go through the same registered metrics with the same inputs (checked: rollout's map scored through
  that path equals ``evaluate_methods``' rollout per image).

Per-image scores go to $VA_OUT/attnlrp_paired.npz.
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time
import types
from typing import Any, Callable, Sequence

import numpy as np
import torch

KEYS = ("deletion", "insertion", "positive", "negative", "pointing", "mass", "iou")
LOWER = {"deletion", "positive"}
#: The library's side of the paired table: (label, method, options).
LIB = (("decompx(start_layer=1)", "decompx", {"start_layer": 1}), ("decompx", "decompx", {}),
       ("alti_logit", "alti_logit", {}), ("gae", "gae", {}), ("grad_rollout", "grad_rollout", {}),
       ("rollout", "rollout", {}))


# ----------------------------------------------------------------------------------------- pure pieces
def paired(ref: np.ndarray, cand: np.ndarray) -> dict[str, float]:
    """Means +- SE of ``ref`` and ``cand`` (each over its finite entries), and the paired difference cand - ref
    +- SE over the entries where both are finite; SE = sd (ddof=1) / sqrt(n)."""
    ref, cand = np.asarray(ref, dtype=np.float64), np.asarray(cand, dtype=np.float64)
    if ref.shape != cand.shape or ref.ndim != 1:
        raise ValueError(f"paired: ref and cand must be 1-d of one length, got {ref.shape} and {cand.shape}")

    def mse(v: np.ndarray) -> tuple[float, float, int]:
        v = v[np.isfinite(v)]
        if v.size < 2:
            raise ValueError(f"paired: fewer than 2 finite values ({v.size})")
        return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size)), int(v.size)

    both = np.isfinite(ref) & np.isfinite(cand)
    (mr, sr, nr), (mc, sc, nc), (md, sd, nd) = mse(ref), mse(cand), mse(cand[both] - ref[both])
    return dict(ref=mr, ref_se=sr, ref_n=nr, cand=mc, cand_se=sc, cand_n=nc, diff=md, diff_se=sd, n=nd)


def mcnemar(ref_hits: np.ndarray, cand_hits: np.ndarray) -> tuple[int, int, float]:
    """Exact McNemar on paired 0/1 outcomes: (b = cand hit & ref miss, c = ref hit & cand miss, two-sided p of
    b among b + c discordant pairs under Bin(b + c, 1/2); p = 1 with no discordant pair)."""
    from scipy.stats import binomtest

    r, c_ = np.asarray(ref_hits), np.asarray(cand_hits)
    if r.shape != c_.shape or not np.isin(r, (0, 1)).all() or not np.isin(c_, (0, 1)).all():
        raise ValueError("mcnemar: ref_hits and cand_hits must be 0/1 arrays of one shape (each hit 0 or 1)")
    r, c_ = r.astype(bool), c_.astype(bool)
    b, c = int((c_ & ~r).sum()), int((r & ~c_).sum())
    p = 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5).pvalue)
    return b, c, p


def ratio_summary(v: np.ndarray) -> str:
    q = np.percentile(v, [25, 50, 75])
    return (f"mean {v.mean():.3f}, median {q[1]:.3f}, quartiles {q[0]:.3f} / {q[2]:.3f}, "
            f"min {v.min():.3f}, max {v.max():.3f}")


# ----------------------------------------------------------------------------------------- lxt on the ViT
def import_lxt(path: str | None = None) -> tuple[Any, Any]:
    """lxt 2.1's rule modules (rules, patches), without running ``lxt.efficient``'s package init."""
    path = path or os.environ.get("LXT_PATH", "/work/pkgs-lrp")
    if not os.path.isdir(os.path.join(path, "lxt")):
        raise SystemExit(f"lxt not found under {path}: pip install --no-deps --target {path} lxt==2.1")
    from importlib.metadata import distributions

    versions = [d.version for d in distributions(path=[path]) if d.metadata["Name"] == "lxt"]
    if versions != ["2.1"]:
        raise SystemExit(f"lxt 2.1 expected under {path}, found {versions}")
    sys.path.insert(0, path)
    import lxt

    pkg = types.ModuleType("lxt.efficient")
    pkg.__path__ = [os.path.join(os.path.dirname(lxt.__file__), "efficient")]
    sys.modules["lxt.efficient"] = pkg
    from lxt.efficient import patches, rules

    return rules, patches


def patch_vit(model: Any, *, layer_norm: Callable, act: Callable, qkv: Callable[[str], Callable] | None) -> Any:
    """A float64 copy of a transformers ViT classifier with the rules put on its module instances:
    ``layer_norm`` (a forward taking (self, x)) on every LayerNorm, ``act`` (a forward (self, x) that calls
    ``self.original_forward``) on each block's MLP activation, and ``qkv(name)`` for name in q, k, v: a function
    of the projection's output (None: attention untouched). The model given is not changed."""
    p = copy.deepcopy(model).double().eval()
    for mod in p.modules():
        if isinstance(mod, torch.nn.LayerNorm):
            mod.forward = types.MethodType(layer_norm, mod)
    seen = set()
    for layer in p.vit.layers:
        a = layer.mlp.activation_fn
        if id(a) not in seen:  # one activation instance may serve several blocks
            seen.add(id(a))
            a.original_forward = a.forward
            a.forward = types.MethodType(act, a)
        if qkv is not None:
            att = layer.attention
            for name, lin in (("q", att.q_proj), ("k", att.k_proj), ("v", att.v_proj)):
                fn = qkv(name)
                lin.register_forward_hook(lambda m, i, o, fn=fn: fn(o))
    return p


def lxt_rule_maps(rules: Any, patches: Any) -> dict[str, dict]:
    """The two lxt variants as patch_vit arguments."""
    common = dict(layer_norm=patches.layer_norm_forward, act=patches.non_linear_forward)
    div = {"q": 4, "k": 4, "v": 2}
    return {"attnlrp": dict(common, qkv=lambda n: (lambda o: rules.divide_gradient(o, div[n]))),
            "cp_lrp": dict(common, qkv=lambda n: (rules.stop_gradient if n in "qk" else (lambda o: o)))}


def token_relevance(p: Any, x: torch.Tensor, target: torch.Tensor, chunk: int = 50) -> dict[str, torch.Tensor]:
    """One backward from the target logit through ``p`` (a patched copy): per image the relevance at the
    embeddings' output (B, 65), at the patch projection's output (B, 64), the logits (B, C) and the target logit
    (B,), in the copy's dtype (float64 from patch_vit)."""
    out = {k: [] for k in ("emb", "proj", "logits", "y")}
    for lo in range(0, x.shape[0], chunk):
        store = {}
        h1 = p.vit.embeddings.register_forward_hook(lambda m, i, o: store.__setitem__("e", o))
        h2 = p.vit.embeddings.patch_embeddings.register_forward_hook(lambda m, i, o: store.__setitem__("p", o))
        try:
            with torch.enable_grad():
                logits = p(pixel_values=x[lo:lo + chunk].double()).logits
                y = logits.gather(1, target[lo:lo + chunk, None])[:, 0]
                ge, gp = torch.autograd.grad(y.sum(), [store["e"], store["p"]])
        finally:
            h1.remove()
            h2.remove()
        out["emb"].append((store["e"] * ge).sum(-1).detach())
        out["proj"].append((store["p"] * gp).sum(-1).detach())
        out["logits"].append(logits.detach())
        out["y"].append(y.detach())
    return {k: torch.cat(v) for k, v in out.items()}


# ----------------------------------------------------------------------------------------- the benchmark
def setup() -> dict:
    """`attnroll evaluate`'s defaults, as its command builds them: shapes model, 200 held-out images (seed
    12345), patch masks, black fill, the predicted class."""
    from attnroll.commands._data import fill_tensor, load_data, load_eval_model
    from attnroll.evaluate.suite import _predictions
    from attnroll.models.shapes import patch_masks

    lm = load_eval_model("shapes")
    d = load_data("shapes", lm, 200, 12345)
    masks = patch_masks(d["masks"])
    fill = fill_tensor("black", lm, d["x"])
    logits = _predictions(lm.model, d["x"], "image", 64)
    return dict(lm=lm, x=d["x"], labels=d["labels"], masks=masks, fill=fill, logits=logits, target=logits.argmax(1))


def score_map(st: dict, scores: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-image scores of a (B, 64) map with the registered metrics, the inputs evaluate_methods hands them."""
    from attnroll.evaluate.registry import MetricInputs, metric_info

    inp = MetricInputs(st["lm"].model, st["x"], st["target"].tolist(), st["masks"], 64,
                       {"fill": st["fill"], "steps": None, "bins": None, "keep": None})
    s = scores.detach().to(torch.float32).cpu()
    with torch.no_grad():
        return {k: np.asarray(metric_info(k).compute(inp, s, (8, 8)).per_example, dtype=np.float64) for k in KEYS}


def run_library(st: dict) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, float]]:
    """The library methods' per-image scores, by evaluate_methods (one call per option set), and seconds."""
    from attnroll.evaluate.suite import evaluate_methods

    per, secs = {}, {}
    groups: dict[tuple, list] = {}
    for label, name, opts in LIB:
        groups.setdefault(tuple(sorted(opts.items())), []).append((label, name))
    for opts, items in groups.items():
        names = [n for _, n in items]
        r = evaluate_methods(st["lm"].model, st["x"], names, labels=st["labels"], masks=st["masks"],
                             fill=st["fill"], batch_size=64, method_options={n: dict(opts) for n in names if opts})
        for label, name in items:
            per[label] = {k: r.per_example[name][k] for k in KEYS}
            secs[label] = r.seconds[name]
    return per, secs


def check_scoring_path(st: dict, lib_rollout: dict[str, np.ndarray]) -> None:
    """rollout's map scored by score_map must equal evaluate_methods' rollout per image."""
    from attnroll.evaluate.suite import explain_scores

    s, _ = explain_scores(st["lm"].model, st["x"], "rollout", target=st["target"].tolist(), batch_size=64)
    mine = score_map(st, s)
    bad = [k for k in KEYS if not np.array_equal(mine[k], lib_rollout[k], equal_nan=True)]
    if bad:
        raise SystemExit(f"score_map differs from evaluate_methods for rollout on {bad}")
    print("scoring path: rollout through score_map == evaluate_methods' rollout, every metric, every image")


def fmt(k: str, v: float) -> str:
    """The table's format: positive / negative are already percentages (x100), one decimal."""
    return f"{v:.1f}" if k in ("positive", "negative") else f"{v:.3f}"


def table(lrp: dict[str, np.ndarray], lib: dict[str, dict[str, np.ndarray]]) -> None:
    print("\npaired against attnlrp (difference = method - attnlrp; positive/negative in %; SE over images)")
    for k in KEYS:
        print(f"\n{k} ({'lower' if k in LOWER else 'higher'} is better)")
        for label in lib:
            r = paired(lrp[k], lib[label][k])
            line = (f"  {label:24s} {fmt(k, r['cand'])} ± {fmt(k, r['cand_se'])}  attnlrp {fmt(k, r['ref'])} ± "
                    f"{fmt(k, r['ref_se'])}  diff {'+' if r['diff'] >= 0 else '-'}{fmt(k, abs(r['diff']))} ± "
                    f"{fmt(k, r['diff_se'])} ({r['diff'] / r['diff_se']:+.1f} SE, n={r['n']})")
            a, b = lrp[k], lib[label][k]
            ok = np.isfinite(a) & np.isfinite(b)
            better = (b[ok] < a[ok]) if k in LOWER else (b[ok] > a[ok])
            worse = (b[ok] > a[ok]) if k in LOWER else (b[ok] < a[ok])
            line += f"  images method better {int(better.sum())}, worse {int(worse.sum())}"
            if k == "pointing":
                b, c, p = mcnemar(lrp[k], lib[label][k])
                line += f"  McNemar: method only {b}, attnlrp only {c}, p={p:.3g}"
            print(line, flush=True)


def main() -> None:
    torch.set_num_threads(1)
    out = os.environ.get("VA_OUT", "/tmp")
    rules, patches = import_lxt()
    t0 = time.time()
    st = setup()
    lm = st["lm"]
    print(f"model {lm.name}: {lm.model.config.num_hidden_layers} blocks, hidden {lm.model.config.hidden_size}, "
          f"attn {lm.model.config._attn_implementation}; 200 images, accuracy "
          f"{(st['target'] == torch.as_tensor(st['labels'])).float().mean():.3f}")

    # ---- the LRP maps and their sanity checks
    with torch.no_grad():
        ref64 = copy.deepcopy(lm.model).double()(pixel_values=st["x"].double()).logits
    maps, rel = {}, {}
    for variant, kw in lxt_rule_maps(rules, patches).items():
        t1 = time.time()
        R = token_relevance(patch_vit(lm.model, **kw), st["x"], st["target"])
        secs = time.time() - t1
        rel[variant] = R
        print(f"\n{variant}: {secs:.2f} s for 200 images; patched float64 logits vs unpatched float64: max |diff| "
              f"{(R['logits'] - ref64).abs().max():.2e}, vs the float32 model: "
              f"{(R['logits'] - st['logits'].double()).abs().max():.2e}")
        y = R["y"]
        print(f"  conservation, sum of the 65 token relevances / target logit: {ratio_summary((R['emb'].sum(1) / y).numpy())}")
        print(f"  the same at the patch projection (64 tokens): {ratio_summary((R['proj'].sum(1) / y).numpy())}")
        print(f"  CLS token's share of the logit: {ratio_summary((R['emb'][:, 0] / y).numpy())}; target logit "
              f"{ratio_summary(y.numpy())}")
        maps[variant] = R["emb"][:, 1:]
        if variant == "attnlrp":
            maps["attnlrp@proj"] = R["proj"]
            maps["|attnlrp|"] = R["emb"][:, 1:].abs()
    p32 = patch_vit(lm.model, **lxt_rule_maps(rules, patches)["attnlrp"]).float()
    m32 = token_relevance(p32, st["x"], st["target"])["emb"][:, 1:]
    same = bool((m32.argsort(1, descending=True) == maps["attnlrp"].argsort(1, descending=True)).all())
    print(f"attnlrp in a float32 copy: max |diff| {(m32 - maps['attnlrp']).abs().max():.2e}; same patch order on "
          f"every image: {same}")
    d = (maps["attnlrp"].double() - maps["attnlrp@proj"].double()).abs().max()
    print(f"\nattnlrp at embeddings vs at the projection: max |diff| {d:.3g} (the position embeddings' share)")

    # ---- scores
    lrp = {}
    for name, m in maps.items():
        lrp[name] = score_map(st, m)
        print(f"{name:16s} " + "  ".join(f"{k} {fmt(k, np.nanmean(v))}" for k, v in lrp[name].items()), flush=True)
    lib, secs = run_library(st)
    check_scoring_path(st, lib["rollout"])
    from attnroll.evaluate.suite import explain_scores

    dx, _ = explain_scores(lm.model, st["x"], "decompx", target=st["target"].tolist(), batch_size=64)
    same = bool((dx.argsort(1, descending=True) == maps["cp_lrp"].argsort(1, descending=True)).all())
    print(f"cp_lrp vs attnroll's decompx (default) map: max |diff| {(maps['cp_lrp'] - dx.double()).abs().max():.2e} "
          f"(largest |score| {dx.abs().max():.2f}); same patch order on every image: {same}")
    for label in lib:
        print(f"{label:24s} " + "  ".join(f"{k} {fmt(k, np.nanmean(v))}" for k, v in lib[label].items())
              + f"  ({secs[label]:.2f} s)")
    np.savez(f"{out}/attnlrp_paired.npz", target=st["target"].numpy(),
             **{f"{n}__{k}": v for n, d_ in {**lrp, **lib}.items() for k, v in d_.items()},
             **{f"rel_{v}_{k}": t.numpy() for v, R in rel.items() for k, t in R.items()})
    table(lrp["attnlrp"], lib)
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
