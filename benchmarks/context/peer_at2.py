"""AT2 (Cohen-Wang et al., package ``at2`` 0.0.1) trained locally on SmolLM2-135M-Instruct, scaled down.

AT2's recipe (its ``LinearScoreEstimatorTrainer``): per training example, the attention of the attributed
target's tokens to each source, per layer and head (features, ``AttentionFeatureExtractor``: 30 × 9 = 270 here),
and the target's logit-probability under ``num_masks`` = 32 random 50 % ablations (``create_masks``, seeds
0..31, sources masked out of attention); a linear estimator (``LinearScoreEstimator``, weights 1/270 at start)
is fitted so that Σ_sources (±1 mask) × score correlates with the ablated outputs (``PearsonCorrelationLoss``,
Adam 1e-3, cosine schedule, gradient clip 1, 1,000 steps of 512 examples), then L1-normalised. The package's
pieces are used for every step; the loop around them is ours because its task classes generate the model's own
answers through ``datasets`` batching (stand-ins here). Departures, all from scale: a few dozen generated
prompts of the "validation-b" split (disjoint from the held-out draws) instead of a few thousand real examples;
the gold answer as target (the quantity our protocol measures) instead of the model's own generation; a batch
of every training prompt per step (fewer than 512 exist).

    PYTHONPATH=src python -m benchmarks.context.peer_at2 --train 24 --out /tmp/at2_smollm2.pt
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from . import peers
from .data import qa_set
from .methods import owners
from .protocol import token_ids

MASKS = 32


def at2_modules():
    """AT2's package pieces (``PEERS`` on the path; nltk / spaCy / datasets stand-ins as for ContextCite)."""
    if peers.PEERS not in sys.path:
        sys.path.append(peers.PEERS)
    peers._stand_ins()
    from at2.attribution.attention import get_attention_weights
    from at2.attribution.features import AttentionFeatureExtractor
    from at2.attribution.score_estimators import LinearScoreEstimator
    from at2.attribution.trainer import PearsonCorrelationLoss
    from at2.attribution.utils import aggregate_logit_probs
    from at2.tasks.base import compute_logit_probs, create_masks

    return dict(attention=get_attention_weights, extractor=AttentionFeatureExtractor, linear=LinearScoreEstimator,
                loss=PearsonCorrelationLoss, aggregate=aggregate_logit_probs, logit_probs=compute_logit_probs,
                masks=create_masks)


def _inputs(tokenizer, item):
    p, a = token_ids(tokenizer, item.prompt, item.answer)
    owner = owners(tokenizer, item.prompt, item.segments)
    return torch.tensor([p + a]), len(p), len(a), owner


def source_features(model, tokenizer, item, at2=None) -> np.ndarray:
    """(n_sources, layers × heads): AT2's attention features of the whole answer (one target: its tokens'
    mean) summed over each passage's tokens, computed by its ``get_attention_weights`` from hidden states."""
    at2 = at2 or at2_modules()
    ids, n_p, T, owner = _inputs(tokenizer, item)
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        hs = [h[:, :-1] for h in hs]  # as its AttributionTask.get_hidden_states
        w = at2["attention"](model, hs, attribution_start=n_p, attribution_end=n_p + T, model_type="llama")
    L, H = w.shape[:2]
    per_token = w.permute(2, 3, 0, 1).reshape(T, -1, L * H).float().mean(dim=0)  # (tokens, features)
    return np.stack([per_token[:n_p][torch.from_numpy(owner == i)].sum(0).numpy()
                     for i in range(len(item.segments))])


def ablation_outputs(model, tokenizer, item, at2=None, batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(masks (32, n) bool, outputs (32,)): its masks (seeds 0..31, 50 %), each dropped passage's tokens masked
    out of attention, and the answer's sequence logit-probability (its ``aggregate_logit_probs``)."""
    at2 = at2 or at2_modules()
    ids, n_p, T, owner = _inputs(tokenizer, item)
    masks = at2["masks"](MASKS, len(item.segments), 0.5, 0)
    keep = np.ones((MASKS, ids.shape[1]), dtype=np.int64)
    for m, mask in enumerate(masks):
        for i, kept in enumerate(mask):
            keep[m, :n_p][owner == i] = int(kept)
    lp = []
    with torch.no_grad():
        for s in range(0, MASKS, batch):
            am = torch.from_numpy(keep[s:s + batch])
            logits = model(input_ids=ids.expand(len(am), -1), attention_mask=am, logits_to_keep=T + 1).logits
            lp.append(at2["logit_probs"](logits[:, :T].float(), ids[:, n_p:].expand(len(am), -1)))
    return masks, at2["aggregate"](torch.cat(lp).numpy())


def train(features: list[np.ndarray], masks: list[np.ndarray], outputs: list[np.ndarray], layers_heads: tuple,
          at2=None, steps: int = 1000, seed: int = 0):
    """Its linear estimator fitted with its loss, optimiser settings and projection; returns (weights, losses)."""
    at2 = at2 or at2_modules()
    torch.manual_seed(seed)
    n_feat = features[0].shape[1]
    groups: dict[int, list] = {}  # examples grouped by their number of masks (each group one batch)
    for m, f, o in zip(masks, features, outputs):
        groups.setdefault(len(m), []).append(((2.0 * m - 1) @ f, o))
    batches = [(torch.tensor(np.stack([g[0] for g in grp]), dtype=torch.float32),
                torch.tensor(np.stack([g[1] for g in grp]), dtype=torch.float32)) for grp in groups.values()]
    sizes = [len(grp) for grp in groups.values()]
    extractor = at2["extractor"](*layers_heads, model_type="llama")
    if extractor.num_features != n_feat:
        raise ValueError(f"features have {n_feat} columns, layers × heads {layers_heads} give {extractor.num_features}")
    est = at2["linear"](extractor)
    opt = torch.optim.Adam(est.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loss_fn, losses = at2["loss"](), []
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(n * loss_fn(est(x)[:, :, 0], y) for n, (x, y) in zip(sizes, batches)) / sum(sizes)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(est.parameters(), max_norm=1.0)
        opt.step()
        sched.step()
        est.project_parameters()
        losses.append(loss.item())
    est.finalize_parameters()
    return est.linear.weight.detach()[0].numpy().astype(float), losses


def logit_prob(logp):
    """The sequence logit-probability log p − log(1 − p) of a log-probability (AT2's output, from log p)."""
    logp = np.minimum(np.asarray(logp, dtype=float), -1e-9)
    return logp - np.where(logp > -0.1, np.log(-np.expm1(logp)), np.log1p(-np.exp(logp)))


def loo_examples(rows: list[dict], items: list) -> tuple[list, list, list]:
    """Stored leave-one-out ablations as AT2 training examples: for each item with a stored row of the same
    prompt (meta, answer, gold; ``loo`` drops and ``full_logp``), masks "all but i" and outputs the
    logit-probability of log p(all but i) = full_logp − drop_i. Returns (items used, masks, outputs)."""
    used, masks, outs = [], [], []
    for item in items:
        row = next((r for r in rows if r.get("meta") == item.meta and r.get("answer") == item.answer
                    and r.get("gold") == item.gold), None)
        if row is None or "full_logp" not in row:
            continue
        n = len(item.segments)
        used.append(item)
        masks.append(~np.eye(n, dtype=bool))
        outs.append(logit_prob(row["full_logp"] - np.asarray(row["loo"], dtype=float)))
    return used, masks, outs


def scores(model, tokenizer, item, weights: np.ndarray) -> np.ndarray:
    """AT2's passage scores: the fitted weights applied to the passages' attention features."""
    return source_features(model, tokenizer, item) @ weights


def collect(model, tokenizer, items, at2, stop_after_s=None) -> tuple[list, list, list]:
    """Its recipe's data for each item (until ``stop_after_s`` wall seconds): features, 32 masks, outputs."""
    t0, c0, feats, masks, outs = time.perf_counter(), time.process_time(), [], [], []
    for i, item in enumerate(items):
        if stop_after_s and time.perf_counter() - t0 > stop_after_s:
            break
        feats.append(source_features(model, tokenizer, item, at2))
        m, o = ablation_outputs(model, tokenizer, item, at2)
        masks.append(m)
        outs.append(o)
        print(i, f"{time.perf_counter() - t0:.0f}s wall, {time.process_time() - c0:.0f}s CPU", flush=True)
    return feats, masks, outs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=24, help="validation-b prompts given the recipe's 32 ablations")
    ap.add_argument("--loo", default=None, help="a JSON of stored leave-one-out rows (items with meta, answer, gold, "
                                               "loo, full_logp) of validation-b prompts, used as further examples")
    ap.add_argument("--loo-count", type=int, default=20, help="validation-b prompts searched in --loo")
    ap.add_argument("--out", required=True, help="where to save the fitted weights (torch .pt)")
    ap.add_argument("--stop-after-s", type=float, default=None,
                    help="stop collecting after this many wall seconds and train on the prompts collected")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    at2 = at2_modules()
    t0, c0 = time.perf_counter(), time.process_time()
    feats, masks, outs = collect(lm.model, lm.tokenizer, qa_set(lm.tokenizer, "validation-b", args.train, 16), at2,
                                 args.stop_after_s)
    n_random = len(feats)
    if args.loo:
        import json

        used, lm_masks, lm_outs = loo_examples(json.load(open(args.loo))["items"],
                                               qa_set(lm.tokenizer, "validation-b", args.loo_count, 16))
        feats += [source_features(lm.model, lm.tokenizer, it, at2) for it in used]
        masks, outs = masks + lm_masks, outs + lm_outs
    collect_s, collect_cpu = time.perf_counter() - t0, time.process_time() - c0
    cfg = lm.model.config
    w, losses = train(feats, masks, outs, (cfg.num_hidden_layers, cfg.num_attention_heads), at2)
    info = {"random_mask_prompts": n_random, "ablation_forwards": MASKS * n_random,
            "loo_prompts": len(feats) - n_random, "collect_s": collect_s, "collect_cpu_s": collect_cpu,
            "train_cpu_s": time.process_time() - c0 - collect_cpu, "loss_first_last": (losses[0], losses[-1]),
            "loadavg": open("/proc/loadavg").read().split()[:3]}
    torch.save({"weights": torch.tensor(w), **info}, args.out)
    print(info, "saved", args.out, flush=True)


if __name__ == "__main__":
    main()
