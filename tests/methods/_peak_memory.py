"""Run in a subprocess by test_recompute_memory_grows_linearly: the peak resident memory (bytes) added by
explain(..., attention="recompute") at each given length, above a warmed-up baseline, lengths ascending
(ru_maxrss only grows, so each figure is the peak so far)."""

import resource
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnroll


def main(method: str, lengths: list[int]) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(lengths))
    m = LlamaForCausalLM(cfg).eval()
    attnroll.explain(m, {"input_ids": torch.randint(0, 64, (1, 64))}, method, attention="recompute")  # warm-up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for n in sorted(lengths):
        attnroll.explain(m, {"input_ids": torch.randint(0, 64, (1, n))}, method, attention="recompute")
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)  # KiB on Linux


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]])
