"""Value path of a model's blocks: where each block's value projection, norms and MLP are, per model family, and what they saw.

This is the only place that knows how the supported families lay out a transformer block:

* transformers BERT family (BERT, RoBERTa, ELECTRA, ...): post-LN, ``attention.self.value`` /
  ``attention.output.{dense, LayerNorm}`` / ``intermediate.dense`` / ``output.{dense, LayerNorm}``;
* transformers ViT / DeiT (``layernorm_before``, ``attention.{q,k,v,o}_proj``, ``layernorm_after``,
  ``mlp.fc1/fc2``) and DINOv2 (``norm1``, ``layer_scale1``, ``norm2``, ``mlp``, ``layer_scale2``): pre-LN;
* timm ``VisionTransformer`` blocks (fused ``attn.qkv``, ``attn.proj``, ``ls1`` / ``ls2``): pre-LN;
* GPT-2 (``ln_1``, fused ``attn.c_attn`` / ``attn.c_proj`` as Conv1D, ``ln_2``, ``mlp.c_fc`` / ``c_proj``):
  pre-LN;
* Llama family (``input_layernorm`` / ``post_attention_layernorm`` RMSNorms, ``self_attn.{q,k,v,o}_proj``
  with grouped KV heads, gated ``mlp.{gate,up,down}_proj``): pre-norm.

:func:`anatomy` returns a :class:`ModelAnatomy`; :func:`record_states` runs one forward pass and keeps, per
layer, the block's input hidden states, the inputs of its two norms (the actual pre-norm vectors, hence the
statistics) and its output, together with the attention probabilities (an :class:`AttentionRecord`). Hooks,
eval mode and the attention implementation are restored afterwards, also when the forward raises.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .. import _checks
from ..core.value_aware import Block, Mlp, Norm
from .record import AttentionRecord

__all__ = ["LayerAnatomy", "ModelAnatomy", "LayerStates", "anatomy", "record_states", "VALUE_AWARE_FAMILIES"]

VALUE_AWARE_FAMILIES = (
    "transformers BERT family (BERT, RoBERTa, ELECTRA: post-LN), transformers ViT / DeiT / DINOv2 and timm "
    "VisionTransformer (pre-LN), GPT-2 (pre-LN), Llama-family decoders (RMSNorm, grouped KV)"
)


@dataclass
class LayerAnatomy:
    """One block: its modules and the facts the value-aware maths needs.

    ``value`` / ``output``: the modules whose weights are the value and output projections (for fused
    projections ``value_rows`` is the slice of the fused output that holds V); ``norm1`` / ``norm2``: the
    norm before attention / before the MLP (pre-LN) or after the attention / MLP residual (post-LN);
    ``fc1``, ``act``, ``fc2`` and ``gate`` (gated MLPs) the MLP; ``ls1`` / ``ls2`` layer-scale modules or
    None. ``heads`` query heads, ``kv_heads`` key/value heads (grouped KV when fewer)."""

    index: int
    module: nn.Module
    attention: nn.Module
    value: nn.Module
    output: nn.Module
    norm1: nn.Module
    norm2: nn.Module
    fc1: nn.Module
    act: Callable
    fc2: nn.Module
    heads: int
    kv_heads: int
    pre_norm: bool
    value_rows: slice | None = None
    gate: nn.Module | None = None
    ls1: nn.Module | None = None
    ls2: nn.Module | None = None

    def block(self, dtype: torch.dtype | None = None) -> Block:
        """The weights as a pure :class:`~attnroll.core.value_aware.Block` (layer scales folded in)."""
        wv, bv = linear_params(self.value, dtype)
        if self.value_rows is not None:
            wv, bv = wv[self.value_rows], None if bv is None else bv[self.value_rows]
        wo, bo = _scaled(linear_params(self.output, dtype), self.ls1, dtype)
        w1, b1 = linear_params(self.fc1, dtype)
        w2, b2 = _scaled(linear_params(self.fc2, dtype), self.ls2, dtype)
        wg, bg = linear_params(self.gate, dtype) if self.gate is not None else (None, None)
        return Block(
            pre_norm=self.pre_norm, norm1=norm_params(self.norm1, dtype), norm2=norm_params(self.norm2, dtype),
            wv=wv, bv=bv, wo=wo, bo=bo, heads=self.heads, kv_heads=self.kv_heads,
            mlp=Mlp(w1=w1, b1=b1, w2=w2, b2=b2, act=self.act, wg=wg, bg=bg),
        )

    def mlp_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP branch through the model's own modules (layer scale included)."""
        u = self.fc1(h)
        out = self.fc2(self.act(self.gate(h)) * u if self.gate is not None else self.act(u))
        return out if self.ls2 is None else self.ls2(out)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The block's output given its input x (..., d) and its attention branch's output ``attn``
        (b_O and layer scale included), through the model's own norm and MLP modules."""
        if self.pre_norm:
            h = x + attn
            return h + self.mlp_forward(self.norm2(h))
        h = self.norm1(x + attn)
        return self.norm2(h + self.mlp_forward(h))


@dataclass
class ModelAnatomy:
    """The blocks in order, and the head: ``final_norm`` (pre-LN models), ``pooler`` = (Linear, activation)
    (BERT), ``classifier`` (the Linear producing the logits) or None when the model has no head;
    ``readout`` "first" (CLS) or "last" (decoders: the explained position)."""

    family: str
    layers: list[LayerAnatomy]
    final_norm: nn.Module | None = None
    pooler: tuple[nn.Module, Callable] | None = None
    classifier: nn.Module | None = None
    readout: str = "first"

    def blocks(self, dtype: torch.dtype | None = None) -> list[Block]:
        return [layer.block(dtype) for layer in self.layers]

    def head(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The head as pure tensors for :func:`attnroll.core.decompx.head_shares`."""
        if self.classifier is None:
            raise _checks.UnsupportedModelError(
                f"{self.family}: this model has no classification / LM head attnroll knows (a bare encoder?); "
                "decompx needs the layer that produces the logits"
            )
        pool = None
        if self.pooler is not None:
            w, b = linear_params(self.pooler[0], dtype)
            pool = (w, b, self.pooler[1])
        fn = None if self.final_norm is None else norm_params(self.final_norm, dtype)
        return {"final_norm": fn, "pooler": pool, "classifier": linear_params(self.classifier, dtype)}


@dataclass
class LayerStates:
    """What one forward pass computed, per layer l (each (B, n, d), detached): ``inputs`` the block's input
    hidden states, ``norm1_in`` / ``norm2_in`` the vectors entering its two norms, ``outputs`` its output;
    ``final_in`` what enters the final norm (pre-LN models) or None."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    norm1_in: list[torch.Tensor] = field(default_factory=list)
    norm2_in: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    final_in: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------- weights
def linear_params(mod: nn.Module, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W (out, in), b (out,) or None) of an ``nn.Linear`` or a transformers ``Conv1D`` (stored (in, out))."""
    w = mod.weight.detach()
    if type(mod).__name__ == "Conv1D":
        w = w.T
    b = getattr(mod, "bias", None)
    b = None if b is None else b.detach()
    if dtype is not None:
        w, b = w.to(dtype), None if b is None else b.to(dtype)
    return w, b


def norm_params(mod: nn.Module, dtype: torch.dtype | None = None) -> Norm:
    """A LayerNorm / RMSNorm module as a :class:`~attnroll.core.value_aware.Norm`."""
    eps = getattr(mod, "eps", None)
    rms = "RMSNorm" in type(mod).__name__
    if eps is None:
        eps = getattr(mod, "variance_epsilon")
        rms = True
    w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
    cast = (lambda t: None if t is None else t.detach().to(dtype or t.dtype))
    return Norm(weight=cast(w), bias=cast(b), eps=float(eps), rms=rms)


def _scaled(wb: tuple, ls: nn.Module | None, dtype: torch.dtype | None) -> tuple:
    """Fold a layer scale (``ls(y) = y ⊙ λ``) into the (W, b) before it."""
    if ls is None:
        return wb
    lam = getattr(ls, "gamma", None)
    if lam is None:
        lam = getattr(ls, "lambda1")
    lam = lam.detach().to(dtype or wb[0].dtype)
    w, b = wb
    return w * lam[:, None], None if b is None else b * lam


def _ls(mod: Any) -> nn.Module | None:
    return None if mod is None or isinstance(mod, nn.Identity) else mod


# ------------------------------------------------------------------------------------------- families
def _bert(i: int, m: nn.Module) -> LayerAnatomy:
    sa = m.attention.self
    heads = int(getattr(sa, "num_attention_heads", 0) or sa.config.num_attention_heads)
    return LayerAnatomy(
        i, m, sa, sa.value, m.attention.output.dense, m.attention.output.LayerNorm, m.output.LayerNorm,
        m.intermediate.dense, m.intermediate.intermediate_act_fn, m.output.dense, heads, heads, pre_norm=False,
    )


def _heads_of(att: nn.Module) -> tuple[int, int]:
    cfg = getattr(att, "config", None)
    heads = getattr(att, "num_heads", None) or getattr(att, "num_attention_heads", None)
    if heads is None and cfg is not None:
        heads = cfg.num_attention_heads
    if heads is None:
        heads = att.o_proj.in_features // att.head_dim
    kv = getattr(att, "num_key_value_heads", None) or getattr(cfg, "num_key_value_heads", None) or heads
    groups = getattr(att, "num_key_value_groups", None)
    if groups:
        kv = int(heads) // int(groups)
    return int(heads), int(kv)


def _vit(i: int, m: nn.Module) -> LayerAnatomy:
    att = m.attention
    heads, _ = _heads_of(att)
    mlp = m.mlp
    ln1 = m.layernorm_before if hasattr(m, "layernorm_before") else m.norm1
    ln2 = m.layernorm_after if hasattr(m, "layernorm_after") else m.norm2
    return LayerAnatomy(
        i, m, att, att.v_proj, att.o_proj, ln1, ln2, mlp.fc1, mlp.activation_fn, mlp.fc2, heads, heads,
        pre_norm=True, ls1=_ls(getattr(m, "layer_scale1", None)), ls2=_ls(getattr(m, "layer_scale2", None)),
    )


def _gpt2(i: int, m: nn.Module) -> LayerAnatomy:
    att = m.attn
    d = att.embed_dim
    return LayerAnatomy(
        i, m, att, att.c_attn, att.c_proj, m.ln_1, m.ln_2, m.mlp.c_fc, m.mlp.act, m.mlp.c_proj,
        int(att.num_heads), int(att.num_heads), pre_norm=True, value_rows=slice(2 * d, 3 * d),
    )


def _llama(i: int, m: nn.Module) -> LayerAnatomy:
    att = m.self_attn
    heads, kv = _heads_of(att)
    mlp = m.mlp
    return LayerAnatomy(
        i, m, att, att.v_proj, att.o_proj, m.input_layernorm, m.post_attention_layernorm, mlp.up_proj,
        mlp.act_fn, mlp.down_proj, heads, kv, pre_norm=True, gate=mlp.gate_proj,
    )


def _timm(i: int, m: nn.Module) -> LayerAnatomy:
    att = m.attn
    for part in ("norm", "q_norm", "k_norm"):
        if part == "norm" and not isinstance(getattr(att, part, nn.Identity()), nn.Identity):
            raise _checks.UnsupportedModelError(
                "timm block with a norm inside the attention output (attn.norm) is not supported by the "
                f"value-aware methods. Supported: {VALUE_AWARE_FAMILIES}"
            )
    mlp_norm = getattr(m.mlp, "norm", nn.Identity())
    if not isinstance(mlp_norm, nn.Identity) or not hasattr(m.mlp, "fc1"):
        raise _checks.UnsupportedModelError(
            f"timm block with a {type(m.mlp).__name__} MLP is not supported by the value-aware methods. "
            f"Supported: {VALUE_AWARE_FAMILIES}"
        )
    d = att.qkv.in_features
    return LayerAnatomy(
        i, m, att, att.qkv, att.proj, m.norm1, m.norm2, m.mlp.fc1, m.mlp.act, m.mlp.fc2,
        int(att.num_heads), int(att.num_heads), pre_norm=True, value_rows=slice(2 * d, 3 * d),
        ls1=_ls(m.ls1), ls2=_ls(m.ls2),
    )


def _kind(m: nn.Module) -> Callable[[int, nn.Module], LayerAnatomy] | None:
    """Which family's block ``m`` is, from its structure (None: not a block)."""
    att = getattr(m, "attention", None)
    if att is not None and hasattr(getattr(att, "self", None), "value") and hasattr(m, "intermediate"):
        return _bert
    if att is not None and hasattr(att, "v_proj") and hasattr(m, "mlp") and hasattr(m.mlp, "fc1"):
        return _vit
    if hasattr(m, "ln_1") and hasattr(getattr(m, "attn", None), "c_attn") and hasattr(m, "mlp"):
        return _gpt2
    if hasattr(m, "input_layernorm") and hasattr(getattr(m, "self_attn", None), "v_proj") and hasattr(
            getattr(m, "mlp", None), "gate_proj"):
        return _llama
    if type(m).__module__.startswith("timm.") and hasattr(getattr(m, "attn", None), "qkv") and hasattr(m, "ls1"):
        return _timm
    return None


def _head(model: nn.Module, layers: list[LayerAnatomy], family: str) -> dict[str, Any]:
    """The final norm, pooler and logit layer of the supported heads (missing pieces stay None)."""
    d = layers[0].norm1.weight.shape[0] if getattr(layers[0].norm1, "weight", None) is not None else None
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    out: dict[str, Any] = {"final_norm": None, "pooler": None, "classifier": None,
                           "readout": "last" if family in ("gpt2", "llama") else "first"}
    if family == "timm":
        if getattr(model, "global_pool", "token") != "token" or not isinstance(
                getattr(model, "fc_norm", nn.Identity()), nn.Identity):
            return out
        out["final_norm"] = _ls(getattr(model, "norm", None))
        head = getattr(model, "head", None)
        out["classifier"] = head if isinstance(head, nn.Linear) else None
        return out
    for name in ("layernorm", "ln_f", "norm"):
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module) and family != "bert" and hasattr(mod, "weight"):
            out["final_norm"] = mod
            break
    head = next((getattr(model, n) for n in ("classifier", "lm_head", "score") if isinstance(
        getattr(model, n, None), nn.Module)), None)
    if family == "bert" and head is not None and hasattr(head, "out_proj") and hasattr(head, "dense"):
        out["pooler"], head = (head.dense, torch.tanh), head.out_proj  # RoBERTa-style head on CLS
    elif family == "bert" and isinstance(getattr(base, "pooler", None), nn.Module):
        out["pooler"] = (base.pooler.dense, base.pooler.activation)
    if isinstance(head, nn.Linear) and (d is None or head.in_features == d):
        out["classifier"] = head
    return out


_FAMILY = {_bert: "bert", _vit: "vit", _gpt2: "gpt2", _llama: "llama", _timm: "timm"}


def anatomy(model: nn.Module) -> ModelAnatomy:
    """The :class:`ModelAnatomy` of a supported model (blocks in module order).

    Raises:
        UnsupportedModelError: no block of a supported family was found, the blocks mix families, or a
            block has a part the value-aware maths does not model (cross-attention, an attention norm).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {_checks.describe(model)}")
    found: list[tuple[nn.Module, Callable]] = []
    inside: set[int] = set()
    for _, m in model.named_modules():
        if id(m) in inside:
            continue
        kind = _kind(m)
        if kind is not None:
            found.append((m, kind))
            inside.update(id(s) for s in m.modules())
    if not found:
        raise _checks.UnsupportedModelError(
            f"the value-aware methods found no transformer block they know in {type(model).__name__}. "
            f"Supported: {VALUE_AWARE_FAMILIES}"
        )
    kinds = {k for _, k in found}
    if len(kinds) > 1:
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} mixes block types ({', '.join(sorted(_FAMILY[k] for k in kinds))}); the "
            f"value-aware methods explain one stack of blocks. Supported: {VALUE_AWARE_FAMILIES}"
        )
    for m, _ in found:
        if getattr(m, "crossattention", None) is not None:
            raise _checks.UnsupportedModelError(
                f"{type(m).__name__} has cross-attention; the value-aware methods model self-attention blocks "
                f"only. Supported: {VALUE_AWARE_FAMILIES}"
            )
    layers = [kind(i, m) for i, (m, kind) in enumerate(found)]
    family = _FAMILY[found[0][1]]
    return ModelAnatomy(family=family, layers=layers, **_head(model, layers, family))


# ------------------------------------------------------------------------------------------- states
def _first_tensor(args: tuple, kwargs: dict, key: str = "hidden_states") -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get(key, kwargs.get("x"))
    if not isinstance(value, torch.Tensor):
        raise _checks.CaptureError(f"could not find the hidden states entering a block (keys {sorted(kwargs)})")
    return value


def _install_state_hooks(stack: ExitStack, anat: ModelAnatomy, states: LayerStates, L: int) -> None:
    """Forward hooks that fill ``states`` (each list indexed by layer; reset at the first block)."""
    slots = {"inputs": [None] * L, "norm1_in": [None] * L, "norm2_in": [None] * L, "outputs": [None] * L}

    def keep(name: str, i: int, t: torch.Tensor) -> None:
        slots[name][i] = t.detach()
        setattr(states, name, slots[name])

    def add(mod: nn.Module, fn: Callable, pre: bool) -> None:
        h = (mod.register_forward_pre_hook(fn, with_kwargs=True) if pre
             else mod.register_forward_hook(fn, with_kwargs=True))
        stack.callback(h.remove)

    for layer in anat.layers:
        i = layer.index
        add(layer.module, lambda m, a, k, i=i: keep("inputs", i, _first_tensor(a, k)), True)
        add(layer.module, lambda m, a, k, o, i=i: keep("outputs", i, o[0] if isinstance(o, (tuple, list)) else o),
            False)
        add(layer.norm1, lambda m, a, k, i=i: keep("norm1_in", i, _first_tensor(a, k)), True)
        add(layer.norm2, lambda m, a, k, i=i: keep("norm2_in", i, _first_tensor(a, k)), True)
    if anat.final_norm is not None:
        add(anat.final_norm, lambda m, a, k: setattr(states, "final_in", _first_tensor(a, k).detach()), True)


def record_states(model: nn.Module, inputs: Any, *, anat: ModelAnatomy | None = None,
                  tokenizer: Any = None) -> tuple[AttentionRecord, LayerStates, ModelAnatomy]:
    """One forward pass (no gradients) keeping the attention probabilities (per head) and, per layer, the
    states the value-aware methods need (see :class:`LayerStates`). Everything is restored on exit."""
    from . import capture as _capture
    from .hooks import run_forward

    anat = anatomy(model) if anat is None else anat
    states = LayerStates()
    session = _capture(model, tokenizer=tokenizer)
    with ExitStack() as stack:
        rec = stack.enter_context(session)
        _install_state_hooks(stack, anat, states, len(anat.layers))
        with torch.no_grad():
            run_forward(model, inputs, session.adapter.input_hint)
    missing = [i for i, t in enumerate(states.inputs) if t is None] if states.inputs else list(range(len(anat.layers)))
    if missing or len(rec.attentions) != len(anat.layers):
        raise _checks.CaptureError(
            f"the forward pass did not run every block (missing layers {missing}, {len(rec.attentions)} attention "
            f"layers for {len(anat.layers)} blocks)"
        )
    return rec, states, anat
