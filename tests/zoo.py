"""The tiny-model zoo: every test (and ``benchmarks/family_matrix.py``) builds its small random-weight models here.

Nothing is downloaded: every model is built from its config (2 layers, hidden 32, 4 heads, 32x32 images,
vocabulary 99). Two kits build the same families:

- ``plain``: the libraries' default initialisation, 3 labels, left in the mode the constructor leaves it;
  inputs of 2 examples. The capture tests compare captured attention with the model's own.
- ``sharp``: a larger initializer range (0.3 instead of 0.02) so that attention is far from uniform and
  different targets really have different gradients; 5 labels, eval mode; inputs of 3 examples. The explain
  tests.

Each kit builds a model once per session and hands out deep copies (same weights every time), so that tests
cannot leak state into each other. Text inputs pad the last example (attention_mask 0 on its last 2 tokens).

Also here, the tiny sizes shared with the family matrix: ``TIMM_SMALL`` (timm ViTs), ``SWIN_TIMM`` /
``SWIN_HF`` (two Swin stages of two blocks, 4x4 windows) and ``shrink`` (any transformers config made tiny).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch

#: timm ViT-style models: ``timm.create_model(name, **TIMM_SMALL)``.
TIMM_SMALL = dict(pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=4, num_classes=3)
#: Swin takes per-stage depths and heads: two stages of two blocks, 4x4 windows (timm, then transformers).
SWIN_TIMM = dict(img_size=32, patch_size=2, window_size=4, depths=(2, 2), embed_dim=16, num_heads=(2, 2))
SWIN_HF = dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4)

#: The sizes ``shrink`` sets on any transformers config (and its sub-configs) where the field exists.
SMALL = dict(
    num_hidden_layers=2, num_layers=2, n_layer=2, n_layers=2, encoder_layers=2, decoder_layers=2,
    num_decoder_layers=2, hidden_size=32, d_model=32, n_embd=32, embed_dim=32, num_attention_heads=4, n_head=4,
    n_heads=4, encoder_attention_heads=4, decoder_attention_heads=4, num_heads=4, intermediate_size=64, d_ff=64,
    encoder_ffn_dim=64, decoder_ffn_dim=64, ffn_dim=64, vocab_size=99, max_position_embeddings=64, image_size=32,
    patch_size=8, head_dim=8, d_kv=8, num_key_value_heads=2, max_source_positions=64, max_target_positions=64,
    rotary_dim=4, embedding_size=32, num_encoder_layers=2, num_decoder_layers_=2,
    projection_dim=32,  # PaliGemma's projector must land on the tiny text width
)

IMAGE = ("vit", "deit_distilled", "dinov2", "dinov2_registers", "beit")
TEXT_ONLY = ("bert", "roberta", "distilbert", "electra", "gpt2", "llama")
SEQ2SEQ_MODELS = ("t5", "bart", "marian")
#: Families built with timm (a pixel tensor in, no transformers config).
TIMM = ("timm_vit", "timm_swin")
#: Families built from torch alone (a tensor of token ids in).
TORCH = ("torch_mha",)
#: Families whose record holds signed matrices that multiply the values, not softmax probabilities (checked
#: against the model's own computation in tests/capture/test_diffllama.py instead).
SIGNED = ("diffllama",)


def __getattr__(name: str) -> Any:
    if name == "T":  # ``from tests.zoo import T`` skips the importing module when transformers is missing
        return pytest.importorskip("transformers")
    raise AttributeError(name)


def _hf_builders() -> dict[str, Any]:
    """The transformers families: name -> builder(kit) -> model."""
    T = pytest.importorskip("transformers")

    def common(k: Kit) -> dict:
        return dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37, **k.init())

    vision = dict(image_size=32, patch_size=8, num_channels=3)
    text = dict(vocab_size=99, max_position_embeddings=64)

    def seq2seq(k: Kit) -> dict:
        return dict(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
                    **k.init("init_std"))

    return {
        "vit": lambda k: T.ViTForImageClassification(T.ViTConfig(**common(k), **vision, num_labels=k.labels)),
        "deit_distilled": lambda k: T.DeiTForImageClassificationWithTeacher(
            T.DeiTConfig(**common(k), **vision, num_labels=k.labels)),
        "dinov2": lambda k: T.Dinov2Model(T.Dinov2Config(**common(k), **vision)),
        "dinov2_registers": lambda k: T.Dinov2WithRegistersModel(
            T.Dinov2WithRegistersConfig(**common(k), **vision, num_register_tokens=4)),
        "beit": lambda k: T.BeitForImageClassification(
            T.BeitConfig(**common(k), **vision, use_relative_position_bias=True, num_labels=k.labels)),
        "bert": lambda k: T.BertForSequenceClassification(T.BertConfig(**common(k), **text, num_labels=k.labels)),
        "roberta": lambda k: T.RobertaModel(T.RobertaConfig(**common(k), **text, pad_token_id=1)),
        "distilbert": lambda k: T.DistilBertModel(
            T.DistilBertConfig(n_layers=2, dim=32, n_heads=4, hidden_dim=37, **text, **k.init())),
        "electra": lambda k: T.ElectraModel(T.ElectraConfig(**common(k), **text, embedding_size=16)),
        "gpt2": lambda k: T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=99, n_positions=64, bos_token_id=0, eos_token_id=0,
            **k.init())),
        "llama": lambda k: T.LlamaForCausalLM(
            T.LlamaConfig(**common(k), num_key_value_heads=2, **text, bos_token_id=0, eos_token_id=0)),
        "clip": lambda k: T.CLIPModel(T.CLIPConfig(
            text_config=dict(**common(k), **text, bos_token_id=0, eos_token_id=2),
            vision_config=dict(**common(k), **vision), projection_dim=16)),
        "t5": lambda k: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4,
            **k.init("initializer_factor", 3.0))),
        "bart": lambda k: T.BartForConditionalGeneration(T.BartConfig(**seq2seq(k))),
        "marian": lambda k: T.MarianMTModel(
            T.MarianConfig(**seq2seq(k), decoder_vocab_size=99, pad_token_id=0, decoder_start_token_id=0)),
        "mixtral": lambda k: T.MixtralForCausalLM(T.MixtralConfig(
            **common(k), num_key_value_heads=2, **text, bos_token_id=0, eos_token_id=0, num_local_experts=4,
            num_experts_per_tok=2, experts_implementation="eager")),  # grouped_mm needs 16-byte strides (37 is odd)
        "diffllama": lambda k: T.DiffLlamaForCausalLM(
            T.DiffLlamaConfig(**common(k), num_key_value_heads=2, **text, bos_token_id=0, eos_token_id=0)),
    }


def _timm_model(k: Kit, name: str, sizes: dict) -> torch.nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(name, **{**sizes, "pretrained": False, "num_classes": k.labels})


class EncoderClassifier(torch.nn.Module):
    """Token embeddings -> nn.TransformerEncoder -> linear head on position 0 (a CLS-style token)."""

    def __init__(self, vocab=20, d=16, heads=4, layers=2, classes=3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=24, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.emb(ids))[:, 0])


#: The families built without transformers, name -> builder(kit).
OTHER_BUILDERS = {
    "timm_vit": lambda k: _timm_model(k, "vit_tiny_patch16_224", TIMM_SMALL),
    "timm_swin": lambda k: _timm_model(k, "swin_tiny_patch4_window7_224", SWIN_TIMM),
    "torch_mha": lambda k: EncoderClassifier(classes=k.labels),
}


def eager(m: torch.nn.Module) -> torch.nn.Module:
    """An independent eager-attention, eval-mode copy of ``m``, for transformers' own ``output_attentions=True``."""
    ref = copy.deepcopy(m)
    ref.set_attn_implementation("eager")
    return ref.eval()


def example(inputs: dict, b: int) -> dict:
    """Example b alone, its padding cropped away."""
    out = {k: v[b : b + 1] for k, v in inputs.items()}
    if "attention_mask" in out:
        keep = int(out["attention_mask"].sum())
        for k in ("input_ids", "attention_mask"):
            out[k] = out[k][:, :keep]
    return out


def reference_streams(name: str, out: Any) -> dict[str, tuple]:
    """transformers' own attentions from an ``output_attentions=True`` output, by attnroll stream name."""
    if name == "clip":
        return {"vision": out.vision_model_output.attentions, "text": out.text_model_output.attentions}
    if name in SEQ2SEQ_MODELS:
        return {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions, "cross": out.cross_attentions}
    return {"self": out.attentions}


def shrink(cfg: Any) -> Any:
    """Set the tiny sizes of ``SMALL`` on a transformers config and its sub-configs where the field exists."""
    todo = [cfg]
    while todo:
        c = todo.pop()
        for k, v in SMALL.items():
            if hasattr(c, k) and isinstance(getattr(c, k), int) and not isinstance(getattr(c, k), bool):
                try:
                    setattr(c, k, v)
                except (AttributeError, NotImplementedError):  # derived fields (properties) stay as they are
                    pass
        for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                  "cls_token_id"):
            v = getattr(c, k, None)
            if isinstance(v, int) and v >= 99:
                setattr(c, k, 1)
        for k in getattr(c, "sub_configs", {}) or {}:
            sub = getattr(c, k, None)
            if sub is not None and hasattr(sub, "to_dict"):
                todo.append(sub)
    return cfg


@dataclass(frozen=True)
class Kit:
    """One way of building the zoo's families (see the module's docstring)."""

    name: str
    sharp: bool
    labels: int
    batch: int
    eval_mode: bool

    IMAGE = IMAGE
    TEXT_ONLY = TEXT_ONLY
    SEQ2SEQ_MODELS = SEQ2SEQ_MODELS
    TIMM = TIMM
    TORCH = TORCH
    SIGNED = SIGNED
    eager = staticmethod(eager)
    eager_reference = staticmethod(eager)
    example = staticmethod(example)
    reference_streams = staticmethod(reference_streams)

    @property
    def T(self) -> Any:
        return pytest.importorskip("transformers")

    @property
    def BUILDERS(self) -> dict[str, Any]:  # noqa: N802 - the table's name in the tests
        """The transformers families, name -> builder(kit)."""
        return _hf_builders()

    def init(self, key: str = "initializer_range", value: float = 0.3) -> dict:
        """The config keyword that widens the initialisation, for the sharp kit only."""
        return {key: value} if self.sharp else {}

    def _built(self, name: str) -> torch.nn.Module:
        return _built(self, name)

    def model(self, name: str) -> torch.nn.Module:
        """A fresh copy (same weights every time) so that tests cannot leak state into each other."""
        return copy.deepcopy(_built(self, name))

    def inputs_for(self, name: str, *, batch: int | None = None, seed: int = 0, pad: bool = True, n: int = 7) -> Any:
        """Inputs for family ``name``; with ``pad`` the last text example has its last 2 tokens padded. timm
        families take the pixel tensor itself, torch families a tensor of token ids (no padding)."""
        batch = self.batch if batch is None else batch
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 99, (batch, n), generator=g)
        if name in TORCH:
            return torch.randint(0, 20, (batch, n), generator=g)
        mask = torch.ones(batch, n, dtype=torch.long)
        if pad:
            mask[-1, n - 2:] = 0
        if name in IMAGE or name in TIMM or name == "clip":
            pix = torch.randn(batch, 3, 32, 32, generator=g)
            if name in TIMM:
                return pix
            if name != "clip":
                return {"pixel_values": pix}
            return {"pixel_values": pix, "input_ids": ids, "attention_mask": mask}
        if name in SEQ2SEQ_MODELS:
            return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :5]}
        return {"input_ids": ids, "attention_mask": mask}


@functools.lru_cache(maxsize=None)
def _built(kit: Kit, name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    build = OTHER_BUILDERS.get(name) or _hf_builders()[name]
    m = build(kit)
    return m.eval() if kit.eval_mode else m


plain = Kit("plain", sharp=False, labels=3, batch=2, eval_mode=False)
sharp = Kit("sharp", sharp=True, labels=5, batch=3, eval_mode=True)

#: Decoders with a mixture-of-experts MLP (Mixtral) and with differential attention (DiffLlama).
DECODERS_MORE = ("mixtral", "diffllama")

#: Every family of the zoo: transformers, timm, torch.
FAMILIES = (*IMAGE, *TEXT_ONLY, "clip", *SEQ2SEQ_MODELS, *TIMM, *TORCH, *DECODERS_MORE)


# ------------------------------------------------------------------------------- hybrid and state-space stacks
_LINEAR_FULL = ["linear_attention", "full_attention"]
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=4, mamba_chunk_size=4)
_DELTA = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2)

#: Tiny hybrid decoders (transformers ``model_type`` -> config fields set after ``shrink``): layer 0 a token mixer
#: other than softmax attention, the last layer attention (Zamba: hybrid layers around a shared attention block).
HYBRIDS = {
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_dt_rank=4, mamba_d_state=4),
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[1], **_MAMBA2),
    "zamba": dict(num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=4, mamba_d_state=4,
                  n_mamba_heads=2, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=64, attention_head_dim=16, mamba_expand=2),
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"], mamba_d_state=4,
                   n_mamba_heads=4, mamba_headdim=16, chunk_size=4, num_mem_blocks=1, hybrid_layer_ids=[1],
                   attention_hidden_size=64, attention_head_dim=16, mamba_expand=2),
    "falcon_h1": dict(num_hidden_layers=2, mamba_d_ssm=64, **_MAMBA2),
    "granitemoehybrid": dict(num_hidden_layers=2, layer_types=_LINEAR_FULL, num_local_experts=2,
                             num_experts_per_tok=1, **_MAMBA2),
    "nemotron_h": dict(num_hidden_layers=2, layers_block_type=_LINEAR_FULL, mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=4, chunk_size=4, n_groups=1),
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm3": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
    "recurrent_gemma": dict(num_hidden_layers=2, block_types=["recurrent", "attention"], lru_width=32,
                            attention_window_size=16),
    "kimi_linear": dict(num_hidden_layers=2, layer_types=_LINEAR_FULL, mlp_layer_types=["dense", "dense"],
                        linear_head_dim=8, num_key_value_heads=4, head_dim=8),
    "qwen3_next": dict(num_hidden_layers=2, layer_types=_LINEAR_FULL, linear_num_value_heads=4, num_experts=2,
                       num_experts_per_tok=1, decoder_sparse_step=1, **_DELTA),
    "qwen3_5_text": dict(num_hidden_layers=2, layer_types=_LINEAR_FULL, linear_num_value_heads=4, **_DELTA),
    "olmo_hybrid": dict(num_hidden_layers=2, layer_types=_LINEAR_FULL, linear_num_value_heads=2, **_DELTA),
}
#: Tiny pure state-space decoders: ``model_type`` -> config fields set after ``shrink``.
SSMS = {
    "mamba": dict(num_hidden_layers=2, state_size=4, time_step_rank=4, expand=2),
    "mamba2": dict(num_hidden_layers=2, num_heads=4, head_dim=16, state_size=4, n_groups=1, chunk_size=4, expand=2),
    "falcon_mamba": dict(num_hidden_layers=2, state_size=4, time_step_rank=4, expand=2),
}


@functools.lru_cache(maxsize=None)
def _built_decoder(model_type: str) -> torch.nn.Module:
    T = pytest.importorskip("transformers")
    cfg = shrink(T.AutoConfig.for_model(model_type))
    for k, v in {**HYBRIDS, **SSMS}[model_type].items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg).eval()


def decoder(model_type: str) -> torch.nn.Module:
    """A fresh copy (same weights every time) of the tiny hybrid or state-space decoder of ``model_type``
    (:data:`HYBRIDS`, :data:`SSMS`), in eval mode."""
    return copy.deepcopy(_built_decoder(model_type))


#: Two state-space families in the zoo (the contract matrix runs every method on them): a pure Mamba-2 stack and a
#: Jamba hybrid (a Mamba layer, then an attention layer).
SSM_FAMILIES = ("mamba2", "jamba")
OTHER_BUILDERS.update({name: (lambda k, name=name: decoder(name)) for name in SSM_FAMILIES})
FAMILIES = (*FAMILIES, *SSM_FAMILIES)

#: Two hybrids whose mixer is not a layer of its own, in the contract matrix too: Falcon-H1 (attention and a Mamba-2
#: mixer in parallel in each layer) and Zamba2 (a shared attention block feeding the next Mamba-2 mixer).
WIRED_FAMILIES = ("falcon_h1", "zamba2")
OTHER_BUILDERS.update({name: (lambda k, name=name: decoder(name)) for name in WIRED_FAMILIES})
FAMILIES = (*FAMILIES, *WIRED_FAMILIES)
