"""The layer anatomy of transformers blocks: one builder per block layout, recognised by its structure (never
by the model's class name), and the heads of the transformers models whose logit layer is read.

* BERT family (BERT, RoBERTa, ELECTRA, ...): post-norm; ``attention.self.{query,key,value}``,
  ``attention.output.{dense, LayerNorm}``, ``intermediate.dense``, ``output.{dense, LayerNorm}``;
* DistilBERT: post-norm; ``attention.{q,k,v,out}_lin``, ``sa_layer_norm``, ``ffn.lin1/lin2``,
  ``output_layer_norm``;
* ViT / DeiT (``layernorm_before``, ``attention.{q,k,v,o}_proj``, ``layernorm_after``, ``mlp.fc1/fc2``) and
  DINOv2 (``norm1``, ``layer_scale1``, ``norm2``, ``mlp``, ``layer_scale2``): pre-norm;
* GPT-2 (``ln_1``, fused ``attn.c_attn`` / ``attn.c_proj`` as Conv1D, ``ln_2``, ``mlp.c_fc`` / ``c_proj``):
  pre-norm;
* Llama family (``input_layernorm`` / ``post_attention_layernorm`` RMSNorms, ``self_attn.{q,k,v,o}_proj``
  with grouped KV heads, gated ``mlp.{gate,up,down}_proj``): pre-norm; with a mixture of experts as its MLP
  (``mlp.experts`` stacks and a router: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS) :attr:`LayerAnatomy.experts`;
  DeepSeek-V2 / V3 too (multi-head latent attention, ``self_attn.kv_b_proj``: :attr:`LayerAnatomy.latent`);
* DiffLlama (differential attention, ``self_attn.lambda_q1``): recognised and refused, naming why;
* BEiT (the ViT names plus block-level ``lambda_1`` / ``lambda_2`` scales) and Data2Vec-Vision
  (``attention.attention.{query,key,value}``, ``layernorm_before`` / ``layernorm_after``, λ scales): pre-norm;
* CLIP / SigLIP encoder layers, vision and text (``layer_norm1``, ``self_attn.{q,k,v,out}_proj``,
  ``layer_norm2``, ``mlp.fc1/fc2``): pre-norm;
* wav2vec2 / HuBERT / SEW / UniSpeech / Data2Vec-Audio encoder layers (``attention.{q,k,v,out}_proj``,
  ``layer_norm``, ``feed_forward``, ``final_layer_norm``): post-norm or stable-layer-norm (pre-norm), the
  layout probed on a hook-free copy of the block;
* BART-style encoder / decoder layers (BART, mBART, Marian, Pegasus, Whisper, M2M100, ...; layout probed)
  and T5-style blocks (T5, mT5, UMT5; pre-norm RMS). A decoder block's cross-attention is
  :attr:`~attnroll.capture.layers.LayerAnatomy.cross`: sanity re-draws its q / k with "qk" and its v / o with
  "value"; the value-aware methods refuse blocks that have one.

:data:`BLOCKS` holds their :class:`~attnroll.capture.anatomy_parts.BlockKind` records in the order they are
tried (the first match wins), as the family registry lists them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .anatomy_parts import BlockKind, HeadReader, block_scale, fused, heads_of, norms, probe_residual, proj, real_module
from .layers import Experts, LayerAnatomy, Proj

__all__ = ["BLOCKS", "hf_head"]


# ------------------------------------------------------------------------------------------- builders
def _bert(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    sa = m.attention.self
    heads = int(getattr(sa, "num_attention_heads", 0) or sa.config.num_attention_heads)
    q, k, v = (proj(m, f"attention.self.{n}") for n in ("query", "key", "value"))
    return LayerAnatomy(
        index=i, module=m, path=path, attention=sa, q=q, k=k, v=v, o=proj(m, "attention.output.dense"),
        heads=heads, kv_heads=heads, pre_norm=False, norm1=m.attention.output.LayerNorm, norm2=m.output.LayerNorm,
        norms=norms(m, ("attention.output.LayerNorm", "output.LayerNorm")), fc1=proj(m, "intermediate.dense"),
        act=m.intermediate.intermediate_act_fn, fc2=proj(m, "output.dense"),
    )


def _distilbert(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.attention
    heads, _ = heads_of(att)
    q, k, v, o = (proj(m, f"attention.{n}_lin") for n in ("q", "k", "v", "out"))
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=o, heads=heads, kv_heads=heads,
        pre_norm=False, norm1=m.sa_layer_norm, norm2=m.output_layer_norm,
        norms=norms(m, ("sa_layer_norm", "output_layer_norm")), fc1=proj(m, "ffn.lin1"), act=m.ffn.activation,
        fc2=proj(m, "ffn.lin2"),
    )


def _vit(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.attention
    heads, _ = heads_of(att)
    n1, n2 = ("layernorm_before", "layernorm_after") if hasattr(m, "layernorm_before") else ("norm1", "norm2")
    q, k, v, o = (proj(m, f"attention.{n}_proj") for n in ("q", "k", "v", "o"))
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=o, heads=heads, kv_heads=heads,
        pre_norm=True, norm1=getattr(m, n1), norm2=getattr(m, n2), norms=norms(m, (n1, n2)),
        fc1=proj(m, "mlp.fc1"), act=m.mlp.activation_fn, fc2=proj(m, "mlp.fc2"),
        ls1=real_module(getattr(m, "layer_scale1", None)), ls2=real_module(getattr(m, "layer_scale2", None)),
    )


def _gpt2(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.attn
    q, k, v = fused(m, "attn.c_attn", att.embed_dim, in_out=True)
    heads = int(att.num_heads)
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=proj(m, "attn.c_proj", in_out=True),
        heads=heads, kv_heads=heads, pre_norm=True, norm1=m.ln_1, norm2=m.ln_2, norms=norms(m, ("ln_1", "ln_2")),
        fc1=proj(m, "mlp.c_fc", in_out=True), act=m.mlp.act, fc2=proj(m, "mlp.c_proj", in_out=True),
    )


def _mla(m: nn.Module) -> tuple[int, Proj, Proj, Proj, tuple[Proj, nn.Module]]:
    """Multi-head latent attention (DeepSeek-V2 / V3): every head reads its own values, v_h = W_b,h ·
    RMS(W_a x̃) with W_a the first ``kv_lora_rank`` rows of ``kv_a_proj_with_mqa`` (the rest is the shared rotary
    key) and W_b,h head h's value rows of ``kv_b_proj`` (per head: ``qk_nope_head_dim`` key rows, then
    ``v_head_dim`` value rows). (heads, q, k, v, (W_a, the latent's norm))."""
    att = m.self_attn
    heads, nope, dv, r = int(att.num_heads), int(att.qk_nope_head_dim), int(att.v_head_dim), int(att.kv_lora_rank)
    per = torch.arange(heads).unsqueeze(1) * (nope + dv)
    v_rows, k_rows = (per + nope + torch.arange(dv)).flatten(), (per + torch.arange(nope)).flatten()
    q = proj(m, "self_attn.q_b_proj" if getattr(att, "q_b_proj", None) is not None else "self_attn.q_proj")
    latent = (proj(m, "self_attn.kv_a_proj_with_mqa", rows=slice(0, r)), att.kv_a_layernorm)
    return heads, q, proj(m, "self_attn.kv_b_proj", rows=k_rows), proj(m, "self_attn.kv_b_proj", rows=v_rows), latent


def _llama(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.self_attn
    latent = None
    if hasattr(att, "kv_b_proj"):  # DeepSeek-V2 / V3: every head its own latent values
        heads, q, k, v, latent = _mla(m)
        kv, o = heads, proj(m, "self_attn.o_proj")
    else:
        heads, kv = heads_of(att)
        q, k, v, o = (proj(m, f"self_attn.{n}_proj") for n in ("q", "k", "v", "o"))
    experts = _experts(m)
    if experts is not None:  # a mixture of experts: fc1 / gate / fc2 are its first expert's (the widths)
        (fc1, gate, fc2), act = experts.routed[0], experts.act
    else:
        fc1, gate, fc2, act = proj(m, "mlp.up_proj"), proj(m, "mlp.gate_proj"), proj(m, "mlp.down_proj"), m.mlp.act_fn
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=o, heads=heads, kv_heads=kv,
        pre_norm=True, norm1=m.input_layernorm, norm2=m.post_attention_layernorm,
        norms=norms(m, ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                        "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")),
        fc1=fc1, act=act, fc2=fc2, gate=gate, experts=experts, latent=latent,
    )


def _has_experts(m: nn.Module) -> bool:
    """A block whose ``mlp`` routes tokens to experts stored as (E, ...) stacks (``mlp.experts.gate_up_proj``)."""
    return isinstance(getattr(getattr(getattr(m, "mlp", None), "experts", None), "gate_up_proj", None), nn.Parameter)


def _clamped_glu(limit: float, alpha: float):
    """GPT-OSS's gate activation: g ↦ min(g, limit) · sigmoid(alpha · min(g, limit))."""
    def act(g: torch.Tensor) -> torch.Tensor:
        g = g.clamp(max=limit)
        return g * torch.sigmoid(g * alpha)
    return act


def _experts(m: nn.Module) -> Experts | None:
    """The mixture of experts of a Llama-style block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS), or None
    for a dense MLP. Experts are stored as stacks: ``gate_up_proj`` (E, 2f, d) with the gate rows first, and
    ``down_proj`` (E, d, f); GPT-OSS's are (E, d, 2f) with gate and up interleaved (even / odd columns), with
    biases, and clamp both before its gate (min(g, limit) · sigmoid(α · min(g, limit))) and up path
    (clamp(u, ±limit) + 1). The router is ``mlp.gate`` (``mlp.router`` for GPT-OSS); Qwen2-MoE adds a shared
    expert scaled by sigmoid(``shared_expert_gate``(h))."""
    if not _has_experts(m):
        return None
    mlp, ex = m.mlp, m.mlp.experts
    oss = hasattr(ex, "limit") and hasattr(ex, "alpha") and hasattr(ex, "gate_up_proj_bias")
    f = ex.gate_up_proj.shape[2 if oss else 1] // 2
    gate_rows, up_rows = (slice(0, None, 2), slice(1, None, 2)) if oss else (slice(0, f), slice(f, 2 * f))
    up_bias, down_bias = ("gate_up_proj_bias", "down_proj_bias") if oss else (None, None)

    def one(e: int) -> tuple[Proj, Proj, Proj]:
        up, gate = (Proj(module=ex, path="mlp.experts", weight="gate_up_proj", bias=up_bias, rows=rows, expert=e,
                         in_out=oss) for rows in (up_rows, gate_rows))
        return up, gate, Proj(module=ex, path="mlp.experts", weight="down_proj", bias=down_bias, expert=e, in_out=oss)

    shared = ()
    name = next((n for n in ("shared_expert", "shared_experts") if isinstance(getattr(mlp, n, None), nn.Module)), None)
    if name is not None:  # Qwen2-MoE's (gated), DeepSeek's (weight 1)
        shared = ((proj(m, f"mlp.{name}.up_proj"), proj(m, f"mlp.{name}.gate_proj"), proj(m, f"mlp.{name}.down_proj")),)
    router = proj(m, "mlp.router" if oss else "mlp.gate")
    act = _clamped_glu(float(ex.limit), float(ex.alpha)) if oss else ex.act_fn
    up_act = (lambda u, lim=float(ex.limit): u.clamp(-lim, lim)) if oss else None
    return Experts(module=mlp, path="mlp", source=ex, routed=tuple(one(e) for e in range(ex.gate_up_proj.shape[0])),
                   shared=shared, shared_gate=getattr(mlp, "shared_expert_gate", None) if shared else None,
                   router=(router,), act=act, up_act=up_act, up_offset=1.0 if oss else 0.0)


def _beit(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """BEiT (ViT names, block-level ``lambda_1`` / ``lambda_2`` scales): pre-norm."""
    layer = _vit(i, path, m)
    return replace(layer, ls1=block_scale(m, "lambda_1"), ls2=block_scale(m, "lambda_2"))


def _d2v_vision(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """Data2Vec-Vision (BERT names inside, ``layernorm_before`` / ``layernorm_after``, λ scales): pre-norm."""
    sa = m.attention.attention
    heads, _ = heads_of(sa)
    q, k, v = (proj(m, f"attention.attention.{n}") for n in ("query", "key", "value"))
    return LayerAnatomy(
        index=i, module=m, path=path, attention=sa, q=q, k=k, v=v, o=proj(m, "attention.output.dense"),
        heads=heads, kv_heads=heads, pre_norm=True, norm1=m.layernorm_before, norm2=m.layernorm_after,
        norms=norms(m, ("layernorm_before", "layernorm_after")), fc1=proj(m, "intermediate.dense"),
        act=m.intermediate.intermediate_act_fn, fc2=proj(m, "output.dense"),
        ls1=block_scale(m, "lambda_1"), ls2=block_scale(m, "lambda_2"),
    )


def _clip(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """CLIP / SigLIP encoder layers (vision and text): ``layer_norm1``, ``self_attn.{q,k,v,out}_proj``,
    ``layer_norm2``, ``mlp.fc1`` / ``fc2``: pre-norm."""
    att = m.self_attn
    heads, _ = heads_of(att)
    q, k, v, o = (proj(m, f"self_attn.{n}_proj") for n in ("q", "k", "v", "out"))
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=o, heads=heads, kv_heads=heads,
        pre_norm=True, norm1=m.layer_norm1, norm2=m.layer_norm2, norms=norms(m, ("layer_norm1", "layer_norm2")),
        fc1=proj(m, "mlp.fc1"), act=m.mlp.activation_fn, fc2=proj(m, "mlp.fc2"),
    )


def _wav2vec2_layout(i: int, path: str, m: nn.Module, pre_norm: bool) -> LayerAnatomy:
    att = m.attention
    heads, _ = heads_of(att)
    q, k, v, o = (proj(m, f"attention.{n}_proj") for n in ("q", "k", "v", "out"))
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=o, heads=heads, kv_heads=heads,
        pre_norm=pre_norm, norm1=m.layer_norm, norm2=m.final_layer_norm,
        norms=norms(m, ("layer_norm", "final_layer_norm")), fc1=proj(m, "feed_forward.intermediate_dense"),
        act=m.feed_forward.intermediate_act_fn, fc2=proj(m, "feed_forward.output_dense"),
    )


def _wav2vec2(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """wav2vec2 / HuBERT encoder layers (``attention.{q,k,v,out}_proj``, ``layer_norm``,
    ``feed_forward.{intermediate,output}_dense``, ``final_layer_norm``). The post-norm and the stable-layer-norm
    (pre-norm) variants hold the same parameters: which one the block computes is probed (:func:`probe_residual`)."""
    return _wav2vec2_layout(i, path, m, probe_residual(m, _wav2vec2_layout))


def _bart_layout(i: int, path: str, m: nn.Module, pre_norm: bool) -> LayerAnatomy:
    att = m.self_attn
    heads, _ = heads_of(att)
    q, k, v, o = (proj(m, f"self_attn.{n}_proj") for n in ("q", "k", "v", "out"))
    cross = None
    if getattr(m, "encoder_attn", None) is not None:
        cross = tuple(proj(m, f"encoder_attn.{n}_proj") for n in ("q", "k", "v", "out"))
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=o, heads=heads, kv_heads=heads,
        pre_norm=pre_norm, norm1=m.self_attn_layer_norm, norm2=m.final_layer_norm,
        norms=norms(m, ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")),
        fc1=proj(m, "fc1"), act=m.activation_fn, fc2=proj(m, "fc2"), cross=cross,  # type: ignore[arg-type]
    )


def _bart(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """BART-style encoder and decoder layers (BART, mBART, Marian, Pegasus, Whisper, M2M100, ...):
    ``self_attn.{q,k,v,out}_proj``, ``self_attn_layer_norm``, ``fc1`` / ``fc2``, ``final_layer_norm``, and in
    decoder layers the cross-attention ``encoder_attn.*`` (:attr:`LayerAnatomy.cross`) with its norm. Post-norm
    (BART, Marian) or pre-norm (mBART, Whisper) is probed (:func:`probe_residual`, without encoder states)."""
    return _bart_layout(i, path, m, probe_residual(m, _bart_layout))


def _t5(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """T5-style blocks (T5, mT5, UMT5): ``layer.0`` self-attention (``SelfAttention.{q,k,v,o}``, RMS
    ``layer_norm``; its relative attention bias only shapes the scores), in decoder blocks ``layer.1`` the
    cross-attention (``EncDecAttention``, :attr:`LayerAnatomy.cross`), last the MLP (``DenseReluDense.wi`` /
    ``wo``, or gated ``wi_0`` (gate) / ``wi_1``): pre-norm."""
    last = len(m.layer) - 1
    sa, ff = m.layer[0].SelfAttention, m.layer[last].DenseReluDense
    heads, _ = heads_of(sa)
    q, k, v, o = (proj(m, f"layer.0.SelfAttention.{n}") for n in "qkvo")
    ffp = f"layer.{last}.DenseReluDense"
    fc1, gate = ((proj(m, f"{ffp}.wi_1"), proj(m, f"{ffp}.wi_0")) if hasattr(ff, "wi_0")
                 else (proj(m, f"{ffp}.wi"), None))
    cross = tuple(proj(m, f"layer.1.EncDecAttention.{n}") for n in "qkvo") if last == 2 else None
    return LayerAnatomy(
        index=i, module=m, path=path, attention=sa, q=q, k=k, v=v, o=o, heads=heads, kv_heads=heads,
        pre_norm=True, norm1=m.layer[0].layer_norm, norm2=m.layer[last].layer_norm,
        norms=norms(m, tuple(f"layer.{j}.layer_norm" for j in range(last + 1))), fc1=fc1, act=ff.act,
        fc2=proj(m, f"{ffp}.wo"), gate=gate, cross=cross,  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------------------------------- recognisers
def _is_d2v_vision(m: nn.Module) -> bool:
    # (YOLOS shares the names without λ; its detection-token forward is not checked here)
    att = getattr(m, "attention", None)
    return att is not None and hasattr(getattr(att, "attention", None), "value") and hasattr(
        m, "intermediate") and hasattr(m, "layernorm_before") and hasattr(m, "lambda_1")


def _is_beit(m: nn.Module) -> bool:
    att = getattr(m, "attention", None)
    return att is not None and hasattr(att, "v_proj") and hasattr(getattr(m, "mlp", None), "fc1") and (
        isinstance(getattr(m, "lambda_1", None), nn.Parameter))


def _is_wav2vec2(m: nn.Module) -> bool:
    att = getattr(m, "attention", None)
    return att is not None and hasattr(att, "out_proj") and hasattr(
        getattr(m, "feed_forward", None), "output_dense") and hasattr(m, "final_layer_norm")


def _is_t5(m: nn.Module) -> bool:
    layers = getattr(m, "layer", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) not in (2, 3):
        return False
    first, last = layers[0], layers[len(layers) - 1]
    return hasattr(first, "SelfAttention") and hasattr(first, "layer_norm") and hasattr(last, "DenseReluDense") and (
        len(layers) == 2 or hasattr(layers[1], "EncDecAttention"))


def _is_bart(m: nn.Module) -> bool:
    # (OPT shares the names; its value path through the capture is not checked: not described)
    return hasattr(m, "self_attn_layer_norm") and hasattr(getattr(m, "self_attn", None), "out_proj") and hasattr(
        m, "fc1") and hasattr(m, "final_layer_norm") and not hasattr(m, "do_layer_norm_before")


def _is_clip(m: nn.Module) -> bool:
    return hasattr(m, "layer_norm1") and hasattr(getattr(m, "self_attn", None), "out_proj") and hasattr(
        getattr(m, "mlp", None), "fc1")


def _is_bert(m: nn.Module) -> bool:
    att = getattr(m, "attention", None)
    return att is not None and hasattr(getattr(att, "self", None), "value") and hasattr(m, "intermediate")


def _is_distilbert(m: nn.Module) -> bool:
    att = getattr(m, "attention", None)
    return att is not None and hasattr(att, "v_lin") and hasattr(getattr(m, "ffn", None), "lin1")


def _is_vit(m: nn.Module) -> bool:
    att = getattr(m, "attention", None)
    return att is not None and hasattr(att, "v_proj") and hasattr(getattr(m, "mlp", None), "fc1")


def _is_vit_mae(m: nn.Module) -> bool:
    return type(m).__name__ == "ViTMAELayer" and _is_vit(m)


#: Why the value-aware methods refuse ViTMAE: the states along its value path are its own, in shuffled order.
_MAE_REFUSED = ("ViTMAE shuffles its patches on every forward (random noise): the states along its value path are in "
                "that shuffled order, while the attention record is put back in patch order, so the value-aware maths "
                "would mix two orders; use an attention method ('rollout', 'grad_rollout', ...)")


def _is_gpt2(m: nn.Module) -> bool:
    # GPT-2's (in, 3·d) Conv1D; GPTBigCode's per-head interleaved / multi-query Linear is not it
    c_attn = getattr(getattr(m, "attn", None), "c_attn", None)
    return hasattr(m, "ln_1") and type(c_attn).__name__ == "Conv1D" and hasattr(m, "mlp")


def _not_described(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """A block kind recognised only to be refused (its ``refused`` text says why)."""
    raise ValueError(f"{type(m).__name__} is not described")


def _is_differential(m: nn.Module) -> bool:
    return hasattr(m, "input_layernorm") and hasattr(getattr(m, "self_attn", None), "lambda_q1")


_DIFF_REFUSED = (
    "differential attention: each head pair mixes its values with softmax₁ − λ·softmax₂ and divides the mixed "
    "vector by a per-pair group norm (Ye et al., ICLR 2025), a value path the value-aware maths (one value "
    "projection per head, mixed by probabilities) do not model; 'raw', 'grad_rollout' and 'gae' read its signed "
    "matrices")


def _is_llama(m: nn.Module) -> bool:
    att = getattr(m, "self_attn", None)
    return hasattr(m, "input_layernorm") and (hasattr(att, "v_proj") or hasattr(att, "kv_b_proj")) and (
        hasattr(getattr(m, "mlp", None), "gate_proj") or _has_experts(m))


# ------------------------------------------------------------------------------------------- heads
def hf_head(model: nn.Module, layers: list[LayerAnatomy], family: str) -> dict[str, Any]:
    """Final norm, pooling, pooler and logit layer of the transformers heads attnroll knows (missing pieces
    stay None): CLS + pooler (BERT family; RoBERTa's dense + tanh, ELECTRA's dense + GELU), pre_classifier +
    ReLU (DistilBERT), CLS after the final norm (ViT / DeiT), CLS ⊕ mean of the patch rows (DINOv2's
    classifier), the LM / score head at the explained position (decoders)."""
    d = layers[0].fc1.arrays()[0].shape[1]
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    out: dict[str, Any] = {"readout": "last" if family in ("gpt2", "llama") else "first"}
    if family not in ("bert", "distilbert"):
        out["final_norm"] = next((m for m in (getattr(base, n, None) for n in ("layernorm", "ln_f", "norm"))
                                  if isinstance(m, nn.Module) and hasattr(m, "weight")), None)
    head = next((getattr(model, n) for n in ("classifier", "lm_head", "score") if isinstance(
        getattr(model, n, None), nn.Module)), None)
    if family == "bert" and head is not None and hasattr(head, "out_proj") and hasattr(head, "dense"):
        # RoBERTa-style head on CLS: dense, tanh (RoBERTa, inline) or the head's own activation (ELECTRA: GELU)
        act = getattr(head, "activation", None)
        out["pooler"], head = (head.dense, act if callable(act) else torch.tanh), head.out_proj
    elif family == "bert" and isinstance(getattr(base, "pooler", None), nn.Module):
        pooler = base.pooler
        if isinstance(getattr(pooler, "dense", None), nn.Linear) and callable(getattr(pooler, "activation", None)):
            out["pooler"] = (pooler.dense, pooler.activation)
        elif isinstance(pooler, nn.Linear) and callable(getattr(base, "activation", None)):
            out["pooler"] = (pooler, base.activation)  # BigBird: the pooler is a Linear, its tanh on the model
        else:
            return out  # a pooler the anatomy cannot describe: no logit layer either
    elif family == "distilbert" and isinstance(getattr(model, "pre_classifier", None), nn.Linear):
        out["pooler"] = (model.pre_classifier, torch.relu)
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Linear) or float(getattr(config, "logits_scaling", 1.0) or 1.0) != 1.0:
        return out  # no logit layer the anatomy can describe (Granite divides its logits by a scale)
    if family == "vit" and head.in_features == 2 * d and getattr(config, "model_type", "").startswith("dinov2"):
        # DINOv2's classifier reads [CLS ; mean of the patch rows] of the normed output
        out.update(token_norm=out.pop("final_norm", None), classifier=head,
                   pool=(("row", 0), ("mean", 1 + int(getattr(config, "num_register_tokens", 0) or 0))))
    elif head.in_features == d:
        out["classifier"] = head
    return out


def _reads_head(family: str) -> HeadReader:
    def read(model: nn.Module, layers: list[LayerAnatomy]) -> tuple[dict[str, Any], str]:
        return hf_head(model, layers, family), ""

    return read


_MEAN_POOLING = "mean pooling with its own norm"
_ENC_DEC_HEAD = "an encoder-decoder LM head"

#: The transformers block kinds in the order they are tried (the first match wins: Data2Vec-Vision and BEiT
#: before BERT and ViT, whose names they share; T5 and BART before CLIP).
BLOCKS = (
    BlockKind(name="data2vec-vision", matches=_is_d2v_vision, build=_d2v_vision,
              parts="attention.attention.value + layernorm_before (Data2Vec-Vision)", label="Data2Vec-Vision",
              value_aware="Data2Vec-Vision (pre-LN)", head_not_read=_MEAN_POOLING),
    BlockKind(name="beit", matches=_is_beit, build=_beit, parts="attention.v_proj + mlp.fc1 + lambda_1 (BEiT)",
              label="BEiT", value_aware="BEiT (pre-LN)", head_not_read=_MEAN_POOLING),
    BlockKind(name="wav2vec2", matches=_is_wav2vec2, build=_wav2vec2,
              parts="attention.out_proj + feed_forward.output_dense + final_layer_norm (wav2vec2)",
              label="wav2vec2 / HuBERT encoders", value_aware="wav2vec2 / HuBERT (post-LN or stable-LN)",
              head_not_read="mean over frames"),
    BlockKind(name="t5", matches=_is_t5, build=_t5, parts="layer.0.SelfAttention + layer.-1.DenseReluDense (T5)",
              label="T5-style encoder / decoder blocks",
              value_aware="T5-style encoders (one stack, no cross-attention)", head_not_read=_ENC_DEC_HEAD),
    BlockKind(name="bart", matches=_is_bart, build=_bart, parts="self_attn_layer_norm + fc1 + final_layer_norm (BART)",
              label="BART-style encoder / decoder layers",
              value_aware="BART-style encoders (one stack, no cross-attention)", head_not_read=_ENC_DEC_HEAD),
    BlockKind(name="clip", matches=_is_clip, build=_clip, parts="layer_norm1 + self_attn.out_proj + mlp.fc1 (CLIP)",
              label="CLIP / SigLIP encoders", value_aware="CLIP / SigLIP (pre-LN)",
              head_not_read="post-layernorm / projection / mean-pooled classifier"),
    BlockKind(name="bert", matches=_is_bert, build=_bert,
              parts="attention.self.{query,key,value} + intermediate (BERT)",
              label="BERT family (BERT, RoBERTa, ELECTRA)",
              value_aware="BERT family (BERT, RoBERTa, ELECTRA: post-LN)", head=_reads_head("bert")),
    BlockKind(name="distilbert", matches=_is_distilbert, build=_distilbert,
              parts="attention.{q,k,v,out}_lin + ffn (DistilBERT)", label="DistilBERT",
              value_aware="DistilBERT (post-LN)", head=_reads_head("distilbert")),
    BlockKind(name="vit_mae", matches=_is_vit_mae, build=_vit, parts="attention.{q,k,v,o}_proj + mlp.fc1 (ViTMAE)",
              label="ViTMAE", refused=_MAE_REFUSED),
    BlockKind(name="vit", matches=_is_vit, build=_vit, parts="attention.{q,k,v,o}_proj + mlp.fc1 (ViT)",
              label="ViT / DeiT / DINOv2", value_aware="ViT / DeiT / DINOv2 (pre-LN)", head=_reads_head("vit")),
    BlockKind(name="gpt2", matches=_is_gpt2, build=_gpt2, parts="attn.c_attn + ln_1 (GPT-2)",
              label="GPT-2 decoders", value_aware="GPT-2 (pre-LN)", head=_reads_head("gpt2")),
    BlockKind(name="diffllama", matches=_is_differential, build=_not_described,
              parts="self_attn.lambda_q1 + input_layernorm (DiffLlama)",
              label="DiffLlama differential attention, refused", refused=_DIFF_REFUSED),
    BlockKind(name="llama", matches=_is_llama, build=_llama,
              parts="self_attn.{q,k,v,o}_proj + input_layernorm + mlp.gate_proj or mlp.experts (Llama)",
              label="Llama-family decoders (dense or mixture-of-experts MLPs)",
              value_aware="Llama-family decoders (RMSNorm, grouped KV; mixture-of-experts MLPs: Mixtral, Qwen2-MoE, "
                          "Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V2 / V3 with its latent attention)",
              head=_reads_head("llama")),
)
