"""Run in a subprocess by test_recompute_memory: peak resident memory (bytes) added by one
explain(..., attention="recompute") at a given length, above a warmed-up baseline."""

import resource
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnroll


def main(n: int, method: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n)
    m = LlamaForCausalLM(cfg).eval()
    attnroll.explain(m, {"input_ids": torch.randint(0, 64, (1, 64))}, method, attention="recompute")  # warm-up
    x = {"input_ids": torch.randint(0, 64, (1, n))}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    attnroll.explain(m, x, method, attention="recompute")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)  # ru_maxrss is in KiB on Linux


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
