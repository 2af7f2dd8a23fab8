"""Layer anatomy builders: the one place that knows how each supported family lays out its blocks and head.

One builder per family fills :class:`~attnroll.capture.layers.LayerAnatomy` for a block, recognised by its
structure (never by the model's class name):

* transformers BERT family (BERT, RoBERTa, ELECTRA, ...): post-norm; ``attention.self.{query,key,value}``,
  ``attention.output.{dense, LayerNorm}``, ``intermediate.dense``, ``output.{dense, LayerNorm}``;
* transformers DistilBERT: post-norm; ``attention.{q,k,v,out}_lin``, ``sa_layer_norm``, ``ffn.lin1/lin2``,
  ``output_layer_norm``;
* transformers ViT / DeiT (``layernorm_before``, ``attention.{q,k,v,o}_proj``, ``layernorm_after``,
  ``mlp.fc1/fc2``) and DINOv2 (``norm1``, ``layer_scale1``, ``norm2``, ``mlp``, ``layer_scale2``): pre-norm;
* timm ``VisionTransformer`` blocks (fused ``attn.qkv``: q, k, v thirds of the rows; ``attn.proj``,
  ``ls1`` / ``ls2``, optional ``attn.q_norm`` / ``k_norm``): pre-norm;
* GPT-2 (``ln_1``, fused ``attn.c_attn`` / ``attn.c_proj`` as Conv1D, ``ln_2``, ``mlp.c_fc`` / ``c_proj``):
  pre-norm;
* Llama family (``input_layernorm`` / ``post_attention_layernorm`` RMSNorms, ``self_attn.{q,k,v,o}_proj``
  with grouped KV heads, gated ``mlp.{gate,up,down}_proj``): pre-norm;
* torch ``nn.TransformerEncoderLayer`` (fused ``self_attn.in_proj_weight``, ``out_proj``, ``linear1/2``,
  ``norm1/2``, ``norm_first``);
* transformers BEiT (the ViT names plus block-level ``lambda_1`` / ``lambda_2`` scales) and Data2Vec-Vision
  (``attention.attention.{query,key,value}``, ``layernorm_before`` / ``layernorm_after``, λ scales): pre-norm;
* transformers CLIP / SigLIP encoder layers, vision and text (``layer_norm1``, ``self_attn.{q,k,v,out}_proj``,
  ``layer_norm2``, ``mlp.fc1/fc2``): pre-norm;
* transformers wav2vec2 / HuBERT / SEW / UniSpeech / Data2Vec-Audio encoder layers (``attention.{q,k,v,
  out}_proj``, ``layer_norm``, ``feed_forward``, ``final_layer_norm``): post-norm or stable-layer-norm
  (pre-norm), the layout probed on a hook-free copy of the block;
* timm EVA / EVA02 and timm BEiT blocks (fused ``attn.qkv`` with separate ``q_bias`` / ``v_bias``, or
  ``attn.{q,k,v}_proj``; plain, SwiGLU or packed-GLU MLP; ``gamma_1`` / ``gamma_2``): pre-norm;
* transformers BART-style encoder / decoder layers (BART, mBART, Marian, Pegasus, Whisper, M2M100, ...;
  layout probed) and T5-style blocks (T5, mT5, UMT5; pre-norm RMS). A decoder block's cross-attention is
  :attr:`~attnroll.capture.layers.LayerAnatomy.cross`: sanity re-draws its q / k with "qk" and its v / o with
  "value"; the value-aware methods refuse blocks that have one.

:func:`anatomy` returns the model's :class:`~attnroll.capture.layers.ModelAnatomy` (head included);
:func:`layer_anatomy` one block's. :func:`find_blocks` / :func:`find_head` are structural finders (a stack
of identical blocks, the module producing the logits) for any model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from .. import _checks
from .layers import RESET, LayerAnatomy, ModelAnatomy, Proj, Target, norm_params

__all__ = ["anatomy", "anatomy_or_reason", "layer_anatomy", "find_blocks", "find_head", "component_parameters", "KNOWN_FAMILIES",
           "VALUE_AWARE_FAMILIES", "Target", "RESET"]

KNOWN_FAMILIES = (
    "transformers BERT family (BERT, RoBERTa, ELECTRA), DistilBERT, ViT / DeiT / DINOv2, BEiT, Data2Vec-Vision, "
    "CLIP / SigLIP encoders, wav2vec2 / HuBERT encoders, BART-style and T5-style encoder / decoder layers, GPT-2 "
    "and Llama-family decoders; timm VisionTransformer, EVA / EVA02, BEiT; torch nn.TransformerEncoderLayer"
)
VALUE_AWARE_FAMILIES = (
    "transformers BERT family (BERT, RoBERTa, ELECTRA: post-LN), DistilBERT, transformers ViT / DeiT / DINOv2 "
    "and timm VisionTransformer (pre-LN), GPT-2 (pre-LN), Llama-family decoders (RMSNorm, grouped KV), BEiT / "
    "Data2Vec-Vision, CLIP / SigLIP, timm EVA (pre-LN), wav2vec2 / HuBERT (post-LN or stable-LN), the "
    "encoders of BART-style and T5-style models (one stack, no cross-attention)"
)
#: What a block must have for each builder (named in the refusal of an unknown block).
_LOOKED_FOR_PARTS = (
    "attention.self.{query,key,value} + intermediate (BERT), attention.{q,k,v,out}_lin + ffn (DistilBERT), "
    "attention.{q,k,v,o}_proj + mlp.fc1 (ViT), attn.c_attn + ln_1 (GPT-2), self_attn.{q,k,v,o}_proj + "
    "input_layernorm + mlp.gate_proj (Llama), attn.qkv + ls1 + mlp.fc1 (timm), self_attn "
    "(nn.MultiheadAttention) + linear1 (torch), attention.attention.value + layernorm_before (Data2Vec-Vision), "
    "layer_norm1 + self_attn.out_proj + mlp.fc1 (CLIP), attention.out_proj + feed_forward.output_dense + "
    "final_layer_norm (wav2vec2), gamma_1 + attn.proj + mlp.fc2 (timm EVA), self_attn_layer_norm + fc1 + "
    "final_layer_norm (BART), layer.0.SelfAttention + layer.-1.DenseReluDense (T5)"
)
_LOOKED_FOR_BLOCKS = (
    "transformers' `encoder.layer` or `layers` (a ModuleList of identical layers), timm's `blocks`, or any "
    "nn.ModuleList / nn.Sequential of identical composite blocks with parameters"
)
_LOOKED_FOR_HEAD = (
    "a `classifier` (transformers) or `head` (timm) module with parameters, or an nn.Linear outside the blocks"
)


# ------------------------------------------------------------------------------------------- small helpers
def _sub(block: nn.Module, path: str) -> nn.Module:
    mod = block
    for part in path.split("."):
        mod = getattr(mod, part)
    return mod


def _proj(block: nn.Module, path: str, **kw: Any) -> Proj:
    """A projection at ``path`` inside ``block`` (bias None when the module has none)."""
    mod = _sub(block, path)
    if not isinstance(getattr(mod, "bias", None), torch.Tensor) and "bias" not in kw:
        kw["bias"] = None
    return Proj(mod, path, **kw)


def _fused(block: nn.Module, path: str, d: int, **kw: Any) -> tuple[Proj, Proj, Proj]:
    """q, k, v of a fused (3d, ...) projection: its row thirds."""
    return tuple(_proj(block, path, rows=slice(i * d, (i + 1) * d), **kw) for i in range(3))  # type: ignore


def _norms(block: nn.Module, paths: tuple[str, ...]) -> tuple[tuple[str, nn.Module], ...]:
    out = []
    for p in paths:
        try:
            mod = _sub(block, p)
        except AttributeError:
            continue
        if isinstance(mod, nn.Module) and not isinstance(mod, nn.Identity):
            out.append((p, mod))
    return tuple(out)


def _ls(mod: Any) -> nn.Module | None:
    return None if mod is None or isinstance(mod, nn.Identity) else mod


def _heads_of(att: nn.Module) -> tuple[int, int]:
    """(query heads, key/value heads) of a transformers attention module."""
    cfg = getattr(att, "config", None)
    heads = getattr(att, "num_heads", None) or getattr(att, "num_attention_heads", None) or getattr(att, "n_heads", None)
    if heads is None and cfg is not None:
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads", None)
    if heads is None:
        heads = att.o_proj.in_features // att.head_dim
    kv = getattr(att, "num_key_value_heads", None) or getattr(cfg, "num_key_value_heads", None) or heads
    groups = getattr(att, "num_key_value_groups", None)
    if groups:
        kv = int(heads) // int(groups)
    return int(heads), int(kv)


# ------------------------------------------------------------------------------------------- block builders
def _bert(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    sa = m.attention.self
    heads = int(getattr(sa, "num_attention_heads", 0) or sa.config.num_attention_heads)
    q, k, v = (_proj(m, f"attention.self.{n}") for n in ("query", "key", "value"))
    return LayerAnatomy(
        i, m, path, sa, q, k, v, _proj(m, "attention.output.dense"), heads, heads, False,
        m.attention.output.LayerNorm, m.output.LayerNorm,
        _norms(m, ("attention.output.LayerNorm", "output.LayerNorm")),
        _proj(m, "intermediate.dense"), m.intermediate.intermediate_act_fn, _proj(m, "output.dense"),
    )


def _distilbert(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.attention
    heads, _ = _heads_of(att)
    q, k, v, o = (_proj(m, f"attention.{n}_lin") for n in ("q", "k", "v", "out"))
    return LayerAnatomy(
        i, m, path, att, q, k, v, o, heads, heads, False, m.sa_layer_norm, m.output_layer_norm,
        _norms(m, ("sa_layer_norm", "output_layer_norm")), _proj(m, "ffn.lin1"), m.ffn.activation,
        _proj(m, "ffn.lin2"),
    )


def _vit(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.attention
    heads, _ = _heads_of(att)
    n1, n2 = ("layernorm_before", "layernorm_after") if hasattr(m, "layernorm_before") else ("norm1", "norm2")
    q, k, v, o = (_proj(m, f"attention.{n}_proj") for n in ("q", "k", "v", "o"))
    return LayerAnatomy(
        i, m, path, att, q, k, v, o, heads, heads, True, getattr(m, n1), getattr(m, n2), _norms(m, (n1, n2)),
        _proj(m, "mlp.fc1"), m.mlp.activation_fn, _proj(m, "mlp.fc2"),
        ls1=_ls(getattr(m, "layer_scale1", None)), ls2=_ls(getattr(m, "layer_scale2", None)),
    )


def _gpt2(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.attn
    q, k, v = _fused(m, "attn.c_attn", att.embed_dim, in_out=True)
    heads = int(att.num_heads)
    return LayerAnatomy(
        i, m, path, att, q, k, v, _proj(m, "attn.c_proj", in_out=True), heads, heads, True, m.ln_1, m.ln_2,
        _norms(m, ("ln_1", "ln_2")), _proj(m, "mlp.c_fc", in_out=True), m.mlp.act,
        _proj(m, "mlp.c_proj", in_out=True),
    )


def _llama(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.self_attn
    heads, kv = _heads_of(att)
    q, k, v, o = (_proj(m, f"self_attn.{n}_proj") for n in ("q", "k", "v", "o"))
    return LayerAnatomy(
        i, m, path, att, q, k, v, o, heads, kv, True, m.input_layernorm, m.post_attention_layernorm,
        _norms(m, ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")),
        _proj(m, "mlp.up_proj"), m.mlp.act_fn, _proj(m, "mlp.down_proj"), gate=_proj(m, "mlp.gate_proj"),
    )


def _timm(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.attn
    q, k, v = _fused(m, "attn.qkv", att.qkv.in_features)
    heads = int(att.num_heads)
    return LayerAnatomy(
        i, m, path, att, q, k, v, _proj(m, "attn.proj"), heads, heads, True, m.norm1, m.norm2,
        _norms(m, ("norm1", "norm2", "attn.q_norm", "attn.k_norm", "attn.norm", "mlp.norm")),
        _proj(m, "mlp.fc1"), m.mlp.act, _proj(m, "mlp.fc2"), ls1=_ls(m.ls1), ls2=_ls(m.ls2),
    )


def _torch(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    att = m.self_attn
    d = att.embed_dim
    if att._qkv_same_embed_dim:
        q, k, v = _fused(m, "self_attn", d, weight="in_proj_weight",
                         bias="in_proj_bias" if att.in_proj_bias is not None else None)
    else:
        b = "in_proj_bias" if att.in_proj_bias is not None else None
        q, k, v = (Proj(att, "self_attn", weight=f"{n}_proj_weight", bias=b, rows=slice(j * d, (j + 1) * d))
                   for j, n in enumerate("qkv"))
    act = m.activation
    return LayerAnatomy(
        i, m, path, att, q, k, v, _proj(m, "self_attn.out_proj"), int(att.num_heads), int(att.num_heads),
        bool(m.norm_first), m.norm1, m.norm2, _norms(m, ("norm1", "norm2")), _proj(m, "linear1"),
        act, _proj(m, "linear2"),
    )



# ----------------------------------------------------------------- builders added for issue 12's sanity regression
class _Scale(nn.Module):
    """A layer scale kept as a bare parameter on the block (BEiT's ``lambda_1``): y ↦ y ⊙ γ. The parameter
    stays the block's own (this module is not attached to the model); :func:`layers._scaled` reads ``gamma``."""

    def __init__(self, gamma: nn.Parameter) -> None:
        super().__init__()
        self.gamma = gamma

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.gamma


def _lambda(m: nn.Module, name: str) -> nn.Module | None:
    p = getattr(m, name, None)
    return _Scale(p) if isinstance(p, nn.Parameter) else None


def _beit(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """transformers BEiT (ViT names, block-level ``lambda_1`` / ``lambda_2`` scales): pre-norm."""
    layer = _vit(i, path, m)
    return replace(layer, ls1=_lambda(m, "lambda_1"), ls2=_lambda(m, "lambda_2"))


def _d2v_vision(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """transformers Data2Vec-Vision (BERT names inside, ``layernorm_before`` / ``layernorm_after``, λ scales):
    pre-norm."""
    sa = m.attention.attention
    heads, _ = _heads_of(sa)
    q, k, v = (_proj(m, f"attention.attention.{n}") for n in ("query", "key", "value"))
    return LayerAnatomy(
        i, m, path, sa, q, k, v, _proj(m, "attention.output.dense"), heads, heads, True, m.layernorm_before,
        m.layernorm_after, _norms(m, ("layernorm_before", "layernorm_after")), _proj(m, "intermediate.dense"),
        m.intermediate.intermediate_act_fn, _proj(m, "output.dense"),
        ls1=_lambda(m, "lambda_1"), ls2=_lambda(m, "lambda_2"),
    )


def _clip(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """transformers CLIP / SigLIP encoder layers (vision and text): ``layer_norm1``, ``self_attn.{q,k,v,
    out}_proj``, ``layer_norm2``, ``mlp.fc1`` / ``fc2``: pre-norm."""
    att = m.self_attn
    heads, _ = _heads_of(att)
    q, k, v, o = (_proj(m, f"self_attn.{n}_proj") for n in ("q", "k", "v", "out"))
    return LayerAnatomy(
        i, m, path, att, q, k, v, o, heads, heads, True, m.layer_norm1, m.layer_norm2,
        _norms(m, ("layer_norm1", "layer_norm2")), _proj(m, "mlp.fc1"), m.mlp.activation_fn, _proj(m, "mlp.fc2"),
    )


def _wav2vec2_layout(i: int, path: str, m: nn.Module, pre_norm: bool) -> LayerAnatomy:
    att = m.attention
    heads, _ = _heads_of(att)
    q, k, v, o = (_proj(m, f"attention.{n}_proj") for n in ("q", "k", "v", "out"))
    return LayerAnatomy(
        i, m, path, att, q, k, v, o, heads, heads, pre_norm, m.layer_norm, m.final_layer_norm,
        _norms(m, ("layer_norm", "final_layer_norm")), _proj(m, "feed_forward.intermediate_dense"),
        m.feed_forward.intermediate_act_fn, _proj(m, "feed_forward.output_dense"),
    )


def _wav2vec2(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """transformers wav2vec2 / HuBERT encoder layers (``attention.{q,k,v,out}_proj``, ``layer_norm``,
    ``feed_forward.{intermediate,output}_dense``, ``final_layer_norm``). The post-norm and the stable-layer-norm
    (pre-norm) variants hold the same parameters: which one the block computes is probed (:func:`_probe_residual`)."""
    return _wav2vec2_layout(i, path, m, _probe_residual(m, _wav2vec2_layout))


def _probe_residual(block: nn.Module, layout: Callable[[int, str, nn.Module, bool], LayerAnatomy]) -> bool:
    """Whether ``block`` computes the pre-norm (True) or the post-norm (False) residual layout, from one forward
    of a hook-free copy of it on a random (1, 3, d) input (a running capture's hooks see nothing): the first
    norm's input must be the block input (pre-norm) or block input + attention branch (post-norm), and
    :meth:`LayerAnatomy.finish` of that layout (``layout(0, "", copy, pre_norm)``) must give the block's output.
    ValueError when neither holds (another layout)."""
    import copy

    work = copy.deepcopy(block)
    for mod in work.modules():
        mod._forward_hooks.clear()
        mod._forward_pre_hooks.clear()
    cand = {pre: layout(0, "", work, pre) for pre in (True, False)}
    seen: dict[str, torch.Tensor] = {}

    def keep_in(mod: nn.Module, args: tuple) -> None:  # hooks return None: the block's own values flow on
        seen.setdefault("n1", args[0])

    def keep_out(mod: nn.Module, args: tuple, out: Any) -> None:
        seen.setdefault("attn", out[0] if isinstance(out, tuple) else out)

    cand[True].norm1.register_forward_pre_hook(keep_in)
    cand[True].attention.register_forward_hook(keep_out)
    w = cand[True].fc1.arrays()[0]
    x = torch.randn(1, 3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w)
    with torch.no_grad():
        try:
            out = work(x, attention_mask=None)
        except Exception as e:  # noqa: BLE001  (a block that cannot run alone on (1, 3, d): not this layout)
            raise ValueError(f"the block does not run alone on a (1, 3, d) probe: {type(e).__name__}: {e}") from None
        out = out[0] if isinstance(out, (tuple, list)) else out
        for pre, start in ((True, x), (False, x + seen["attn"])):
            if torch.allclose(seen["n1"], start, atol=1e-5, rtol=1e-4) and torch.allclose(
                    cand[pre].finish(x, seen["attn"]), out, atol=1e-4, rtol=1e-4):
                return pre
    raise ValueError("the block computes neither the pre-norm nor the post-norm residual layout")


def _eva_qkv(m: nn.Module) -> tuple[Proj, Proj, Proj]:
    """q, k, v of a timm EVA / BEiT attention: separate ``attn.{q,k,v}_proj``, or a fused ``attn.qkv`` (row
    thirds) whose biases are ``attn.q_bias`` / ``attn.v_bias`` beside a zero key bias buffer."""
    att = m.attn
    if getattr(att, "qkv", None) is None:
        return tuple(_proj(m, f"attn.{n}_proj") for n in "qkv")  # type: ignore
    d = att.proj.in_features
    if getattr(att, "q_bias", None) is None:
        return _fused(m, "attn.qkv", d)
    if getattr(att, "k_bias", None) is not None and bool(att.k_bias.detach().ne(0).any()):
        raise ValueError("attn.k_bias is not zero")
    sep = dict(bias_module=att, bias_path="attn")
    return (_proj(m, "attn.qkv", rows=slice(0, d), bias="q_bias", **sep),
            _proj(m, "attn.qkv", rows=slice(d, 2 * d), bias=None),
            _proj(m, "attn.qkv", rows=slice(2 * d, 3 * d), bias="v_bias", **sep))


def _eva_mlp(m: nn.Module) -> tuple[Proj, Proj | None]:
    """(fc1, gate or None) of a timm ``Mlp``, ``SwiGLU`` (``fc1_x``, ``fc1_g``) or ``GluMlp`` (one fused fc1,
    its halves the value and the gate; ``gate_last``: the gate is the second half)."""
    mlp = m.mlp
    if hasattr(mlp, "fc1_g"):
        return _proj(m, "mlp.fc1_x"), _proj(m, "mlp.fc1_g")
    if hasattr(mlp, "gate_last"):
        if getattr(mlp, "chunk_dim", -1) != -1:
            raise ValueError("a convolutional GluMlp")
        h = mlp.fc1.out_features // 2
        first, second = (_proj(m, "mlp.fc1", rows=slice(j * h, (j + 1) * h)) for j in range(2))
        return (first, second) if mlp.gate_last else (second, first)
    return _proj(m, "mlp.fc1"), None


def _timm_eva(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """timm EVA / EVA02 (``EvaBlock``) and timm BEiT blocks: pre-norm, rotary or relative-position attention (it
    shapes the attention probabilities only), fused or separate q / k / v, plain / SwiGLU / packed-GLU MLP,
    block-level ``gamma_1`` / ``gamma_2`` layer scales."""
    fc1, gate = _eva_mlp(m)
    q, k, v = _eva_qkv(m)
    return LayerAnatomy(
        i, m, path, m.attn, q, k, v, _proj(m, "attn.proj"), int(m.attn.num_heads), int(m.attn.num_heads), True,
        m.norm1, m.norm2, _norms(m, ("norm1", "norm2", "attn.q_norm", "attn.k_norm", "attn.norm", "mlp.norm")),
        fc1, m.mlp.act, _proj(m, "mlp.fc2"), gate=gate, ls1=_lambda(m, "gamma_1"), ls2=_lambda(m, "gamma_2"),
    )


def _bart_layout(i: int, path: str, m: nn.Module, pre_norm: bool) -> LayerAnatomy:
    att = m.self_attn
    heads, _ = _heads_of(att)
    q, k, v, o = (_proj(m, f"self_attn.{n}_proj") for n in ("q", "k", "v", "out"))
    cross = None
    if getattr(m, "encoder_attn", None) is not None:
        cross = tuple(_proj(m, f"encoder_attn.{n}_proj") for n in ("q", "k", "v", "out"))
    return LayerAnatomy(
        i, m, path, att, q, k, v, o, heads, heads, pre_norm, m.self_attn_layer_norm, m.final_layer_norm,
        _norms(m, ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")), _proj(m, "fc1"),
        m.activation_fn, _proj(m, "fc2"), cross=cross,  # type: ignore[arg-type]
    )


def _bart(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """transformers BART-style encoder and decoder layers (BART, mBART, Marian, Pegasus, Whisper, M2M100, ...):
    ``self_attn.{q,k,v,out}_proj``, ``self_attn_layer_norm``, ``fc1`` / ``fc2``, ``final_layer_norm``, and in
    decoder layers the cross-attention ``encoder_attn.*`` (:attr:`LayerAnatomy.cross`) with its norm. Post-norm
    (BART, Marian) or pre-norm (mBART, Whisper) is probed (:func:`_probe_residual`, without encoder states)."""
    return _bart_layout(i, path, m, _probe_residual(m, _bart_layout))


def _t5(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """transformers T5-style blocks (T5, mT5, UMT5): ``layer.0`` self-attention (``SelfAttention.{q,k,v,o}``,
    RMS ``layer_norm``; its relative attention bias only shapes the scores), in decoder blocks ``layer.1`` the
    cross-attention (``EncDecAttention``, :attr:`LayerAnatomy.cross`), last the MLP (``DenseReluDense.wi`` /
    ``wo``, or gated ``wi_0`` (gate) / ``wi_1``): pre-norm."""
    last = len(m.layer) - 1
    sa, ff = m.layer[0].SelfAttention, m.layer[last].DenseReluDense
    heads, _ = _heads_of(sa)
    q, k, v, o = (_proj(m, f"layer.0.SelfAttention.{n}") for n in "qkvo")
    ffp = f"layer.{last}.DenseReluDense"
    fc1, gate = ((_proj(m, f"{ffp}.wi_1"), _proj(m, f"{ffp}.wi_0")) if hasattr(ff, "wi_0")
                 else (_proj(m, f"{ffp}.wi"), None))
    cross = tuple(_proj(m, f"layer.1.EncDecAttention.{n}") for n in "qkvo") if last == 2 else None
    return LayerAnatomy(
        i, m, path, sa, q, k, v, o, heads, heads, True, m.layer[0].layer_norm, m.layer[last].layer_norm,
        _norms(m, tuple(f"layer.{j}.layer_norm" for j in range(last + 1))), fc1, ff.act, _proj(m, f"{ffp}.wo"),
        gate=gate, cross=cross,  # type: ignore[arg-type]
    )


def _is_t5(m: nn.Module) -> bool:
    layers = getattr(m, "layer", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) not in (2, 3):
        return False
    first, last = layers[0], layers[len(layers) - 1]
    return hasattr(first, "SelfAttention") and hasattr(first, "layer_norm") and hasattr(last, "DenseReluDense") and (
        len(layers) == 2 or hasattr(layers[1], "EncDecAttention"))


#: Families whose blocks are described but whose heads are not read (decompx refuses them with this reason).
_HEAD_NOT_READ = {"beit": "mean pooling with its own norm", "data2vec-vision": "mean pooling with its own norm",
                  "clip": "post-layernorm / projection / mean-pooled classifier", "wav2vec2": "mean over frames",
                  "timm-eva": "EVA / BEiT pooling and norms, not checked", "bart": "an encoder-decoder LM head",
                  "t5": "an encoder-decoder LM head"}


def _kind(m: nn.Module) -> Callable[[int, str, nn.Module], LayerAnatomy] | None:
    """Which family's block ``m`` is, from its structure (None: not a block attnroll knows)."""
    att = getattr(m, "attention", None)
    if att is not None and hasattr(getattr(att, "attention", None), "value") and hasattr(
            m, "intermediate") and hasattr(m, "layernorm_before") and hasattr(m, "lambda_1"):
        return _d2v_vision  # (YOLOS shares the names without λ; its detection-token forward is not checked here)
    if att is not None and hasattr(att, "v_proj") and hasattr(getattr(m, "mlp", None), "fc1") and (
            isinstance(getattr(m, "lambda_1", None), nn.Parameter)):
        return _beit
    if att is not None and hasattr(att, "out_proj") and hasattr(getattr(m, "feed_forward", None), "output_dense") and (
            hasattr(m, "final_layer_norm")):
        return _wav2vec2
    if _is_t5(m):
        return _t5
    sa = getattr(m, "self_attn", None)
    if hasattr(m, "self_attn_layer_norm") and hasattr(sa, "out_proj") and hasattr(m, "fc1") and hasattr(
            m, "final_layer_norm") and not hasattr(m, "do_layer_norm_before"):
        return _bart  # (OPT shares the names; its value path through the capture is not checked: not described)
    if hasattr(m, "layer_norm1") and hasattr(sa, "out_proj") and hasattr(getattr(m, "mlp", None), "fc1"):
        return _clip
    if att is not None and hasattr(getattr(att, "self", None), "value") and hasattr(m, "intermediate"):
        return _bert
    if att is not None and hasattr(att, "v_lin") and hasattr(getattr(m, "ffn", None), "lin1"):
        return _distilbert
    if att is not None and hasattr(att, "v_proj") and hasattr(getattr(m, "mlp", None), "fc1"):
        return _vit
    c_attn = getattr(getattr(m, "attn", None), "c_attn", None)
    if hasattr(m, "ln_1") and type(c_attn).__name__ == "Conv1D" and hasattr(m, "mlp"):
        return _gpt2  # GPT-2's (in, 3·d) Conv1D; GPTBigCode's per-head interleaved / multi-query Linear is not it
    if hasattr(m, "input_layernorm") and hasattr(getattr(m, "self_attn", None), "v_proj") and hasattr(
            getattr(m, "mlp", None), "gate_proj"):
        return _llama
    if type(m).__module__.startswith("timm.") and hasattr(m, "gamma_1") and hasattr(m, "norm2") and hasattr(
            getattr(m, "attn", None), "proj") and hasattr(getattr(m, "mlp", None), "fc2"):
        return _timm_eva
    if type(m).__module__.startswith("timm.") and hasattr(getattr(m, "attn", None), "qkv") and hasattr(
            m, "ls1") and hasattr(getattr(m, "mlp", None), "fc1"):
        return _timm
    if isinstance(getattr(m, "self_attn", None), nn.MultiheadAttention) and hasattr(m, "linear1"):
        return _torch
    return None


_FAMILY = {_bert: "bert", _distilbert: "distilbert", _vit: "vit", _gpt2: "gpt2", _llama: "llama",
           _timm: "timm", _torch: "torch", _beit: "beit", _d2v_vision: "data2vec-vision", _clip: "clip",
           _wav2vec2: "wav2vec2", _timm_eva: "timm-eva", _bart: "bart", _t5: "t5"}


def layer_anatomy(block: nn.Module, index: int = 0, path: str = "") -> LayerAnatomy:
    """The :class:`LayerAnatomy` of one block, checked against the block (see :func:`_check_layer`).

    Raises UnsupportedModelError naming the block's type and what is missing or unplaced when no family
    builder can describe it honestly."""
    kind = _kind(block)
    name = type(block).__name__
    if kind is None:
        raise _checks.UnsupportedModelError(
            f"the layer anatomy knows no block like {name}: it has none of the part sets "
            f"looked for ({_LOOKED_FOR_PARTS}). Known families: {KNOWN_FAMILIES}"
        )
    try:
        layer = kind(index, path, block)
    except (AttributeError, TypeError, ValueError) as e:
        raise _checks.UnsupportedModelError(
            f"{name} looks like a {_FAMILY[kind]} block but lacks a part the layer anatomy reads ({e}). "
            f"Known families: {KNOWN_FAMILIES}"
        ) from None
    _check_layer(layer, _FAMILY[kind])
    return layer


#: Parameters a builder may leave unplaced: they only shape the attention probabilities (captured as such).
_SCORE_ONLY = ("distance_embedding", "relative_position", "rel_pos", "relative_attention_bias")


def _check_layer(layer: LayerAnatomy, family: str) -> None:
    """Refuse (UnsupportedModelError) a block the anatomy would describe wrongly: a parameter that no part
    of the anatomy places (an extra branch, norm or convolution), a norm that does not compute what its
    arrays say (e.g. Gemma's x ⊙ (1 + γ)), or a residual scaled by a multiplier."""
    name = type(layer.module).__name__
    if any(p.is_meta for p in layer.module.parameters()):
        raise _checks.UnsupportedModelError(f"{name} is on the meta device: there are no weights to describe")
    placed = {id(t[1]) for proj in (layer.q, layer.k, layer.v, layer.o, layer.fc1, layer.fc2, layer.gate,
                                     *(layer.cross or ())) if proj is not None for t in proj.targets()}
    placed |= {id(p) for _, m in layer.norms for p in m.parameters()}
    placed |= {id(p) for m in (layer.ls1, layer.ls2) if m is not None for p in m.parameters()}
    stray = [n for n, p in layer.module.named_parameters() if id(p) not in placed
             and not any(k in n for k in _SCORE_ONLY)]
    if stray:
        raise _checks.UnsupportedModelError(
            f"{name} (a {family}-like block) has parameters the layer anatomy does not place: "
            f"{', '.join(stray[:6])}{' ...' if len(stray) > 6 else ''}. Known families: {KNOWN_FAMILIES}"
        )
    if float(getattr(layer.module, "residual_multiplier", 1.0)) != 1.0:
        raise _checks.UnsupportedModelError(f"{name} scales its residual branches (residual_multiplier)")
    for path, mod in layer.norms:
        if not _norm_matches(mod):
            raise _checks.UnsupportedModelError(
                f"{name}.{path} ({type(mod).__name__}) does not compute a LayerNorm / RMSNorm with its weight "
                "and bias as γ and β (the layer anatomy's arrays would be wrong)"
            )


def _norm_matches(mod: nn.Module) -> bool:
    """Whether the norm module's output on a probe input equals the LayerNorm / RMSNorm its arrays describe."""
    from ..core.value_aware import apply_norm

    try:
        p = norm_params(mod)
    except AttributeError:
        return False
    ref = next((t for t in (p.weight, p.bias) if t is not None), None)
    d = ref.shape[0] if ref is not None else int(getattr(mod, "normalized_shape", (0,))[0])
    dtype = ref.dtype if ref is not None else torch.float32
    probe = torch.randn(2, d, generator=torch.Generator().manual_seed(0)).to(
        dtype=dtype, device=ref.device if ref is not None else "cpu")
    try:
        with torch.no_grad():
            got = mod.forward(probe)  # forward, not __call__: no hook of a running capture sees the probe
    except Exception:  # noqa: BLE001  (a norm that cannot run on one row is not one the anatomy describes)
        return False
    return torch.allclose(got.to(torch.float64), apply_norm(probe, p).to(torch.float64), atol=1e-3, rtol=1e-3)


def component_parameters(block: nn.Module, component: str) -> list[Target]:
    """The parameters (and, for fused q/k/v tensors, the rows) of ``block`` that sanity's ``component``
    re-initialises, read through the block's anatomy (see :meth:`LayerAnatomy.targets`). Raises ValueError
    naming the component when the anatomy does not know the block."""
    component = _checks.check_choice("component", component, _checks.SANITY_COMPONENTS)
    try:
        layer = layer_anatomy(block)
    except _checks.UnsupportedModelError as e:
        raise ValueError(f"cannot find the {component!r} parameters of {type(block).__name__}: {e}") from None
    return layer.targets(component)


# ------------------------------------------------------------------------------------------- heads
def _hf_head(model: nn.Module, layers: list[LayerAnatomy], family: str) -> dict[str, Any]:
    """Final norm, pooling, pooler and logit layer of the transformers heads attnroll knows (missing pieces
    stay None): CLS + pooler (BERT family; RoBERTa's dense + tanh, ELECTRA's dense + GELU), pre_classifier +
    ReLU (DistilBERT), CLS after the final norm
    (ViT / DeiT), CLS ⊕ mean of the patch rows (DINOv2's classifier), the LM / score head at the explained
    position (decoders)."""
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


def _timm_head(model: nn.Module, layers: list[LayerAnatomy]) -> tuple[dict[str, Any], str]:
    """timm VisionTransformer heads: ``global_pool='token'`` (the CLS row) and ``'avg'`` (the mean of the rows
    after the prefix, or of all rows with ``pool_include_prefix``), with ``norm`` before and ``fc_norm`` after
    the pooling. Returns (fields, why decompx cannot read the head or "")."""
    out: dict[str, Any] = {"readout": "first"}
    head = getattr(model, "head", None)
    pool = getattr(model, "global_pool", "token")
    if getattr(model, "attn_pool", None) is not None or pool not in ("token", "avg"):
        return out, f"timm head with global_pool={pool!r}{' and an attention pool' if pool == 'map' else ''}"
    if not isinstance(head, nn.Linear):
        return out, ""
    norm, fc_norm = _ls(getattr(model, "norm", None)), _ls(getattr(model, "fc_norm", None))
    if pool == "token" and fc_norm is None:
        out.update(final_norm=norm, classifier=head)
        return out, ""
    start = 0 if getattr(model, "pool_include_prefix", False) else int(getattr(model, "num_prefix_tokens", 1))
    part = ("row", 0) if pool == "token" else ("mean", start)
    out.update(token_norm=norm, final_norm=fc_norm, classifier=head, pool=(part,))
    return out, ""


def _value_aware_reason(family: str, layers: list[LayerAnatomy], model: nn.Module) -> str:
    """Why the value-aware methods cannot use this anatomy ("" when they can)."""
    if family == "torch":
        return "torch nn.TransformerEncoderLayer blocks: the value-aware methods do not record their states"
    if any(hasattr(m, "window_size") or hasattr(m, "shift_size") for m in (layers[0].module, layers[0].attention)):
        return f"{type(layers[0].module).__name__} attends within windows (Swin-style): not modelled"
    stacks = sorted({layer.path.rsplit(".", 1)[0] if "." in layer.path else "" for layer in layers})
    if len(stacks) > 1:
        return f"blocks in several stacks ({', '.join(stacks)}); the value-aware methods explain one stack"
    for layer in layers:
        if getattr(layer.module, "crossattention", None) is not None or layer.cross is not None:
            return f"{type(layer.module).__name__} has cross-attention (the value-aware maths models self-attention)"
        extra = [p for p, _ in layer.norms if p in ("attn.norm", "mlp.norm")]
        if extra:
            return f"timm block with a norm inside a branch ({', '.join(extra)})"
    return ""


# ------------------------------------------------------------------------------------------- the model
def _known_blocks(model: nn.Module) -> list[tuple[str, nn.Module, Callable]]:
    """(path, block, builder) of the outermost modules a builder knows, in module order."""
    found: list[tuple[str, nn.Module, Callable]] = []
    inside: set[int] = set()
    for path, m in model.named_modules():
        if id(m) in inside:
            continue
        kind = _kind(m)
        if kind is not None:
            found.append((path, m, kind))
            inside.update(id(s) for s in m.modules())
    return found


def _refuse_unknown_stacks(model: nn.Module, found: list[tuple[str, nn.Module, Callable]]) -> None:
    """UnsupportedModelError when the model also holds a stack of blocks no builder knows (a VLM's vision
    tower beside a known language model): describing only part of the model would be a silent half answer."""
    known = {id(m) for _, m, _ in found}
    inside = {id(s) for _, m, _ in found for s in m.modules()}
    for path, mod in model.named_modules():
        kids = _stack_of_blocks(mod)
        if not kids or id(mod) in inside:
            continue
        subs = {id(s) for k in kids for s in k.modules()}
        if subs & known:  # the stack holds known blocks (a stage of blocks, the stack itself)
            continue
        if any(isinstance(s, (nn.Linear, nn.MultiheadAttention)) for k in kids for s in k.modules()):
            raise _checks.UnsupportedModelError(
                f"{type(model).__name__} also holds blocks the layer anatomy does not know: {path} "
                f"({type(kids[0]).__name__}); it describes one family's stack only. Known families: {KNOWN_FAMILIES}"
            )


def anatomy(model: nn.Module) -> ModelAnatomy:
    """The :class:`ModelAnatomy` of ``model`` (blocks in module order, the head).

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: no stack of transformer blocks at all (names what was looked for).
        UnsupportedModelError: blocks no builder knows (names their type and the parts looked for), or
            blocks of several families.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {_checks.describe(model)}")
    found = _known_blocks(model)
    if not found:
        path, blocks = find_blocks(model)  # raises ValueError when there is no stack at all
        layer_anatomy(blocks[0], 0, path)  # raises naming the block type and the parts looked for
    _refuse_unknown_stacks(model, found)
    kinds = {k for _, _, k in found}
    if len(kinds) > 1:
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} mixes block families ({', '.join(sorted(_FAMILY[k] for k in kinds))}); the "
            f"layer anatomy describes one stack of blocks. Known families: {KNOWN_FAMILIES}"
        )
    layers = [layer_anatomy(m, i, path) for i, (path, m, _) in enumerate(found)]
    family = _FAMILY[found[0][2]]
    stack = found[0][0].rsplit(".", 1)[0] if "." in found[0][0] else ""
    reason = _value_aware_reason(family, layers, model)
    try:
        if family == "timm":
            fields, head_reason = _timm_head(model, layers)
        elif family in _HEAD_NOT_READ:
            fields, head_reason = {"readout": "first"}, f"the {family} head ({_HEAD_NOT_READ[family]}) is not described"
        elif family == "torch":
            fields, head_reason = {}, ""
        else:
            fields, head_reason = _hf_head(model, layers, family), ""
    except (AttributeError, TypeError) as e:  # a head laid out otherwise: no logit layer, with the reason
        fields, head_reason = {}, f"a {type(model).__name__} head the layer anatomy cannot read ({e})"
    try:
        head_path, head_module = find_head(model, stack)
    except ValueError:
        head_path, head_module = "", None
    if head_reason and not reason:
        fields["classifier"] = None
        head_reason = f"{head_reason}: decompx cannot decompose this head"
    return ModelAnatomy(family=family, path=stack, layers=tuple(layers), head_path=head_path,
                        head_module=head_module, value_aware=reason, head_reason=head_reason, **fields)


def anatomy_or_reason(model: nn.Module) -> tuple[ModelAnatomy | None, str]:
    """(the model's anatomy, "") or (None, why the layer anatomy does not know it)."""
    try:
        return anatomy(model), ""
    except (ValueError, _checks.UnsupportedModelError) as e:
        return None, str(e)


# ------------------------------------------------------------------------------------------- finders
def _stack_of_blocks(mod: nn.Module) -> list[nn.Module] | None:
    """The children of an nn.ModuleList / nn.Sequential if they are identical composite blocks (same type,
    with sub-modules and parameters), else None."""
    if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
        return None
    kids = list(mod.children())
    if not kids or len({type(k) for k in kids}) != 1:
        return None
    if not all(any(True for _ in k.children()) and any(True for _ in k.parameters()) for k in kids):
        return None
    return kids


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The transformer blocks of ``model``, first to last, and their path (structural: any model).

    Looked for, in order: a stack whose path ends with ``encoder.layer``, ``blocks`` or ``layers``; else the
    largest (by parameter count) nn.ModuleList / nn.Sequential of identical composite blocks. Raises
    ValueError naming what was looked for when there is none."""
    named = list(model.named_modules())
    for suffix in ("encoder.layer", "blocks", "layers"):
        for path, mod in named:
            if path == suffix or path.endswith("." + suffix):
                kids = _stack_of_blocks(mod)
                if kids is not None:
                    return path, kids
    best: tuple[int, str, list[nn.Module]] | None = None
    for path, mod in named:
        kids = _stack_of_blocks(mod)
        if kids is None:
            continue
        size = sum(p.numel() for k in kids for p in k.parameters())
        if best is None or size > best[0]:
            best = (size, path, kids)
    _checks.check_found("transformer blocks", best, model, _LOOKED_FOR_BLOCKS)
    return best[1], best[2]


def find_head(model: nn.Module, blocks_path: str) -> tuple[str, nn.Module]:
    """The classification head: ``classifier`` (transformers) or ``head`` (timm) if it has parameters, else
    the last nn.Linear outside the blocks. Raises ValueError naming what was looked for."""

    def outside(path: str) -> bool:
        return not (blocks_path == "" or path == blocks_path or path.startswith(blocks_path + "."))

    for attr in ("classifier", "head"):
        mod = getattr(model, attr, None)
        if isinstance(mod, nn.Module) and any(True for _ in mod.parameters()) and outside(attr):
            return attr, mod
    found = None
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and outside(path):
            found = (path, mod)
    _checks.check_found("classification head", found, model, _LOOKED_FOR_HEAD)
    return found
