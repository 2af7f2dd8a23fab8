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
    x = torch.tensor(np.stack([(2.0 * m - 1) @ f for m, f in zip(masks, features)]), dtype=torch.float32)
    y = torch.tensor(np.stack(outputs), dtype=torch.float32)
    extractor = at2["extractor"](*layers_heads, model_type="llama")
    if extractor.num_features != n_feat:
        raise ValueError(f"features have {n_feat} columns, layers × heads {layers_heads} give {extractor.num_features}")
    est = at2["linear"](extractor)
    opt = torch.optim.Adam(est.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loss_fn, losses = at2["loss"](), []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(est(x)[:, :, 0], y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(est.parameters(), max_norm=1.0)
        opt.step()
        sched.step()
        est.project_parameters()
        losses.append(loss.item())
    est.finalize_parameters()
    return est.linear.weight.detach()[0].numpy().astype(float), losses


def scores(model, tokenizer, item, weights: np.ndarray) -> np.ndarray:
    """AT2's passage scores: the fitted weights applied to the passages' attention features."""
    return source_features(model, tokenizer, item) @ weights


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=24, help="validation-b prompts to train on")
    ap.add_argument("--out", required=True, help="where to save the fitted weights (torch .pt)")
    ap.add_argument("--stop-after-s", type=float, default=None,
                    help="stop collecting after this many wall seconds and train on the prompts collected")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from attnroll.models import load_model

    lm = load_model("smollm2-135m-instruct")
    at2 = at2_modules()
    items = qa_set(lm.tokenizer, "validation-b", args.train, 16)
    t0, c0, feats, masks, outs = time.perf_counter(), time.process_time(), [], [], []
    for i, item in enumerate(items):
        if args.stop_after_s and time.perf_counter() - t0 > args.stop_after_s:
            break
        feats.append(source_features(lm.model, lm.tokenizer, item, at2))
        m, o = ablation_outputs(lm.model, lm.tokenizer, item, at2)
        masks.append(m)
        outs.append(o)
        print(i, f"{time.perf_counter() - t0:.0f}s wall, {time.process_time() - c0:.0f}s CPU", flush=True)
    collect, collect_cpu = time.perf_counter() - t0, time.process_time() - c0
    cfg = lm.model.config
    w, losses = train(feats, masks, outs, (cfg.num_hidden_layers, cfg.num_attention_heads), at2)
    torch.save({"weights": torch.tensor(w), "train_prompts": len(feats), "ablation_forwards": MASKS * len(feats),
                "collect_s": collect, "collect_cpu_s": collect_cpu, "train_s": time.perf_counter() - t0 - collect,
                "train_cpu_s": time.process_time() - c0 - collect_cpu, "loss_first_last":
                (losses[0], losses[-1]), "loadavg": open("/proc/loadavg").read().split()[:3]}, args.out)
    print(f"collected {len(feats)} prompts in {collect:.0f}s ({collect_cpu:.0f}s CPU); loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
