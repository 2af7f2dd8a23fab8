"""Rows-only mixer layers (core/mixers.py ``MixerRows``) against the mixer's forward, side by side in one run.

Tiny-width models with random weights (transformers' torch path), one prompt of n tokens, one mixer layer each:
Mamba-2 (hidden 64, 4 heads of 32, state 16, convolution 4), Mamba (selective scan), LFM2 (short convolution) and
Qwen3-Next (gated DeltaNet, state scan; LFM2 and Qwen3-Next with one attention layer after it, as their caches need):
  forward    the model's forward pass under no_grad (the reference, 1.00x);
  rows       the layer's ``apply_rows`` of one relevance row over every token, the convolution composed apart
             (``core.mixers.CONVOLUTIONS``, the default);
  folded     the same with the convolution folded per channel before |·| (O(channels·K) times the work).
Reported: median seconds over --repeat rounds (calls alternating), ratios to the forward, the machine load.

Usage: python benchmarks/bench_mixer_rows.py [--n 2048] [--repeat 3] [--threads 2] [--mixers mamba2,mamba,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnroll.capture.mixers import rows_layer
from attnroll.core import mixers


def build(kind: str):
    import transformers as T

    torch.manual_seed(0)
    if kind == "mamba2":
        cfg = T.Mamba2Config(vocab_size=99, hidden_size=64, num_hidden_layers=1, num_heads=4, head_dim=32,
                             state_size=16, n_groups=1, expand=2, chunk_size=256)
        return T.Mamba2ForCausalLM(cfg).eval(), lambda m: m.backbone.layers[0].mixer
    if kind == "mamba":
        cfg = T.MambaConfig(vocab_size=99, hidden_size=64, num_hidden_layers=1, state_size=16, expand=2)
        return T.MambaForCausalLM(cfg).eval(), lambda m: m.backbone.layers[0].mixer
    if kind == "lfm2":
        cfg = T.Lfm2Config(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                           full_attn_idxs=[1])
        return T.Lfm2ForCausalLM(cfg).eval(), lambda m: m.model.layers[0].conv
    cfg = T.Qwen3NextConfig(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            layer_types=["linear_attention", "full_attention"],
                            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                            linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return T.Qwen3NextForCausalLM(cfg).eval(), lambda m: m.model.layers[0].linear_attn


def layer_of(kind: str, n: int):
    """(forward(), the layer's MixerRows)."""
    model, mixer = build(kind)
    ids = torch.randint(3, 99, (1, n), generator=torch.Generator().manual_seed(1))
    kept = []
    hook = mixer(model).register_forward_hook(lambda m, a, k, o: kept.append(rows_layer(m, a, k)), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()

    def forward():
        with torch.no_grad():
            model(input_ids=ids)

    return forward, kept[0]


def timed(fn, store: list) -> None:
    t = time.perf_counter()
    fn()
    store.append(time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mixers", default="mamba2,mamba,lfm2,qwen3_next", help="the mixers to time (comma-separated)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        run(args)


def run(args: argparse.Namespace) -> None:
    n = args.n
    r = torch.rand(1, 1, n, generator=torch.Generator().manual_seed(2))
    layers = {k: layer_of(k, n) for k in args.mixers.split(",") if k}
    times: dict[str, list] = {}
    load0 = open("/proc/loadavg").read().split()[0]
    for _ in range(args.repeat):
        for k, (f, lay) in layers.items():
            timed(f, times.setdefault(f"{k} forward", []))
            for how in mixers.CONVOLUTIONS:
                lay.convolution = how
                timed(lambda: lay.apply_rows(r, a=0.5, c=0.5), times.setdefault(f"{k} {how}", []))
            lay.convolution = "apart"
    load1 = open("/proc/loadavg").read().split()[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"n = {n}")
    for k, v in med.items():
        ref = med[k.split()[0] + " forward"]
        print(f"{k:22s} {v:8.3f} s  {v / ref:7.1f}x")
    print(f"load {load0} -> {load1}, threads {args.threads}, rounds {args.repeat}")


if __name__ == "__main__":
    main()
