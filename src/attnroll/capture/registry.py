"""The family registry: one :class:`Family` entry per model family attnroll captures, in the order they are
tried (the first entry whose ``detect`` accepts a model wins).

Read by ``capture``'s dispatch (:func:`adapter_for`), ``model_facts`` (:func:`facts_for`), the layer
anatomy (:func:`block_kinds`: every entry's block kinds, in entry order), the unsupported-model messages
(:data:`SUPPORTED_FAMILIES`) and README's family table (:func:`table_rows`, checked by
``tests/capture/test_registry.py``). Adding a family is its adapter file (with its block kinds, if the layer
anatomy should know its blocks), its entry here and its test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from . import hf_anatomy, timm, torch_mha
from .anatomy_parts import BlockKind
from .cait import CaitAdapter, is_cait
from .hf import HFAdapter, hf_facts, is_hf_model
from .hooks import Adapter, set_supported_families
from .record import ModelFacts
from .sentence_transformers import is_sentence_transformer, make_adapter as make_st_adapter
from .swin import is_swin, make_adapter as make_swin_adapter
from .vlm import vlm_adapter, vlm_facts

__all__ = ["Family", "Models", "FAMILIES", "GENERIC", "METHOD_GROUPS", "SUPPORTED_FAMILIES", "family_of", "adapter_for",
           "facts_for", "block_kinds", "table_rows", "refusals"]

#: The method groups an entry may list: dense attention maths (raw, rollout, flow, ...), gradient-weighted
#: methods (grad_rollout, gae, ...), value-aware methods (norm, globenc, alti, decompx, ...: they read the
#: layer anatomy of the family's block kinds), the matrix-free route (``attention="recompute"``).
METHOD_GROUPS = ("attention", "gradient", "value-aware", "matrix-free")


@dataclass(frozen=True, kw_only=True)
class Models:
    """One row of README's family table: the models it covers, the streams their records hold, their prefix
    (suffix) tokens and the readout (the rows their prediction reads), as the family's adapter declares them."""

    models: str
    streams: str
    prefix: str
    readout: str

    def row(self) -> str:
        """The row as README's markdown table has it."""
        return f"| {self.models} | {self.streams} | {self.prefix} | {self.readout} |"


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family.

    ``name``: how the family is called in texts (the anatomy's "known families" group them by it);
    ``detect(model)``: whether the model is this family's (tried in registry order, the first match wins);
    ``adapter(model)``: its capture adapter; ``facts(model)``: its :class:`ModelFacts` without a forward pass
    (None: the entry adds none of its own — the next matching entry's are used, and a model no entry gives
    facts for gets its adapter's facts plus any token ids on its config); ``blocks``: the block kinds of the
    layer anatomy this family declares (its builders live beside its adapter); ``supported``: the family in
    the unsupported-model message; ``readout``: where its readout rule is declared (the readout code stays
    with the adapter); ``methods``: the method groups of :data:`METHOD_GROUPS` its models can be explained
    with; ``models``: its rows of README's family table; ``refused``: the models of this family it refuses,
    each with the reason."""

    name: str
    detect: Callable[[nn.Module], bool]
    adapter: Callable[[nn.Module], Adapter]
    facts: Callable[[nn.Module], ModelFacts] | None = None
    blocks: tuple[BlockKind, ...] = ()
    supported: str
    readout: str
    methods: tuple[str, ...]
    models: tuple[Models, ...]
    refused: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [g for g in self.methods if g not in METHOD_GROUPS]
        if unknown or not self.methods:
            raise ValueError(f"family {self.name!r}: methods must be some of {METHOD_GROUPS}, got {self.methods!r}")
        if ("value-aware" in self.methods) != any(k.value_aware for k in self.blocks):
            raise ValueError(f"family {self.name!r}: 'value-aware' is listed exactly when a block kind of the "
                             "family says how the value-aware methods read it")


# ------------------------------------------------------------------------------- glue for the entries
def _transformers_adapter(model: nn.Module) -> Adapter:
    return vlm_adapter(model) or HFAdapter(model)


def _transformers_facts(model: nn.Module) -> ModelFacts:
    return vlm_facts(model) or hf_facts(model)


def _st_facts(model: nn.Module) -> ModelFacts:
    return make_st_adapter(model).facts()


def _timm_facts(model: nn.Module) -> ModelFacts:
    return ModelFacts(family="timm", input_key="x", keyword_call=False)


def _is_swin(model: nn.Module) -> bool:
    return (is_hf_model(model) or timm.is_timm_model(model)) and is_swin(model)


def _is_cait(model: nn.Module) -> bool:
    return timm.is_timm_model(model) and is_cait(model)


_EMBEDDINGS = "from the embeddings: CLS = 1"

# ------------------------------------------------------------------------------- the entries
SENTENCE_TRANSFORMERS = Family(
    name="sentence-transformers", detect=is_sentence_transformer, adapter=make_st_adapter, facts=_st_facts,
    supported="sentence-transformers SentenceTransformer objects",
    readout="its Pooling module's mode (sentence_transformers.pooling_of_module)",
    methods=("attention", "gradient"),
    models=(Models(models="sentence-transformers `SentenceTransformer`", streams="self", prefix="0",
                   readout="its Pooling module (mean / CLS / last token)"),),
)

SWIN = Family(
    name="swin", detect=_is_swin, adapter=make_swin_adapter,
    supported="transformers Swin / SwinV2 / Donut-Swin / MaskFormer-Swin and timm swin_* / swinv2_* (window "
              "attention scattered into stage matrices)",
    readout="the mean of the last stage's tokens (swin.SwinHFAdapter / SwinTimmAdapter.readout_spec)",
    methods=("attention", "gradient"),
    models=(Models(
        models="transformers Swin, SwinV2, Donut-Swin, MaskFormer-Swin; timm `swin_*`, `swinv2_*`",
        streams="self, a stage chain: each block's window attention scattered into its stage's token matrix (shift "
                "undone), 2×2 patch merging as a fixed map between stages (¼ per source, a convention)",
        prefix="0; units and grid = the input patch grid",
        readout="mean of the last stage's tokens (timm max pooling needs `readout=`); `rollout`, `raw`, "
                "`grad_rollout`, `gae` compose the chain, the rest refuse it; dense only (no "
                "`attention=\"recompute\"`)"),),
    refused=("Swin2SR and timm `swinv2_cr_*` (windows without the Swin adapter)",),
)

TRANSFORMERS = Family(
    name="transformers", detect=is_hf_model, adapter=_transformers_adapter, facts=_transformers_facts,
    blocks=hf_anatomy.BLOCKS,
    supported="Hugging Face transformers: ViT, DeiT (incl. distilled ...WithTeacher), BEiT, DINOv2 (with "
              "registers), YOLOS, ViTMAE, AST, BERT-likes, GPT-2, Llama-family decoders, CLIP (vision and text "
              "towers), T5, BART, Marian, VisionEncoderDecoder, LLaVA and PaliGemma (vision and language streams) "
              "(and other transformers models that declare attention outputs), plus families without a declaration "
              "through output_attentions=True (DeBERTa, MPNet, BLOOM, Falcon, GPT-Neo, RoFormer, XLM, ...)",
    readout="per model type and head (hf.HFAdapter.readout_spec; vision-language models: vlm.VLMAdapter)",
    methods=("attention", "gradient", "value-aware", "matrix-free"),
    models=(
        Models(models="transformers ViT, DINOv2, ViT-MSN, I-JEPA-likes", streams="self", prefix=_EMBEDDINGS,
               readout="CLS"),
        Models(models="transformers DeiT (distilled `...WithTeacher` too)", streams="self",
               prefix="CLS + distillation = 2",
               readout="CLS; `...WithTeacher`: rows 0 and 1 at ½ each (its logits average both heads)"),
        Models(models="transformers DINOv2 with registers", streams="self", prefix="1 + R registers", readout="CLS"),
        Models(models="transformers BEiT, Data2Vec-Vision", streams="self", prefix="1",
               readout="mean of the patch rows when `use_mean_pooling`, else CLS"),
        Models(models="transformers YOLOS", streams="self", prefix="1 (3+ detection tokens as suffix)",
               readout="the detection tokens' rows (one object: `position=`)"),
        Models(models="transformers ViTMAE", streams="self", prefix="1",
               readout="CLS; patches put back in order with `ids_restore` (dense route, gradients too); refused when "
                       "masking (`mask_ratio` > 0: a random subset of the patches)"),
        Models(models="transformers AST (audio spectrogram)", streams="self",
               prefix="2; grid = frequency × time patches", readout="mean of rows 0 and 1 (its pooler)"),
        Models(models="transformers BERT, RoBERTa, DistilBERT, ELECTRA, ALBERT, ...", streams="self",
               prefix="0 (text)", readout="CLS; mean of the real tokens from a sentence-transformers "
                                          "`1_Pooling/config.json` in the model folder"),
        Models(models="transformers DeBERTa(-v2/v3), MPNet, RoFormer, XLM, BLOOM, Falcon, GPT-Neo, MPT, ... (no "
                      "output recorder)", streams="self (public `output_attentions=True` path)", prefix="0",
               readout="CLS, or the last real token when causal"),
        Models(models="transformers GPT-2, Llama-family, TimesFM (causal)", streams="self", prefix="0",
               readout="last real token (causal by the attention modules' own flag too)"),
        Models(models="transformers Wav2Vec2, HuBERT, WavLM", streams="self", prefix="0",
               readout="mean of the frames (gradients refused for WavLM: they never reach its returned weights)"),
        Models(models="transformers CLIP, MetaCLIP 2, OWL-ViT, OWLv2", streams="vision, text", prefix="1 (vision)",
               readout="vision: CLS; text: the end-of-text token (OWL-ViT / OWLv2: the largest id, as they pool)"),
        Models(models="transformers SigLIP / SigLIP2", streams="vision, text", prefix="0",
               readout="vision: the attention-pooling head's own attention weights; text: the last position"),
        Models(models="transformers I-JEPA, ViTDet and other image models without a class token", streams="self",
               prefix="0", readout="mean of the patch rows"),
        Models(models="transformers LLaVA, PaliGemma (vision-language)",
               streams="vision, language (the language sequence holds the image tokens and the text)",
               prefix="vision: 1 (LLaVA's CLIP tower), 0 (SigLIP)",
               readout="language: last real token; image tokens found from the model's own `image_token_id` and "
                       "linked one to one to the vision tokens the projector reads (LLaVA: `vision_feature_layer`, "
                       "`\"default\"` strategy drops the CLS)"),
        Models(models="transformers T5, BART, Marian, VisionEncoderDecoder", streams="encoder, decoder, cross",
               prefix="encoder from its embeddings (1 for a ViT encoder)", readout="decoder: last real token"),
    ),
    refused=(
        "SegFormer / PVT / Hiera / Funnel / Canine (token count changes between layers)",
        "Longformer / LED (sliding windows)", "ALBERT (one layer shared by all)", "SqueezeBERT (returns scores)",
        "block-sparse BigBird", "Qwen2-VL / Qwen2.5-VL (its vision attention returns no weights)",
        "LLaVA-NeXT / OneVision (any-resolution tiles with newline tokens: no one grid)",
        "DiffLlama (differential attention: softmax₁ − λ·softmax₂ is no row-stochastic matrix)",
        "ViLT (text tokens + image CLS + patches sampled in a random order in one sequence)",
    ),
)

CAIT = Family(
    name="cait", detect=_is_cait, adapter=CaitAdapter,
    supported="timm CaiT (cait_*: talking-heads and class-attention blocks)",
    readout="CLS, or the mean of the patch rows with global_pool='avg' (cait.CaitAdapter, timm.TimmAdapter)",
    methods=("attention", "gradient"),
    models=(Models(
        models="timm CaiT (`cait_*`)",
        streams="self: [CLS + patches] throughout; class-attention blocks are the last layers (CLS row = the block's "
                "attention, patch rows identity)",
        prefix="1",
        readout="CLS (`global_pool=\"avg\"`: mean of the patch rows); talking-heads layers hold the head mixture "
                "that multiplies the values, not probabilities: `rollout` / `flow` refuse them (`start_layer=` "
                "past them rolls out the class attention), gradient methods and `raw` read them"),),
)

TIMM = Family(
    name="timm", detect=timm.is_timm_model, adapter=timm.TimmAdapter, facts=_timm_facts, blocks=timm.BLOCKS,
    supported="timm VisionTransformer models (vit_*, deit_* incl. distilled, register-token variants, parallel "
              "blocks, attention pooling), EVA / EVA02 / RoPE ViTs, BEiT, relpos ViT, NaFlexViT",
    readout="from global_pool and the distillation head (timm.TimmAdapter.readout_spec)",
    methods=("attention", "gradient", "value-aware"),
    models=(
        Models(models="timm `vit_*`, `deit_*` (distilled), register variants, EVA / EVA02 / RoPE ViTs, BEiT, relpos "
                      "ViT, NaFlexViT", streams="self", prefix="`model.num_prefix_tokens`",
               readout="distilled: rows 0 and 1 at ½ each; `global_pool`: token → CLS, avg → mean of the patch "
                       "rows, map → the attention-pool head's own attention weights; max pooling needs `readout=`"),
        Models(models="timm parallel blocks (`vit_*_18x2`)", streams="self", prefix="as above",
               readout="as above; each block's branches are one layer (heads concatenated)"),
    ),
    refused=("timm differential attention (`vit_dwee`)",
             "timm VOLO / MaxViT / XCiT / SAM ViT and other models that are not one global-attention stack (outlook "
             "attention; windows or grid cells as the batch; channel attention)",
             "timm `global_pool='avgmax'` as a default readout (`readout='mean'` explains its mean half)"),
)

TORCH = Family(
    name="torch", detect=torch_mha.has_mha, adapter=torch_mha.MHAAdapter, blocks=torch_mha.BLOCKS,
    supported="models built from torch.nn.MultiheadAttention (nn.TransformerEncoder, nn.TransformerDecoder, "
              "nn.Transformer)",
    readout="the first token, the last real token when causal (hooks.Adapter.readout_spec)",
    methods=("attention", "gradient"),
    models=(Models(models="`torch.nn.MultiheadAttention`, `nn.TransformerEncoder` / `nn.Transformer`",
                   streams="self, or encoder / decoder / cross", prefix="0",
                   readout="first token, last real token when causal"),),
)

#: Every family, in the order ``capture`` tries them: sentence-transformers before the transformers model it
#: wraps, Swin (transformers or timm) before both, CaiT before the other timm models.
FAMILIES: tuple[Family, ...] = (SENTENCE_TRANSFORMERS, SWIN, TRANSFORMERS, CAIT, TIMM, TORCH)

#: Any other model: the generic path (``capture(model, inputs, modules=..., to_probs=...)``), README's row.
GENERIC = Models(models="anything else", streams="`capture(model, inputs, modules=..., to_probs=...)`", prefix="0",
                 readout="first token")

#: The supported families, as the unsupported-model messages list them.
SUPPORTED_FAMILIES = "; ".join(f.supported for f in FAMILIES) + (
    ". Any other model: pass modules=[...] (modules, their names, or a regular expression over module names) and "
    "to_probs=f(module, args, output) -> (B, H, n, n) probabilities."
)
set_supported_families(SUPPORTED_FAMILIES)


def family_of(model: nn.Module) -> Family | None:
    """The first family whose ``detect`` accepts ``model``, or None."""
    return next((f for f in FAMILIES if f.detect(model)), None)


def adapter_for(model: nn.Module) -> Adapter | None:
    """The capture adapter of the first family that detects ``model`` (None: no family does)."""
    family = family_of(model)
    return None if family is None else family.adapter(model)


def facts_for(model: nn.Module) -> ModelFacts | None:
    """The facts of the first family with facts of its own that detects ``model`` (None: no such family)."""
    family = next((f for f in FAMILIES if f.facts is not None and f.detect(model)), None)
    return None if family is None else family.facts(model)  # type: ignore[misc]


def block_kinds() -> tuple[BlockKind, ...]:
    """Every family's block kinds, in registry order: the order the layer anatomy tries them in."""
    return tuple(k for f in FAMILIES for k in f.blocks)


def table_rows() -> list[str]:
    """README's family table rows, header excluded: every family's rows, the generic path, the refusals."""
    rows = [m.row() for f in FAMILIES for m in f.models] + [GENERIC.row()]
    return rows + [f"| refused, with the reason | {', '.join(refusals())} | – | – |"]


def refusals() -> list[str]:
    """Every family's refused models with their reasons, in registry order."""
    return [r for f in FAMILIES for r in f.refused]
