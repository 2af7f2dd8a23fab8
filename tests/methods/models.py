"""Tiny random-weight models for the explain tests (2 layers, hidden 32, 4 heads, 32x32 images).

Weights are drawn with a larger initializer range than transformers' default (0.02), so that attention is
far from uniform and different targets really have different gradients. Built once per session, copied per
test."""

from __future__ import annotations

import copy
import functools

import torch

T = __import__("pytest").importorskip("transformers")

COMMON = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37, initializer_range=0.3)
VISION = dict(image_size=32, patch_size=8, num_channels=3)
TEXT = dict(vocab_size=99, max_position_embeddings=64)
SEQ2SEQ = dict(
    vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64, init_std=0.3,
)

BUILDERS = {
    "vit": lambda: T.ViTForImageClassification(T.ViTConfig(**COMMON, **VISION, num_labels=5)),
    "deit_distilled": lambda: T.DeiTForImageClassificationWithTeacher(T.DeiTConfig(**COMMON, **VISION, num_labels=5)),
    "bert": lambda: T.BertForSequenceClassification(T.BertConfig(**COMMON, **TEXT, num_labels=5)),
    "gpt2": lambda: T.GPT2LMHeadModel(
        T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99, n_positions=64, bos_token_id=0, eos_token_id=0,
                     initializer_range=0.3)
    ),
    "llama": lambda: T.LlamaForCausalLM(
        T.LlamaConfig(**COMMON, num_key_value_heads=2, **TEXT, bos_token_id=0, eos_token_id=0)
    ),
    "clip": lambda: T.CLIPModel(
        T.CLIPConfig(
            text_config=dict(**COMMON, **TEXT, bos_token_id=0, eos_token_id=2),
            vision_config=dict(**COMMON, **VISION),
            projection_dim=16,
        )
    ),
    "t5": lambda: T.T5ForConditionalGeneration(
        T.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4,
                   initializer_factor=3.0)
    ),
    "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(**SEQ2SEQ)),
    "marian": lambda: T.MarianMTModel(
        T.MarianConfig(**SEQ2SEQ, decoder_vocab_size=99, pad_token_id=0, decoder_start_token_id=0)
    ),
}
IMAGE = ("vit", "deit_distilled")
SEQ2SEQ_MODELS = ("t5", "bart", "marian")


@functools.lru_cache(maxsize=None)
def _built(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


def model(name: str) -> torch.nn.Module:
    return copy.deepcopy(_built(name))


def eager(m: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(m)
    ref.set_attn_implementation("eager")
    return ref.eval()


def inputs_for(name: str, *, batch: int = 3, seed: int = 0, pad: bool = True, n: int = 7) -> dict:
    """Inputs; with ``pad`` the last text example has its last 2 tokens padded (attention_mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (batch, n), generator=g)
    mask = torch.ones(batch, n, dtype=torch.long)
    if pad:
        mask[-1, n - 2:] = 0
    if name in IMAGE:
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g)}
    if name in SEQ2SEQ_MODELS:
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids, "attention_mask": mask}


def example(inputs: dict, b: int) -> dict:
    """Example b alone, its padding cropped away."""
    out = {k: v[b : b + 1] for k, v in inputs.items()}
    if "attention_mask" in out:
        keep = int(out["attention_mask"].sum())
        for k in ("input_ids", "attention_mask"):
            out[k] = out[k][:, :keep]
    return out
