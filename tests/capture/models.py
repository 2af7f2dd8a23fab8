"""Tiny models with random weights for the capture tests (2 layers, hidden 32, 4 heads, 32x32 images).

Nothing is downloaded: every model is built from its config. Builders are cached per session because
building all of them takes a few seconds on 2 cores.
"""

from __future__ import annotations

import copy
import functools

import torch

transformers = __import__("pytest").importorskip("transformers")
T = transformers

COMMON = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37)
VISION = dict(image_size=32, patch_size=8, num_channels=3)
TEXT = dict(vocab_size=99, max_position_embeddings=64)
SEQ2SEQ = dict(
    vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
)

BUILDERS = {
    "vit": lambda: T.ViTForImageClassification(T.ViTConfig(**COMMON, **VISION, num_labels=3)),
    "deit_distilled": lambda: T.DeiTForImageClassificationWithTeacher(T.DeiTConfig(**COMMON, **VISION, num_labels=3)),
    "dinov2": lambda: T.Dinov2Model(T.Dinov2Config(**COMMON, **VISION)),
    "dinov2_registers": lambda: T.Dinov2WithRegistersModel(
        T.Dinov2WithRegistersConfig(**COMMON, **VISION, num_register_tokens=4)
    ),
    "beit": lambda: T.BeitForImageClassification(
        T.BeitConfig(**COMMON, **VISION, use_relative_position_bias=True, num_labels=3)
    ),
    "bert": lambda: T.BertForSequenceClassification(T.BertConfig(**COMMON, **TEXT, num_labels=3)),
    "roberta": lambda: T.RobertaModel(T.RobertaConfig(**COMMON, **TEXT, pad_token_id=1)),
    "distilbert": lambda: T.DistilBertModel(
        T.DistilBertConfig(n_layers=2, dim=32, n_heads=4, hidden_dim=37, **TEXT)
    ),
    "electra": lambda: T.ElectraModel(T.ElectraConfig(**COMMON, **TEXT, embedding_size=16)),
    "gpt2": lambda: T.GPT2LMHeadModel(
        T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99, n_positions=64, bos_token_id=0, eos_token_id=0)
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
        T.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4)
    ),
    "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(**SEQ2SEQ)),
    "marian": lambda: T.MarianMTModel(
        T.MarianConfig(**SEQ2SEQ, decoder_vocab_size=99, pad_token_id=0, decoder_start_token_id=0)
    ),
}

IMAGE = ("vit", "deit_distilled", "dinov2", "dinov2_registers", "beit")
TEXT_ONLY = ("bert", "roberta", "distilbert", "electra", "gpt2", "llama")
SEQ2SEQ_MODELS = ("t5", "bart", "marian")


@functools.lru_cache(maxsize=None)
def _built(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return BUILDERS[name]()


def model(name: str) -> torch.nn.Module:
    """A fresh copy (same weights every time) so that tests cannot leak state into each other."""
    return copy.deepcopy(_built(name))


def eager_reference(m: torch.nn.Module) -> torch.nn.Module:
    """An independent eager-attention, eval-mode copy of ``m`` for computing transformers' own
    ``output_attentions=True`` result."""
    ref = copy.deepcopy(m)
    ref.set_attn_implementation("eager")
    return ref.eval()


def inputs_for(name: str, *, batch: int = 2, seed: int = 0) -> dict:
    """Model inputs; text inputs pad the last example (attention_mask 0 on its last 2 tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (batch, 7), generator=g)
    mask = torch.ones(batch, 7, dtype=torch.long)
    mask[-1, 5:] = 0
    pix = torch.randn(batch, 3, 32, 32, generator=g)
    if name in IMAGE:
        return {"pixel_values": pix}
    if name == "clip":
        return {"pixel_values": pix, "input_ids": ids, "attention_mask": mask}
    if name in SEQ2SEQ_MODELS:
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids, "attention_mask": mask}


def reference_streams(name: str, out) -> dict[str, tuple]:
    """transformers' own attentions from an ``output_attentions=True`` output, by attnroll stream name."""
    if name == "clip":
        return {"vision": out.vision_model_output.attentions, "text": out.text_model_output.attentions}
    if name in SEQ2SEQ_MODELS:
        return {
            "encoder": out.encoder_attentions,
            "decoder": out.decoder_attentions,
            "cross": out.cross_attentions,
        }
    return {"self": out.attentions}
