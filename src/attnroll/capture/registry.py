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

from .. import _checks
from . import hf_anatomy, open_clip, timm, torch_mha, transformer_lens
from .anatomy_parts import BlockKind
from .cait import CaitAdapter, is_cait
from .hf import HFAdapter, hf_facts, is_hf_model
from .hooks import Adapter, set_supported_families
from .mixers import KNOWN_MIXERS, MixerKind
from .qformer import qformer_adapter, qformer_facts
from .qwen_family import is_qwen_vl, qwen_facts, refuse_dense
from .record import ModelFacts
from .sentence_transformers import is_sentence_transformer, transformer_of
from .sentence_transformers import make_adapter as make_st_adapter
from .swin import is_swin
from .swin import make_adapter as make_swin_adapter
from .vlm import vlm_adapter, vlm_facts
from .vlm_maps import REFUSED_README as VLM_REFUSED
from .vlm_maps import mapped_adapter, mapped_facts

__all__ = ["Family", "Models", "Obstacle", "FAMILIES", "GENERIC", "METHOD_GROUPS", "SUPPORTED_FAMILIES", "family_of",
           "adapter_for", "facts_for", "block_kinds", "table_rows", "refusals", "refuse_known"]

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
class Obstacle:
    """Models of a family that attnroll refuses before any forward pass, with the obstacle they raise.

    ``applies(model)``: whether the model is one of them; ``readme``: the item of README's "refused" row
    (the models and, in brackets, the obstacle in a few words); ``reason``: the message's sentence after the
    model's name, naming what the model computes instead of a token-to-token attention matrix, and what to
    do instead."""

    applies: Callable[[nn.Module], bool]
    readme: str
    reason: str

    def refuse(self, model: nn.Module) -> None:
        """Raise the refusal (UnsupportedModelError) naming the model, its type and the obstacle."""
        kind = getattr(getattr(model, "config", None), "model_type", "")
        raise _checks.UnsupportedModelError(f"{type(model).__name__}{f' ({kind})' if kind else ''} {self.reason}")


def of_types(*model_types: str) -> Callable[[nn.Module], bool]:
    """An ``Obstacle.applies`` that accepts the transformers models of these ``config.model_type``s."""
    return lambda model: getattr(getattr(model, "config", None), "model_type", None) in model_types


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
    each with the reason, as README lists them; ``obstacles``: models refused before their adapter is built,
    each with the message naming its own obstacle (README lists their ``readme`` after ``refused``);
    ``mixers``: the kinds of token mixer other than softmax attention its models may hold in their block stack
    (:mod:`attnroll.capture.mixers` finds them by these and structurally; the methods refuse such a model unless
    ``mixers="attention_only"``; README lists them after ``obstacles``)."""

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
    obstacles: tuple[Obstacle, ...] = ()
    mixers: tuple[MixerKind, ...] = ()

    def __post_init__(self) -> None:
        unknown = [g for g in self.methods if g not in METHOD_GROUPS]
        if unknown or not self.methods:
            raise ValueError(f"family {self.name!r}: methods must be some of {METHOD_GROUPS}, got {self.methods!r}")
        if ("value-aware" in self.methods) != any(k.value_aware for k in self.blocks):
            raise ValueError(f"family {self.name!r}: 'value-aware' is listed exactly when a block kind of the "
                             "family says how the value-aware methods read it")


# ------------------------------------------------------------------------------- glue for the entries
def _transformers_adapter(model: nn.Module) -> Adapter:
    return qformer_adapter(model) or mapped_adapter(model) or vlm_adapter(model) or HFAdapter(model)


def _transformers_facts(model: nn.Module) -> ModelFacts:
    return qformer_facts(model) or mapped_facts(model) or vlm_facts(model) or hf_facts(model)


def _st_adapter(model: nn.Module) -> Adapter:
    """The sentence-transformers adapter, after the obstacles of the transformers model inside it."""
    refuse_known(transformer_of(model))
    return make_st_adapter(model)


def _st_facts(model: nn.Module) -> ModelFacts:
    return make_st_adapter(model).facts()


def _timm_facts(model: nn.Module) -> ModelFacts:
    return ModelFacts(family="timm", input_key="x", keyword_call=False)


def _is_swin(model: nn.Module) -> bool:
    return (is_hf_model(model) or timm.is_timm_model(model)) and is_swin(model)


def _is_cait(model: nn.Module) -> bool:
    return timm.is_timm_model(model) and is_cait(model)


_EMBEDDINGS = "from the embeddings: CLS = 1"


def _has_deformable_attention(model: nn.Module) -> bool:
    """A transformers model holding multi-scale deformable attention (``...MultiscaleDeformableAttention``)."""
    return is_hf_model(model) and any(type(m).__name__.lower().endswith("multiscaledeformableattention")
                                      for m in model.modules())


def _windowed_vitdet(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return of_types("vitdet")(model) and bool(getattr(config, "window_block_indices", None)) and (
        getattr(config, "window_size", 0) > 0)


def _seamless_all_tasks(model: nn.Module) -> bool:
    return of_types("seamless_m4t", "seamless_m4t_v2")(model) and all(
        hasattr(model, a) for a in ("speech_encoder", "text_encoder", "t2u_model"))


_NO_MATRIX = "attnroll refuses rather than invent a token-to-token matrix"

#: transformers models refused before the adapter looks for their attention, each naming its own obstacle.
TRANSFORMERS_OBSTACLES = (
    Obstacle(applies=of_types("rwkv"), readme="RWKV (recurrent, no attention)",
             reason="is a recurrent model (linear-attention RNN, a state-space-like recurrence): each layer carries a "
                    "running state from token to token instead of attending, so it has no attention matrices to "
                    "read or roll out."),
    Obstacle(applies=of_types("xlstm"),
             readme="xLSTM (recurrent, no attention)",
             reason="is a state-space / recurrent model: its layers carry a running state from token to token and "
                    "compute no attention, so it has no attention matrices to read or roll out."),
    Obstacle(applies=of_types("minimax"), readme="MiniMax (lightning attention recorded as attention)",
             reason="returns the blocks of its lightning-attention layers (linear attention over blocks of "
                    "config.block_size tokens with a decaying state) as attention weights: they are over padded "
                    "blocks, not a token-to-token softmax matrix, and its softmax layers alone would leave those "
                    f"layers out; {_NO_MATRIX}."),
    Obstacle(applies=of_types("longformer", "led"), readme="Longformer / LED (sliding windows)",
             reason="attends in a sliding window around each token (config.attention_window) plus a few global "
                    "tokens: each layer returns the window's weights (n x window), and no full token-to-token "
                    f"matrix exists; {_NO_MATRIX}. Use a full-attention model (BERT, RoBERTa) or "
                    "modules=/to_probs= with your own composition."),
    Obstacle(applies=of_types("albert"), readme="ALBERT (one layer shared by all)",
             reason="shares one layer's weights across all its layers (config.num_hidden_groups): the same "
                    "attention module runs once per layer, and attnroll records one attention module per layer, "
                    "so it cannot tell the layers' attention apart. Use a model with one module per layer "
                    "(BERT, RoBERTa, ELECTRA)."),
    Obstacle(applies=of_types("sam", "sam_vision_model", "sam_hq", "sam_hq_vision_model"),
             readme="SAM / SAM-HQ (windowed plus global attention)",
             reason="has an image encoder that attends inside local windows in most layers and globally only in "
                    "a few (config.global_attn_indexes), with relative position terms and no class token: its "
                    "windowed layers have no token-to-token matrix over the whole image, so there is no single "
                    f"product to roll out; {_NO_MATRIX}."),
    Obstacle(applies=_has_deformable_attention,
             readme="Deformable DETR / Grounding DINO / RT-DETR / Mask2Former and others with multi-scale "
                    "deformable attention (sampled points: no token-to-token matrix)",
             reason="uses deformable attention: each query samples a few points around its reference point on the "
                    "feature maps (learned offsets) and weights those samples, so its weights are over sampled "
                    f"points, not over tokens, and no token-to-token matrix exists; {_NO_MATRIX}. DETR and "
                    "Conditional DETR attend over tokens."),
    Obstacle(applies=_windowed_vitdet, readme="ViTDet with window blocks (windowed plus global attention)",
             reason="attends inside local windows in the blocks of config.window_block_indices and globally in the "
                    "others: its windowed layers have no token-to-token matrix over the whole image, so there is no "
                    f"single product to roll out; {_NO_MATRIX}. A ViTDet without window blocks is explained."),
    Obstacle(applies=of_types("yoso"), readme="YOSO (sampled attention: no probabilities)",
             reason="approximates softmax attention by locality-sensitive hashing (You Only Sample Once): it never "
                    "forms attention probabilities, and what it returns is not a token-to-token matrix; "
                    f"{_NO_MATRIX}."),
    Obstacle(applies=of_types("reformer"), readme="Reformer (chunked local and LSH-bucket attention)",
             reason="attends inside chunks of the sequence (local attention) and inside hash buckets (LSH "
                    "attention): each layer's weights cover one chunk or bucket of keys, sorted by hash, and no "
                    f"full token-to-token matrix exists; {_NO_MATRIX}."),
    Obstacle(applies=of_types("squeezebert"), readme="SqueezeBERT (returns scores)",
             reason="returns its attention scores before the softmax as its attentions (not the probabilities its "
                    f"output is computed from), so there is no row-stochastic matrix to roll out; {_NO_MATRIX}. "
                    "Use modules=/to_probs= with a softmax of those scores if that is what you want."),
    Obstacle(applies=of_types("levit"), readme="LeViT (subsampling attention between stages)",
             reason="shrinks its token grid between stages inside attention blocks (queries from a subsampled grid, "
                    "LevitAttentionSubsample) and returns no attention weights, so there is no one token set to "
                    f"roll out over; {_NO_MATRIX}."),
    Obstacle(applies=of_types("mobilevit", "mobilevitv2"), readme="MobileViT (attention across patches per pixel)",
             reason="attends between patches separately at each pixel position of an unfolded feature map "
                    "(MobileViTv2: separable linear attention) inside a convolutional network, and returns no "
                    f"attention weights: there is no attention over the image's tokens as one set; {_NO_MATRIX}."),
    Obstacle(applies=_seamless_all_tasks, readme="SeamlessM4T(v2)Model (all tasks in one model)",
             reason="holds a speech encoder, a text encoder and a text-to-unit model, of which one forward pass runs "
                    "only some (the encoder of the given input), so its attention modules do not form one stack per "
                    "stream. Explain the task's own model: SeamlessM4TForTextToText or SeamlessM4TForSpeechToText "
                    "(streams encoder, decoder, cross)."),
)

# ------------------------------------------------------------------------------- the entries
SENTENCE_TRANSFORMERS = Family(
    name="sentence-transformers", detect=is_sentence_transformer, adapter=_st_adapter, facts=_st_facts,
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


def _qwen(model_type: str) -> Callable[[nn.Module], bool]:
    return lambda model: is_qwen_vl(model) and model.config.model_type == model_type


_QWEN_STREAMS = ("vision (its kernels' q/k per image chunk of `cu_seqlens`, probabilities recomputed matrix-free), "
                 "language; no dense record: `capture` refuses, `explain` composes")
_QWEN_READOUT = ("language: last real token (`position=`: a generated token's row); image tokens found from "
                 "`image_token_id`, each spread over its 2×2 patches (¼ each, a convention), rolled out through the "
                 "vision tower onto each image's `grid_thw` patch grid (several images per prompt: one map each); "
                 "`rollout`, `raw`, `grad_rollout`, `gae`, the rest refuse")


def _qwen_family(name: str, model_type: str, models: str, streams: str, readout: str) -> Family:
    return Family(
        name=name, detect=_qwen(model_type), adapter=refuse_dense, facts=qwen_facts,
        supported=f"transformers {models} (explain only: vision tower recomputed per chunk, composed with the "
                  "language model)",
        readout="the language model's last real token; composition in explain.qwen_vl (capture.qwen_vl)",
        methods=("attention", "gradient", "matrix-free"),
        models=(Models(models=f"transformers {models} (vision-language)", streams=streams, prefix="0",
                       readout=readout),),
    )


QWEN2_VL = _qwen_family("qwen2-vl", "qwen2_vl", "Qwen2-VL", _QWEN_STREAMS, _QWEN_READOUT)
QWEN2_5_VL = _qwen_family(
    "qwen2.5-vl", "qwen2_5_vl", "Qwen2.5-VL", _QWEN_STREAMS.replace("per image chunk", "per window (per image in "
                                                                   "`fullatt_block_indexes`)"),
    _QWEN_READOUT.replace("rolled out", "window order undone, rolled out"))
QWEN3_VL = _qwen_family(
    "qwen3-vl", "qwen3_vl", "Qwen3-VL", _QWEN_STREAMS,
    _QWEN_READOUT.replace("rolled out", "split equally between the final merger and each deepstack merger (entering "
                                        "the tower at the layer it reads), rolled out"))

TRANSFORMERS = Family(
    name="transformers", detect=is_hf_model, adapter=_transformers_adapter, facts=_transformers_facts,
    blocks=hf_anatomy.BLOCKS,
    supported="Hugging Face transformers: ViT, DeiT (incl. distilled ...WithTeacher), BEiT, DINOv2 (with "
              "registers), YOLOS, ViTMAE, AST, BERT-likes, GPT-2, Llama-family decoders, CLIP (vision and text "
              "towers), T5, BART, Marian, VisionEncoderDecoder, LLaVA, LLaVA-NeXT, LLaVA-OneVision, PaliGemma, "
              "VipLLaVA, Gemma 3, Idefics3, "
              "SmolVLM, InternVL, Aya Vision, Mistral 3, BLIP-2, InstructBLIP (vision and language streams) "
              "(and other transformers models that declare attention outputs), plus families without a declaration "
              "through output_attentions=True (DeBERTa, MPNet, BLOOM, Falcon, GPT-Neo, RoFormer, XLM, ...)",
    readout="per model type and head (hf.HFAdapter.readout_spec; vision-language models: vlm.VLMAdapter)",
    methods=("attention", "gradient", "value-aware", "matrix-free"),
    models=(
        Models(models="transformers ViT, DINOv2, ViT-MSN, I-JEPA-likes", streams="self", prefix=_EMBEDDINGS,
               readout="CLS; DINOv2's image classifiers: ½ on CLS, ½ over the patch rows (they read CLS ⊕ the "
                       "patch mean)"),
        Models(models="transformers DeiT (distilled `...WithTeacher` too)", streams="self",
               prefix="CLS + distillation = 2",
               readout="CLS; `...WithTeacher`: rows 0 and 1 at ½ each (its logits average both heads)"),
        Models(models="transformers DINOv2 with registers", streams="self", prefix="1 + R registers",
               readout="CLS; image classifiers: ½ on CLS, ½ over the patch rows, registers left out"),
        Models(models="transformers BEiT, Data2Vec-Vision", streams="self", prefix="1",
               readout="mean of the patch rows when `use_mean_pooling`, else CLS"),
        Models(models="transformers YOLOS", streams="self", prefix="1 (3+ detection tokens as suffix)",
               readout="the detection tokens' rows (one object: `position=`)"),
        Models(models="transformers ViTMAE", streams="self", prefix="1",
               readout="CLS; patches put back in order with `ids_restore` (dense route, gradients too); refused when "
                       "masking (`mask_ratio` > 0: a random subset of the patches)"),
        Models(models="transformers AST (audio spectrogram)", streams="self",
               prefix="2; grid = frequency × time patches", readout="mean of rows 0 and 1 (its pooler)"),
        Models(models="transformers BERT, RoBERTa, DistilBERT, ELECTRA, ...", streams="self",
               prefix="0 (text)", readout="CLS; mean of the real tokens from a sentence-transformers "
                                          "`1_Pooling/config.json` in the model folder"),
        Models(models="transformers DeBERTa(-v2/v3), MPNet, RoFormer, XLM, BLOOM, Falcon, GPT-Neo, MPT, ... (no "
                      "output recorder)", streams="self (public `output_attentions=True` path)", prefix="0",
               readout="CLS, or the last real token when causal"),
        Models(models="transformers GPT-2, Llama-family, TimesFM (causal)", streams="self", prefix="0",
               readout="last real token (causal by the attention modules' own flag too)"),
        Models(models="transformers Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V2 / V3 "
                      "(mixture-of-experts decoders)",
               streams="self", prefix="0",
               readout="last real token; the value-aware methods read the MLP as the weighted sum of the experts "
                       "each token's router chose, its weights held at the forward's (plus the shared experts: "
                       "Qwen2-MoE's gated, DeepSeek's), and DeepSeek's latent attention with its latent norm's "
                       "divisor frozen; GPT-OSS's attention sinks take a share of each row, which the dense capture "
                       "refuses: its value-aware maps need sinks that take none"),
        Models(models="transformers DiffLlama (differential attention)",
               streams="self: per head pair the signed matrix softmax₁ − λ·softmax₂ that multiplies the values "
                       "(capture/diffllama.py), every layer listed non-stochastic",
               prefix="0",
               readout="last real token; `raw`, `grad_rollout`, `gae`, `attn_gradcam` read the signed matrices; "
                       "`rollout`, `per_head_rollout`, `flow` and the value-aware methods refuse them (rows sum to "
                       "1 − λ, signed); dense only"),
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
        Models(models="transformers VipLLaVA, Gemma 3, Idefics3, SmolVLM, InternVL, Aya Vision, Mistral 3 "
                      "(vision-language, one image per prompt)",
               streams="vision, language; each image token a fixed linear map of vision tokens, read off the "
                       "model's own projector code (`capture/vlm_maps.py`)",
               prefix="vision: 1 (CLIP, InternViT), 0 (SigLIP, Pixtral)",
               readout="language: last real token; pixel shuffle / patch merging: 1/s² per merged vision token "
                       "(a convention); Gemma 3's average pooling: its own weights; VipLLaVA: 1/J per read layer; "
                       "image splitting (Idefics3 / SmolVLM `rows=` `cols=`, InternVL / Aya Vision `image_sizes=`): "
                       "tiles and the global view put back on the original image (`capture/vlm_split.py`)"),
        Models(models="transformers BLIP-2, InstructBLIP (vision-language through a Q-Former, one image per prompt)",
               streams="vision, qformer (the queries' (+ instruction's) self-attention), language; the Q-Former's "
                       "cross-attention kept beside them (`capture/qformer.py`)",
               prefix="vision: 1 (CLS)",
               readout="language: last real token; each image token (a query) rolled out through the Q-Former "
                       "(self- and cross-attention, residual ½), its learned-query and instruction parts kept as "
                       "`extra[\"queries_share\"]` / `[\"instruction_share\"]`"),
        Models(models="transformers LLaVA-NeXT, LLaVA-OneVision (vision-language, any-resolution tiles)",
               streams="vision (batch = base view + tiles), language; tile tokens read off the model's own "
                       "`pack_image_features` (`capture/vlm_tiles.py`)",
               prefix="1 slot on the canvas: CLS and tile padding",
               readout="language: last real token; map on the original image (the unpadded tile grid): tiles put "
                       "back, the base view by area, newline tokens spread over the row they close"),
        Models(models="transformers Mamba, Mamba2, Falcon-Mamba (state-space)",
               streams="self: each mixer one layer, its per-channel matrices (causal conv, SiLU and output gate held "
                       "at their values, scan) fused by the mean of |·|, rows normalised",
               prefix="0", readout="last real token; `rollout`, `raw`, `flow`, `grad_rollout`, `gae` compose it, "
                                   "the rest refuse it naming the mixer; `rollout` rows only through the mixers "
                                   "(matrix-free), the rest dense"),
        Models(models="transformers Jamba, Bamba, Nemotron-H, GraniteMoeHybrid (Mamba / Mamba-2 + attention), LFM2, "
                      "LFM3 (gated short convolutions + attention), Qwen3-Next (gated DeltaNet + attention)",
               streams="self: attention and mixer layers in execution order, each mixer's fused matrix (as above; "
                       "LFM2: C · conv(B · x) per channel; Qwen3-Next: the delta rule per value head, its convolution "
                       "composed apart) repeated on every head", prefix="0",
               readout="last real token; `rollout`, `raw`, `flow`, `grad_rollout`, `gae` compose it, the rest "
                       "refuse it naming the mixer; `rollout` rows only through the mixers (matrix-free), the "
                       "rest dense"),
        Models(models="transformers Qwen3.5, OLMo-Hybrid (gated DeltaNet + attention), Kimi-Linear (KDA: a delta "
                      "rule with a per-channel decay + attention), RecurrentGemma (RG-LRU blocks + local attention)",
               streams="self: attention and mixer layers in execution order (`capture/hybrids.py`), each mixer's "
                       "fused matrix (the delta rule per value head, its convolution apart; RecurrentGemma: the "
                       "convolution, then the RG-LRU with its gates held, the GeLU branch a diagonal) on every head",
               prefix="0", readout="last real token; `rollout`, `raw`, `flow`, `grad_rollout`, `gae` compose it, "
                                   "the rest refuse it naming the mixer; `rollout` rows only through the mixers "
                                   "(matrix-free), the rest dense"),
        Models(models="transformers Falcon-H1 (attention and Mamba-2 in parallel in each layer), Zamba, Zamba2 "
                      "(Mamba / Mamba-2 layers fed by a shared attention block)",
               streams="self: one layer per decoder layer (`capture/hybrids.py` Wiring): Falcon-H1 w_a·A_h + "
                       "w_m·M_SSD; Zamba's hybrid layers M·(w_h·I + w_T·A_h); weights per token by the norm of each "
                       "summed path (multipliers included)", prefix="0",
               readout="last real token; `rollout`, `raw`, `flow`, `grad_rollout` and `gae` (each path's "
                       "gradient-weighted matrix joined the same way) compose it, the rest refuse it naming the mixer; "
                       "`rollout` rows only too (matrix-free: `core.joined`; Zamba's max / min head fusion dense), the "
                       "rest dense"),
        Models(models="transformers T5, BART, Marian, VisionEncoderDecoder, SeamlessM4T `...ForTextToText`",
               streams="encoder, decoder, cross",
               prefix="encoder from its embeddings (1 for a ViT encoder)", readout="decoder: last real token"),
    ),
    refused=(
        "SegFormer / PVT / Hiera / Funnel / Canine (token count changes between layers)",
        "block-sparse BigBird",
        "LLaVA-NeXT-Video (video frames pooled)",
        *VLM_REFUSED,
        "ViLT (text tokens + image CLS + patches sampled in a random order in one sequence)",
    ),
    obstacles=TRANSFORMERS_OBSTACLES,
    mixers=KNOWN_MIXERS,
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

TRANSFORMER_LENS = Family(
    name="transformer_lens", detect=transformer_lens.is_transformer_lens,
    adapter=transformer_lens.TransformerLensAdapter,
    supported="TransformerLens 4 TransformerBridge models (read at blocks.{i}.attn.hook_pattern)",
    readout="the last real token (causal; hooks.Adapter.readout_spec)",
    methods=("attention", "gradient"),
    models=(Models(models="TransformerLens 4 `TransformerBridge`",
                   streams="self (`blocks.{i}.attn.hook_pattern`)", prefix="0",
                   readout="last real token (causal); inputs: token ids, or "
                           "`{\"input\": ids, \"attention_mask\": m}`"),),
)

OPEN_CLIP = Family(
    name="open_clip", detect=open_clip.is_open_clip, adapter=open_clip.OpenClipAdapter,
    supported="open_clip CLIP / CustomTextCLIP with transformer towers, and their VisionTransformer / TextTransformer "
              "towers alone",
    readout="vision: pool_type or the attention pooler; text: the pooled token "
            "(open_clip.OpenClipAdapter.readout_spec)",
    methods=("attention", "gradient"),
    models=(Models(
        models="open_clip `CLIP`, `CustomTextCLIP` (transformer towers); `VisionTransformer`, `TextTransformer` alone",
        streams="vision, text", prefix="1 (vision: the class token)",
        readout="vision: CLS (`pool_type='tok'`), mean of the patch rows (`'avg'`), or the attention pooler's own "
                "attention (`attentional_pool`: its first query, the mean of the others, the `'parallel'` / "
                "`'cascade'` contrastive query); text: the pooled token (`'argmax'`: end-of-text, `'eos'`, "
                "`'first'`, `'last'`, an appended class token)"),),
    refused=("open_clip CoCa and towers that are not transformers of nn.MultiheadAttention (ModifiedResNet, timm "
             "and Hugging Face towers: explain that model itself)",),
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
#: wraps, Swin (transformers or timm) and Qwen VLs before both, CaiT before the other timm models, open_clip
#: before the torch family (its towers are nn.MultiheadAttention too, but two streams with their own readouts).
FAMILIES: tuple[Family, ...] = (SENTENCE_TRANSFORMERS, SWIN, QWEN2_VL, QWEN2_5_VL, QWEN3_VL, TRANSFORMERS, CAIT, TIMM,
                                TRANSFORMER_LENS, OPEN_CLIP,
                                TORCH)

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
    """The capture adapter of the first family that detects ``model`` (None: no family does); a model one of
    the family's obstacles applies to is refused first, naming it."""
    family = family_of(model)
    if family is None:
        return None
    refuse_known(model, family)
    return family.adapter(model)


def refuse_known(model: nn.Module, family: Family | None = None) -> None:
    """Raise the refusal of the first obstacle of ``family`` (default: the model's family) that applies to
    ``model``; nothing when none does."""
    family = family_of(model) if family is None else family
    for obstacle in () if family is None else family.obstacles:
        if obstacle.applies(model):
            obstacle.refuse(model)


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
    return [r for f in FAMILIES for r in (*f.refused, *(o.readme for o in f.obstacles), *(
        f"{k.models} ({k.kind}; `mixers=\"attention_only\"` rolls out through their attention layers alone)"
        for k in f.mixers if k.models))]
