"""Which method should be the default for text? Every text-applicable method measured on real models.

Part 1, ``minilm-reviews`` (the shipped MiniLM review classifier, :mod:`attnroll.models.reviews`): ERASER
comprehensiveness ↑ and sufficiency ↓ (AOPC, :mod:`attnroll.evaluate.text`: top 1/5/10/20/50% of the word
tokens deleted or kept alone; [CLS] / [SEP] never removed), target = the predicted class, on

- a VALIDATION split: ``--val`` snippets of the training pool that the classifier never trained on (the pool
  is ``reviews.split``'s; pool[``--val-start``:] is its training script's validation slice, 4000:4100), on
  which the default is chosen, and
- the HELD-OUT split: the first ``--held`` of the shipped held-out snippets (``reviews.held_out()``, disjoint
  from the pool by construction), reported once, for the method chosen on validation and ``--held-methods``
  (``--held 0``: validation only).

Each split is sorted by token count and explained / scored in chunks of ``--batch`` (little padding).

Cost: seconds per explanation and its ratio to one forward + backward of the same batch (the predicted
logits' sum backpropagated into the weights), both timed side by side in this process on the same batches
(alternating, medians), one torch thread; ``/proc/loadavg`` is written beside them.

Part 2, the sentence encoder ``minilm`` (all-MiniLM-L6-v2, mean pooling): no class, so the target is the
retrieval score: the cosine similarity of the snippet's mean-pooled embedding to its nearest neighbour among
the split's other snippets (why was this match found?). Comprehensiveness / sufficiency: the drop of that
similarity when the top tokens are deleted / kept alone, same bins and deletion (``evaluate.text.repack``).

Choice: among the methods whose cost is at most ``--budget`` x forward + backward, the one with the highest
comprehensiveness − sufficiency on validation (both are probability drops; larger minus smaller is better).

Usage: python benchmarks/bench_text_defaults.py --snippets movieReviewSnippets_GroundTruth.txt [--val 100]
       [--held 200] [--enc 32] [--methods rollout,decompx] [--out benchmarks/text_defaults.json]
(the figures in EVALUATION.md: --methods every method but integrated_gradients; about an hour at load 9-16)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from attnroll import explain
from attnroll.evaluate.text import ERASER_BINS, comprehensiveness, repack, sufficiency
from attnroll.models import load_model, reviews

METHODS = ("decompx", "alti_logit", "gae", "grad_rollout", "rollout", "random", "alti", "globenc", "norm",
           "norm_rollout", "measured_rollout", "raw", "attn_gradcam", "per_head_rollout", "saliency",
           "input_x_gradient", "value_zeroing", "flow", "integrated_gradients")
#: chunks whose explanation time is paired with a forward + backward of the same chunk (alternating order)
TIMED_CHUNKS = 4


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[:3].__str__()


def encode(tok, texts):
    enc = tok(texts, padding=True, truncation=True, max_length=reviews.MAX_LENGTH, return_tensors="pt",
              return_special_tokens_mask=True)
    keep = enc.pop("special_tokens_mask").bool()
    return dict(enc), keep


def chunks(n, size):
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def fwd_bwd(model, inputs):
    out = model(**inputs)
    logits = out.logits if hasattr(out, "logits") else out.last_hidden_state.mean(dim=(1, 2))[:, None]
    logits.max(dim=-1).values.sum().backward()
    model.zero_grad(set_to_none=True)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run_method(model, tok, texts, method, batch, target=None, options=None):
    """(scores (B, n) over the padded whole-split encoding, seconds per explanation, ratio to fwd+bwd)."""
    enc, _ = encode(tok, texts)
    n = enc["input_ids"].shape[1]
    scores = torch.zeros(len(texts), n, dtype=torch.float64)
    t_m, t_fb = [], []
    for k, sl in enumerate(chunks(len(texts), batch)):
        part, _ = encode(tok, texts[sl])
        tg = None if target is None else target(sl)
        order = ((0, 1) if k % 2 == 0 else (1, 0)) if k < TIMED_CHUNKS else (0,)
        for which in order:
            if which == 0:
                dt, e = timed(lambda: explain(model, part, method=method, target=tg, tokenizer=tok, **(options or {})))
                t_m.append(dt / (sl.stop - sl.start))
            else:
                dt, _ = timed(lambda: fwd_bwd(model, part))
                t_fb.append(dt / (sl.stop - sl.start))
        s = e.full_row.to(torch.float64)
        scores[sl, : s.shape[1]] = s
    paired = statistics.median(t_m[:len(t_fb)])
    return scores, statistics.median(t_m), paired / statistics.median(t_fb)


def stats(v):
    v = np.asarray(v, dtype=np.float64)
    return {"mean": float(v.mean()), "se": float(v.std(ddof=1) / np.sqrt(len(v)))}


def classifier(args, texts_by_split, methods, save):
    lm = load_model("minilm-reviews")
    model, tok = lm.model, lm.tokenizer
    res = {}
    for split, (texts, labels) in texts_by_split.items():
        with torch.no_grad():
            prob = torch.cat([model(**encode(tok, texts[sl])[0]).logits.softmax(-1)
                              for sl in chunks(len(texts), args.batch)])
        res[split] = {"n": len(texts), "accuracy": float((prob.argmax(-1).numpy() == labels).mean()),
                      "mean_predicted_probability": float(prob.max(-1).values.mean()), "methods": {}}
    reused = json.loads(Path(args.reuse).read_text())["minilm_reviews"] if args.reuse else {}
    for split, (texts, _) in texts_by_split.items():  # every method on validation, then the held-out ones
        for m in methods:
            if split == "held_out" and m not in held_methods(res, args):
                continue
            old = reused.get(split, {})
            if old.get("n") == len(texts) and "comprehensiveness" in old.get("methods", {}).get(m, {}):
                res[split]["methods"][m] = old["methods"][m]  # measured by an earlier run on the same model
                continue
            lo = load()
            try:
                scores, sec, ratio = run_method(model, tok, texts, m, args.batch)
            except Exception as e:  # a refusal is a result: record it
                res[split]["methods"][m] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(split, m, "refused:", e, file=sys.stderr)
                continue
            comp, suff = aopc(model, tok, texts, scores, args.batch)
            res[split]["methods"][m] = {"comprehensiveness": stats(comp), "sufficiency": stats(suff),
                                        "s_per_explanation": sec, "x_forward_backward": ratio,
                                        "load_before": lo, "load_after": load()}
            r = res[split]["methods"][m]
            print(f"{split:10s} {m:22s} comp {r['comprehensiveness']['mean']:.3f} suff "
                  f"{r['sufficiency']['mean']:.3f}  {sec * 1e3:.1f} ms  {ratio:.2f}x  load {lo}", flush=True)
            save(res)
    return res


def aopc(model, tok, texts, scores, batch):
    """Per-example comprehensiveness and sufficiency (evaluate.text), a chunk of ``batch`` texts at a time
    (each chunk padded to its own longest: the texts are sorted by length, so little padding is scored)."""
    comp, suff = [], []
    for sl in chunks(len(texts), batch):
        enc, keep = encode(tok, texts[sl])
        s = scores[sl, : enc["input_ids"].shape[1]]
        comp.append(comprehensiveness(model, enc, s, keep=keep).per_example)
        suff.append(sufficiency(model, enc, s, keep=keep).per_example)
    return np.concatenate(comp), np.concatenate(suff)


def held_methods(res, args):
    """Methods measured on the held-out split: the one chosen on validation, and --held-methods."""
    extra = [m for m in args.held_methods.split(",") if m]
    return [choose_on(res["validation"]["methods"], args.budget), *extra]


def by_length(tok, s):
    """The snippets sorted by token count (stable), so that chunks pad little."""
    lengths = [len(tok(t, truncation=True, max_length=reviews.MAX_LENGTH)["input_ids"]) for t in s.texts]
    return s.subset(np.argsort(lengths, kind="stable"))


# ------------------------------------------------------------------------------------ sentence encoder
def embed(model, enc):
    h = model(**enc).last_hidden_state
    m = enc["attention_mask"].to(h.dtype)[..., None]
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def neighbours(model, tok, texts):
    enc, _ = encode(tok, texts)
    with torch.no_grad():
        e = embed(model, enc)
    sim = e @ e.T
    sim.fill_diagonal_(-2)
    return e[sim.argmax(1)]


def similarity_drop(model, enc, keep, scores, ref, kind):
    """Per example: mean over ERASER's bins of cos(x, ref) − cos(perturbed x, ref)."""
    ids, am = enc["input_ids"], enc["attention_mask"].bool()
    removable = am & ~keep
    key = torch.where(removable, scores, torch.full_like(scores, -torch.inf))
    rank = torch.argsort(torch.argsort(-key, dim=1, stable=True), dim=1)
    units = removable.sum(1)
    with torch.no_grad():
        base = (embed(model, enc) * ref).sum(-1)
        drops = []
        for q in ERASER_BINS:
            k = torch.clamp(torch.round(q * units.double()).long(), min=1)
            top = (rank < k[:, None]) & removable
            retain = (am & ~top) if kind == "comprehensiveness" else ((keep | top) & am)
            packed = repack(ids, retain, enc.get("token_type_ids"))
            drops.append(base - (embed(model, packed) * ref).sum(-1))
    return torch.stack(drops, 1).mean(1).numpy()


def encoder(args, texts_by_split, methods):
    lm = load_model("minilm")
    model, tok = lm.model, lm.tokenizer
    res = {}
    for split, (texts, _) in texts_by_split.items():
        texts = texts[:: max(1, len(texts) // args.enc)][: args.enc]  # spread over the lengths
        ref = neighbours(model, tok, texts)
        enc, keep = encode(tok, texts)

        def target(sl):
            r = ref[sl]
            return lambda out: (torch.nn.functional.normalize(
                (out.last_hidden_state * out_mask[0][..., None]).sum(1), dim=-1) * r).sum(-1)

        res[split] = {"n": len(texts), "methods": {}}
        for m in methods:
            if split == "held_out" and m not in held_methods(res, args):
                continue
            lo = load()
            out_mask = [None]
            try:
                scores, sec, ratio = run_encoder_method(model, tok, texts, m, args.batch, target, out_mask)
            except Exception as e:
                res[split]["methods"][m] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(split, "encoder", m, "refused:", e, file=sys.stderr)
                continue
            comp = similarity_drop(model, enc, keep, scores, ref, "comprehensiveness")
            suff = similarity_drop(model, enc, keep, scores, ref, "sufficiency")
            res[split]["methods"][m] = {"comprehensiveness": stats(comp), "sufficiency": stats(suff),
                                        "s_per_explanation": sec, "x_forward_backward": ratio,
                                        "load_before": lo, "load_after": load()}
            print(f"encoder {split:10s} {m:22s} comp {stats(comp)['mean']:.3f} suff {stats(suff)['mean']:.3f} "
                  f"{ratio:.2f}x", flush=True)
    return res


def run_encoder_method(model, tok, texts, method, batch, target, out_mask):
    """As run_method, with the retrieval target (the pooled embedding's cosine to the neighbour) and the
    mean readout (the model's pooling)."""
    def tg(sl):
        part, _ = encode(tok, texts[sl])
        out_mask[0] = part["attention_mask"].float()
        return target(sl)
    opts = {} if method in ("integrated_gradients", "saliency", "input_x_gradient", "random") else {"readout": "mean"}
    return run_method(model, tok, texts, method, batch, target=tg, options=opts)


def choose_on(results, budget):
    ok = {m: r for m, r in results.items() if "error" not in r and r["x_forward_backward"] <= budget and m != "random"}
    return max(ok, key=lambda m: ok[m]["comprehensiveness"]["mean"] - ok[m]["sufficiency"]["mean"])


def choose(res, budget):
    best = choose_on(res["validation"]["methods"], budget)
    held = res.get("held_out", {"methods": {}})["methods"]
    return {"method": best, "rule": f"max comprehensiveness - sufficiency on validation, cost <= {budget}x "
                                    "forward+backward", "held_out": held.get(best)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--snippets", required=True, help="movieReviewSnippets_GroundTruth.txt (vaderSentiment sdist)")
    p.add_argument("--val-start", "--train-size", dest="val_start", type=int, default=4000,
                   help="first validation snippet of the pool (the training script's --val-slice start)")
    p.add_argument("--val", type=int, default=100)
    p.add_argument("--held", type=int, default=200)
    p.add_argument("--held-methods", default="rollout,random,gae,alti_logit",
                   help="measured on held-out besides the one chosen on validation")
    p.add_argument("--enc", type=int, default=32, help="snippets per split for the sentence encoder (0: skip)")
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default="benchmarks/text_defaults.json")
    p.add_argument("--reuse", default=None,
                   help="a partial --out of an earlier run on the same model: its classifier results are kept")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    methods = [m for m in args.methods.split(",") if m]
    held, pool = reviews.split(reviews.parse_snippets(Path(args.snippets).read_text(encoding="utf-8")))
    shipped = reviews.held_out()
    assert set(held.ids.tolist()) == set(shipped.ids.tolist()), "held-out split differs from the shipped one"
    tok = load_model("minilm-reviews").tokenizer
    val = by_length(tok, pool.subset(range(args.val_start, args.val_start + args.val)))
    test = by_length(tok, shipped.subset(range(args.held)))
    assert not set(val.ids.tolist()) & set(test.ids.tolist())
    splits = {"validation": (val.texts, val.labels), "held_out": (test.texts, test.labels)}
    if not args.held:
        del splits["held_out"]
    out = {"machine": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
           "threads": 1, "bins": list(ERASER_BINS), "load_start": load(),
           "splits": {"validation": f"reviews.split pool[{args.val_start}:{args.val_start + args.val}] "
                                    "(never trained on)", "held_out": f"reviews.held_out()[:{args.held}]"}}
    def save(res):
        out["minilm_reviews"] = res
        Path(args.out).write_text(json.dumps(out, indent=1))

    out["minilm_reviews"] = classifier(args, splits, methods, save)
    out["minilm_reviews"]["choice"] = choose(out["minilm_reviews"], args.budget)
    Path(args.out).write_text(json.dumps(out, indent=1))
    if args.enc:
        out["minilm_encoder"] = encoder(args, splits, methods)
        out["minilm_encoder"]["choice"] = choose(out["minilm_encoder"], args.budget)
    out["load_end"] = load()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k]["choice"] for k in ("minilm_reviews", "minilm_encoder") if k in out}, indent=1))


if __name__ == "__main__":
    main()
