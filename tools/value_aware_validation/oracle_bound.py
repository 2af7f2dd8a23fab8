"""Are the two shapes goals (G1: beat rollout on every metric; G2: beat AttnLRP's deletion / positive
perturbation with top-k IoU >= 0.70) reachable at all? DIAGNOSTICS, not methods: the orders below
query the model (and the IoU-constrained ones read the ground-truth mask), so no explanation method can use
them; they bound what a patch ranking can score on the benchmark's own metrics.

    python oracle_bound.py greedy SEEDS N VARIANTS [STOP [LO-HI]]  # e.g. greedy 777 200 u,c 0.01;
                                                            # greedy 12345 200 u None 0-100 (images 0-99)
    python oracle_bound.py summary TAGS                     # e.g. summary 12345_200_None_0-100,12345_200_None_100-200
    python oracle_bound.py hybrid TAGS TAU [BASE]           # greedy picks until p < TAU, then BASE's order
    python oracle_bound.py pointing                         # G1: pointing hits on the 200 held-out images

Greedy deletion order (per image, the benchmark's black fill, the target = the class predicted on the clean
image, as `attnroll evaluate` does): at step t remove the patch whose removal (together with the t patches
already removed) gives the lowest target probability. Constrained: the first m patches (m = the object's
size in patches, the k of the top-k IoU metric) may hold at most floor(3m/17) background patches, which is
exactly IoU >= 0.70 (IoU = I / (2m - I) >= 0.7  <=>  17 I >= 14 m); greedy among the allowed patches, then
greedy on the rest. With STOP an image stops re-querying once its target probability is below STOP and takes
the rest of its order from its last query (a one-shot ranking); the scores stay exact, the order is just a
weaker oracle. Variant o stops after the first query: the patches ranked by the target probability with each
removed alone, i.e. occlusion with the black fill (64 queries, no mask: a model-querying map). Variant wW
(e.g. w4) is mask-free: greedy among the first W remaining patches of rollout's order (rollout re-ordered
locally by the model's answers, at most W queries a step, no STOP). Per-image
scores go to $VA_OUT/ob_{variant}_{seed}_{n}_{stop}[_{lo}-{hi}].npz (orders, probabilities, and deletion,
positive, iou, insertion per image; variant u = unconstrained, c = constrained, o = occlusion, wW = windowed).
"""
from __future__ import annotations

import math
import os
import sys
from typing import Callable, Sequence

import numpy as np
import torch

KEYS = ("deletion", "positive", "iou", "insertion")


# ----------------------------------------------------------------------------------------- pure pieces
def iou_allowance(m: torch.Tensor) -> torch.Tensor:
    """The most background patches a top-m set may hold with IoU >= 0.70 against an m-patch mask:
    floor(3m / 17) (integer arithmetic, no float threshold)."""
    return (3 * m) // 17


def order_to_scores(order: torch.Tensor) -> torch.Tensor:
    """(B, U) unit orders (first = most relevant) -> scores U - rank, distinct, so every metric's
    relevance order (ties by position) reproduces the order exactly."""
    B, U = order.shape
    s = torch.empty(B, U, dtype=torch.float64)
    s.scatter_(1, order, torch.arange(U, 0, -1, dtype=torch.float64).expand(B, U).contiguous())
    return s


def _allowed(removed: torch.Tensor, in_mask: torch.Tensor, bg_used: torch.Tensor, allow: torch.Tensor,
             m: torch.Tensor, t: int) -> torch.Tensor:
    """Patches that may be removed at step t: not yet removed, and no background once the top-m set's
    background budget is spent (only while t < m)."""
    closed = (bg_used >= allow) & (t < m)
    return ~removed & ~(closed[:, None] & ~in_mask)


def in_window(removed: torch.Tensor, base_order: torch.Tensor, width: int) -> torch.Tensor:
    """(B, U) bool: the first ``width`` units of ``base_order`` (B, U) that are not yet removed."""
    left = (~removed).gather(1, base_order)
    first = left & (left.long().cumsum(1) <= width)
    out = torch.zeros_like(removed)
    out.scatter_(1, base_order, first)
    return out


def greedy_orders(prob_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], in_mask: torch.Tensor,
                  allow: torch.Tensor | None = None, stop: float | None = None, chunk: int = 4096,
                  window: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy deletion orders for B images of U units, batched over images and candidates.

    Args:
        prob_fn: (ex (n,) long, removed (n, U) bool) -> (n,) the target probability of image ex with those
            units removed.
        in_mask: (B, U) bool, the object's units; m = in_mask.sum(1) is the top-k set's size.
        allow: (B,) long, the most background units among the first m (None: unconstrained).
        stop: freeze an image's candidate probabilities once its current probability is below this.
        window: (base_order (B, U), width): pick only among the first ``width`` remaining units of a map's
            order (mask-free: the map's order re-ordered locally by the model's answers).
    Returns:
        orders (B, U) long (first = removed first), probs (B, U + 1) float64: the target probability of the
        prefix removed after each step (probs[:, 0] = clean; exact for queried steps, the last query's
        estimate for a frozen image).
    """
    B, U = in_mask.shape
    m = in_mask.sum(1)
    allow = m.clone() if allow is None else allow
    removed = torch.zeros(B, U, dtype=torch.bool)
    bg_used = torch.zeros(B, dtype=torch.long)
    cand = torch.full((B, U), math.inf, dtype=torch.float64)
    orders = torch.empty(B, U, dtype=torch.long)
    probs = torch.empty(B, U + 1, dtype=torch.float64)
    probs[:, 0] = prob_fn(torch.arange(B), removed).double()
    frozen = torch.zeros(B, dtype=torch.bool)
    rows = torch.arange(B)
    for t in range(U):
        ok = _allowed(removed, in_mask, bg_used, allow, m, t)
        if window is not None:
            ok &= in_window(removed, *window)
        ask = ok & ~frozen[:, None]
        ex, unit = ask.nonzero(as_tuple=True)
        for i in range(0, len(ex), chunk):
            e, u = ex[i:i + chunk], unit[i:i + chunk]
            trial = removed[e].clone()
            trial[torch.arange(len(e)), u] = True
            cand[e, u] = prob_fn(e, trial).double()
        pick = torch.where(ok, cand, torch.full_like(cand, math.inf)).argmin(1)  # ties: the lowest index
        orders[:, t] = pick
        probs[:, t + 1] = cand[rows, pick]
        bg_used += ((~in_mask[rows, pick]) & (t < m)).long()
        removed[rows, pick] = True
        cand[rows, pick] = math.inf
        if stop is not None:
            frozen |= probs[:, t + 1] < stop
    return orders, probs


def mix_for_iou(cost_a: np.ndarray, iou_a: np.ndarray, cost_b: np.ndarray, iou_b: np.ndarray,
                level: float = 0.70) -> tuple[np.ndarray, float]:
    """Per image, order a or order b, minimising the mean cost subject to mean IoU >= level (a 0/1 knapsack).

    Each image starts from its higher-IoU option (the cheaper on a tie); switching to the other saves
    ``save`` and loses ``lose`` >= 0 IoU. Switches that save cost and lose nothing are free; the rest are
    taken by best saving per IoU lost, each one that still fits (greedy by ratio). Returns (use_b (B,) bool,
    the LP relaxation's mean cost: fractional knapsack, a lower bound of the exact 0/1 optimum)."""
    cost_a, iou_a, cost_b, iou_b = (np.asarray(v, dtype=np.float64) for v in (cost_a, iou_a, cost_b, iou_b))
    B = len(cost_a)
    base_b = (iou_b > iou_a) | ((iou_b == iou_a) & (cost_b < cost_a))
    c0, i0 = np.where(base_b, cost_b, cost_a), np.where(base_b, iou_b, iou_a)
    save, lose = c0 - np.where(base_b, cost_a, cost_b), i0 - np.where(base_b, iou_a, iou_b)
    slack = i0.sum() - level * B
    if slack < -1e-9:
        raise ValueError(f"even the higher-IoU order per image has mean IoU {i0.mean():.4f} < level={level}")
    switch = (save > 0) & (lose == 0)
    idx = np.nonzero((save > 0) & (lose > 0))[0]
    idx = idx[np.argsort(-(save[idx] / lose[idx]), kind="stable")]
    lp, room = c0.sum() - save[switch].sum(), slack
    for i in idx:  # the LP: ratio order, the first item that does not fit taken fractionally
        take = min(1.0, max(room, 0.0) / lose[i])
        lp -= take * save[i]
        room -= take * lose[i]
        if take < 1.0:
            break
    for i in idx:  # the 0/1 choice: every item that still fits, in ratio order
        if lose[i] <= slack + 1e-12:
            switch[i] = True
            slack -= lose[i]
    return switch ^ base_b, lp / B


def picks_until(probs: torch.Tensor, tau: float) -> torch.Tensor:
    """(B,) the number of greedy picks up to and including the first whose target probability (probs
    (B, U + 1), probs[:, 0] clean) is below tau; U where none is."""
    below = probs[:, 1:] < tau
    return torch.where(below.any(1), below.float().argmax(1) + 1, torch.full((probs.shape[0],), below.shape[1]))


def prefix_then(orders: torch.Tensor, probs: torch.Tensor, tau: float, scores: torch.Tensor) -> torch.Tensor:
    """A mask-free hybrid order: each image's greedy picks up to and including the first step whose target
    probability is below ``tau`` (all of them if none is), then the other units in ``scores``' relevance
    order (ties by position). orders (B, U), probs (B, U + 1) from :func:`greedy_orders`; scores (B, U)."""
    from attnroll.evaluate._common import relevance_order

    B, U = orders.shape
    r = picks_until(probs, tau)
    rest = relevance_order(scores)
    out = torch.empty_like(orders)
    for b in range(B):
        head = orders[b, : int(r[b])]
        taken = torch.zeros(U, dtype=torch.bool)
        taken[head] = True
        out[b] = torch.cat([head, rest[b][~taken[rest[b]]]])
    return out


# ----------------------------------------------------------------------------------------- the model
def make_prob_fn(fwd: Callable, x: torch.Tensor, fill: torch.Tensor, target: torch.Tensor,
                 grid: tuple[int, int] = (8, 8)) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """prob_fn for :func:`greedy_orders`: image ex with the removed patches replaced by ``fill`` (C, H, W),
    built as `attnroll.evaluate`'s perturbation engine builds its copies, -> softmax probability of target."""
    h, w = grid
    H, W = x.shape[-2:]

    def prob(ex: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
        msk = removed.view(-1, h, w).repeat_interleave(H // h, 1).repeat_interleave(W // w, 2)[:, None]
        with torch.no_grad():
            logits = fwd(torch.where(msk, fill, x[ex])).double()
        return torch.softmax(logits, 1).gather(1, target[ex][:, None])[:, 0]

    return prob


def bench_setup(seed: int, n: int):
    """The benchmark's images, patch masks, black fill, model forward and predicted targets."""
    from attnroll.commands._data import fill_tensor
    from attnroll.evaluate._common import image_forward
    from attnroll.models import load_model
    from attnroll.models.shapes import make_dataset, patch_masks, preprocess

    lm = load_model("shapes")
    lm.model.eval()
    images, labels, masks = make_dataset(n, seed)
    x = preprocess(images)
    fwd = image_forward(lm.model)
    with torch.no_grad():
        target = fwd(x).argmax(1)
    pm = patch_masks(masks).reshape(n, -1)
    return dict(lm=lm, x=x, labels=labels, masks=pm, fill=fill_tensor("black", lm, x), fwd=fwd, target=target,
                pixel_masks=masks)


def score_orders(st: dict, orders: torch.Tensor, metrics: Sequence[str] = KEYS) -> dict[str, np.ndarray]:
    """Per-image scores of the orders' maps with the benchmark's registered metrics (full steps, black fill)."""
    from attnroll.evaluate.registry import MetricInputs, metric_info

    inp = MetricInputs(st["lm"].model, st["x"], st["target"].tolist(), st["masks"].view(-1, 8, 8), 64,
                       {"fill": st["fill"], "steps": None, "bins": None, "keep": None})
    s = order_to_scores(orders).float()
    with torch.no_grad():
        return {k: np.asarray(metric_info(k).compute(inp, s, (8, 8)).per_example, dtype=np.float64)
                for k in metrics}


# ----------------------------------------------------------------------------------------- commands
def rollout_order(st: dict) -> torch.Tensor:
    """(B, 64) rollout's relevance order on the setup's images (ties by position, as every metric)."""
    from attnroll import explain
    from attnroll.evaluate._common import relevance_order

    e = explain(st["lm"].model, st["x"], "rollout", target=st["target"].tolist())
    return relevance_order(e.scores.detach().double())


def subset(st: dict, lo: int, hi: int) -> dict:
    """The setup restricted to images lo .. hi - 1 (the model, fill and forward shared)."""
    return {k: (v[lo:hi] if k in ("x", "labels", "masks", "target", "pixel_masks") else v) for k, v in st.items()}


def run_greedy(seed: int, n: int, variants: Sequence[str], stop: float | None, out: str,
               part: tuple[int, int] | None = None) -> None:
    """Greedy orders ("u" unconstrained, "c" IoU-constrained) for make_dataset(n, seed) (images part[0] ..
    part[1] - 1 of it, to keep one run short), scored, saved."""
    import time

    st = bench_setup(seed, n)
    lo, hi = part or (0, n)
    st = subset(st, lo, hi)
    prob = make_prob_fn(st["fwd"], st["x"], st["fill"], st["target"])
    allow = {"u": None, "c": iou_allowance(st["masks"].sum(1))}
    for v in variants:
        t0 = time.time()
        vstop = math.inf if v == "o" else None if v[0] == "w" else stop  # o: black-fill occlusion's ranking
        window = (rollout_order(st), int(v[1:])) if v[0] == "w" else None
        orders, probs = greedy_orders(prob, st["masks"], allow.get(v), vstop, window=window)
        sc = score_orders(st, orders)
        tag = f"{v}_{seed}_{n}_{vstop}" + (f"_{lo}-{hi}" if part else "")
        np.savez(f"{out}/ob_{tag}.npz", orders=orders.numpy(), probs=probs.numpy(), target=st["target"].numpy(),
                 labels=np.asarray(st["labels"]), masks=st["masks"].numpy(), **sc)
        print(f"{tag}: " + "  ".join(f"{k} {sc[k].mean():.4f}" for k in KEYS)
              + f"  (images with IoU >= 0.70: {(sc['iou'] >= 0.7 - 1e-12).mean():.3f}; {time.time() - t0:.0f} s)",
              flush=True)


def run_hybrid(tags: Sequence[str], tau: float, out: str, base: str = "rollout") -> None:
    """The saved unconstrained greedy runs (tags 'SEED_N_STOP[_LO-HI]'), their picks until the target
    probability is below tau, then ``base``'s map: scored with the benchmark's metrics, pooled, printed."""
    from attnroll import explain

    pooled: dict[str, list] = {k: [] for k in KEYS}
    for t in tags:
        f = np.load(f"{out}/ob_u_{t}.npz")
        seed, n, lo, hi = _parse_tag(t)
        st = subset(bench_setup(seed, n), lo, hi)
        assert np.array_equal(f["target"], st["target"].numpy()), "the saved run is of other images"
        with torch.enable_grad():
            s = explain(st["lm"].model, st["x"], base, target=st["target"].tolist()).scores.detach().double()
        orders = prefix_then(torch.as_tensor(f["orders"]), torch.as_tensor(f["probs"]), tau, s)
        for k, v in score_orders(st, orders).items():
            pooled[k].append(v)
        r = picks_until(torch.as_tensor(f["probs"]), tau)
        print(f"{t}: greedy picks kept: median {float(r.median()):.0f}, mean {float(r.float().mean()):.1f}, "
              f"on the object {float(np.mean([st['masks'][b, orders[b, :r[b]]].float().mean() for b in range(len(r))])):.3f}",
              flush=True)
    sc = {k: np.concatenate(v) for k, v in pooled.items()}
    print(f"greedy until p < {tau}, then {base}: "
          + "  ".join(f"{k} {sc[k].mean():.4f} ± {sc[k].std(ddof=1) / np.sqrt(len(sc[k])):.4f}" for k in KEYS)
          + f"  (n={len(sc['iou'])}; images with IoU >= 0.70: {(sc['iou'] >= 0.7 - 1e-12).mean():.3f})")


def _parse_tag(t: str) -> tuple[int, int, int, int]:
    """'SEED_N_STOP[_LO-HI]' -> seed, n, lo, hi."""
    f = t.split("_")
    lo, hi = (int(v) for v in f[3].split("-")) if len(f) > 3 else (0, int(f[1]))
    return int(f[0]), int(f[1]), lo, hi


def summarise(tags: Sequence[str], out: str) -> None:
    """Pool saved runs (tags 'SEED_N_STOP', pooled in order) and print each variant's means and the
    per-image mix of the two orders at mean IoU >= 0.70 (minimising deletion, then positive)."""
    d = {v: {k: np.concatenate([np.load(f"{out}/ob_{v}_{t}.npz")[k] for t in tags]) for k in KEYS} for v in "uc"}
    names = {"u": "unconstrained greedy", "c": "greedy, top-k IoU >= 0.70 per image", "o": "occlusion (one query)"}
    occ = [f"{out}/ob_o_" + "_".join(t.split("_")[:2] + ["inf"] + t.split("_")[3:]) + ".npz" for t in tags]
    if all(os.path.exists(f) for f in occ):
        d["o"] = {k: np.concatenate([np.load(f)[k] for f in occ]) for k in KEYS}
    for v, name in ((v, names[v]) for v in d):
        se = {k: d[v][k].std(ddof=1) / np.sqrt(len(d[v][k])) for k in KEYS}
        print(f"{name:38s} " + "  ".join(f"{k} {d[v][k].mean():.4f} ± {se[k]:.4f}" for k in KEYS)
              + f"  (n={len(d[v]['iou'])})")
    for cost in ("deletion", "positive"):
        use_u, lp = mix_for_iou(d["c"][cost], d["c"]["iou"], d["u"][cost], d["u"]["iou"])
        mixed = {k: np.where(use_u, d["u"][k], d["c"][k]) for k in KEYS}
        print(f"mix minimising {cost:9s}: {use_u.sum()} images unconstrained; "
              + "  ".join(f"{k} {mixed[k].mean():.4f}" for k in KEYS) + f"  (LP bound on {cost} {lp:.4f})")


#: G1's pointing comparison: rollout, every value-aware map (with the shipped options held out before), and
#: the gradient-weighted attention maps for reference.
POINTING_METHODS = (("rollout", {}), ("measured_rollout", {}), ("measured_rollout", {"class_blocks": 1}),
                    ("norm", {}), ("norm_rollout", {}), ("globenc", {}), ("alti", {}), ("alti_logit", {}),
                    ("value_zeroing", {}), ("decompx", {}), ("decompx", {"start_layer": 1}), ("raw", {}),
                    ("gae", {}), ("grad_rollout", {}))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b, c discordant pairs; P(X <= min(b, c)) doubled, X ~ Bin(b + c, 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def method_hits(st: dict) -> dict[str, np.ndarray]:
    """Pointing hits (B,) bool per method of POINTING_METHODS on the setup's images (predicted class)."""
    from attnroll import explain
    from attnroll.evaluate.localisation import pointing_game

    hits = {}
    for name, opts in POINTING_METHODS:
        label = name + "".join(f"({k}={v})" for k, v in opts.items())
        e = explain(st["lm"].model, st["x"], name, target=st["target"].tolist(), **opts)
        hits[label] = np.asarray(pointing_game(e.scores.detach().double(), st["masks"]))
        hits[label + "#argmax"] = e.scores.detach().double().argmax(1).numpy()
    return hits


def single_removal_top(st: dict) -> np.ndarray:
    """Per image, the patch whose removal alone lowers the target probability most (the greedy's first pick)."""
    prob = make_prob_fn(st["fwd"], st["x"], st["fill"], st["target"])
    B, U = st["masks"].shape
    ex = torch.arange(B).repeat_interleave(U)
    removed = torch.eye(U, dtype=torch.bool).repeat(B, 1)
    p = torch.cat([prob(ex[i:i + 4096], removed[i:i + 4096]) for i in range(0, B * U, 4096)])
    return p.view(B, U).argmin(1).numpy()


def _near(mask: np.ndarray, u: int) -> int:
    """Chebyshev distance in patches from unit u to the nearest object patch (8 x 8 grid)."""
    r, c = divmod(int(u), 8)
    return min(max(abs(r - i // 8), abs(c - i % 8)) for i in np.nonzero(mask)[0])


def report_pointing(seed: int = 12345, n: int = 200) -> None:
    """G1: held-out pointing hits per method (count, the images missed, exact McNemar against rollout), the
    images both rollout and measured_rollout(class_blocks=1) miss, described, and what no map hits."""
    st = bench_setup(seed, n)
    hits = method_hits(st)
    ref, k1 = hits["rollout"], hits["measured_rollout(class_blocks=1)"]
    names = [k for k in hits if not k.endswith("#argmax")]
    for k in names:
        h = hits[k]
        b, c = int((h & ~ref).sum()), int((~h & ref).sum())
        print(f"{k:36s} {int(h.sum()):3d}/{n}  vs rollout +{b} -{c}  McNemar p={mcnemar_exact(b, c):.3f}  "
              f"misses {np.nonzero(~h)[0].tolist()}")
    top1 = single_removal_top(st)
    masks, labels, tgt = st["masks"].numpy(), np.asarray(st["labels"]), st["target"].numpy()
    from attnroll.models.shapes import patch_masks
    cover = patch_masks(st["pixel_masks"], reduce="mean").reshape(n, -1).numpy()
    print(f"single-removal oracle (greedy's first pick) on the object: {int(masks[np.arange(n), top1].sum())}/{n}; "
          f"misclassified images: {np.nonzero(labels != tgt)[0].tolist()}")
    for i in np.nonzero(~ref & ~k1)[0]:
        ra, ka = hits["rollout#argmax"][i], hits["measured_rollout(class_blocks=1)#argmax"][i]
        print(f"image {i}: label {labels[i]} predicted {tgt[i]} ({'right' if labels[i] == tgt[i] else 'WRONG'}); "
              f"object {int(masks[i].sum())} patches ({cover[i].sum():.1f} patch areas); rollout max at "
              f"{divmod(int(ra), 8)} ({_near(masks[i], ra)} from the object), k=1 at {divmod(int(ka), 8)} "
              f"({_near(masks[i], ka)}); single-removal oracle at {divmod(int(top1[i]), 8)} "
              f"({'on' if masks[i, top1[i]] else 'off'} the object); hit by: "
              + ", ".join(k for k in names if hits[k][i]))
    anyhit = np.any([hits[k] for k in names], axis=0)
    print(f"images no map hits: {np.nonzero(~anyhit)[0].tolist()}")


def main(argv: Sequence[str]) -> None:
    torch.set_num_threads(1)
    out = os.environ.get("VA_OUT", "/tmp")
    if argv[0] == "greedy":
        stop = None if len(argv) < 5 or argv[4] == "None" else float(argv[4])
        part = tuple(int(v) for v in argv[5].split("-")) if len(argv) > 5 else None
        for s in argv[1].split(","):
            run_greedy(int(s), int(argv[2]), argv[3].split(","), stop, out, part)
    elif argv[0] == "summary":
        summarise(argv[1].split(","), out)
    elif argv[0] == "hybrid":
        run_hybrid(argv[1].split(","), float(argv[2]), out, *argv[3:4])
    elif argv[0] == "pointing":
        report_pointing()
    else:
        raise SystemExit(f"unknown command {argv[0]!r}: greedy | summary | pointing")


if __name__ == "__main__":
    main(sys.argv[1:])
