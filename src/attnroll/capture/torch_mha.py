"""``torch.nn.MultiheadAttention`` adapter (nn.TransformerEncoder / Decoder / Transformer, ...).

Two obstacles: (1) ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` call their attention
with ``need_weights=False`` and, by default, MultiheadAttention averages the heads; (2) in eval mode the
layers and the encoder take a fused "fast path" (``torch._transformer_encoder_layer_fwd``, nested tensors)
that never calls ``self_attn`` at all. So for the duration of the capture the fast path is switched off
(``torch.backends.mha.set_fastpath_enabled(False)``, a process-wide flag, restored afterwards) and each
MultiheadAttention's ``forward`` is temporarily wrapped to ask for per-head weights, record them, and hand
the caller exactly what it asked for (no weights, or head-averaged weights).

With ``keep_grad=True`` the weights torch returns are a reshaped *view* of the matrix it multiplies with the
values, so a gradient never reaches them. In that mode the wrapper computes the attention itself from the
module's parameters (same maths: softmax(q kᵀ/√d + masks) v, then the output projection) so that the
recorded (B, H, L, S) tensor is the one the output depends on.

The layer anatomy of ``nn.TransformerEncoderLayer`` blocks is read here too (:data:`BLOCKS`).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .anatomy_parts import BlockKind, fused, norms, proj
from .hooks import Adapter, Recorder, Site, make_sites, set_attr_temporarily, stream_names
from .layers import LayerAnatomy, Proj
from .record import AttentionRecord


def has_mha(model: nn.Module) -> bool:
    return any(isinstance(m, nn.MultiheadAttention) for m in model.modules())


class MHAAdapter(Adapter):
    family = "torch:mha"

    def sites(self) -> list[Site]:
        named = [(n, m) for n, m in self.model.named_modules() if isinstance(m, nn.MultiheadAttention)]
        # Cross attention of nn.TransformerDecoderLayer is its `multihead_attn`; everything else is self.
        selfs = [(n, m) for n, m in named if n.rsplit(".", 1)[-1] != "multihead_attn"]
        streams = dict(zip((n for n, _ in selfs), stream_names([n for n, _ in selfs], towers=False)))
        return make_sites([(n, m, streams.get(n, "cross")) for n, m in named])

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        before = torch.backends.mha.get_fastpath_enabled()
        stack.callback(torch.backends.mha.set_fastpath_enabled, before)
        torch.backends.mha.set_fastpath_enabled(False)
        #: The key padding mask the first self-attention module saw in the latest pass (a model of one's own
        #: may take the mask under any name and hand it on to nn.Transformer*).
        self.seen_padding: torch.Tensor | None = None
        first = next((s for s in sites if s.stream != "cross" and s.layer == 0), None)
        for site in sites:
            set_attr_temporarily(stack, site.module, "forward", _wrapped_forward(site, recorder, self, site is first))

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        # nn.Transformer* take key padding masks with True = padding; expose the 1 = real-token form.
        for key in ("src_key_padding_mask", "key_padding_mask"):
            m = inputs.get(key)
            if isinstance(m, torch.Tensor) and m.dtype == torch.bool:
                record.attention_mask = (~m).long()
                break
        seen = getattr(self, "seen_padding", None)
        if record.attention_mask is None and seen is not None:
            record.attention_mask = (~seen).long()
        self.seen_padding = None


def _wrapped_forward(site: Site, recorder: Recorder, adapter: MHAAdapter | None = None, first: bool = False):
    module = site.module
    original = module.forward  # the bound method (or a caller's own instance-level forward)

    def forward(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        if first and adapter is not None and isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.ndim == 2:
            # bool (True = padding) or additive float (-inf = padding, as nn.TransformerEncoder hands it on)
            kpm = key_padding_mask.detach()
            adapter.seen_padding = kpm if kpm.dtype == torch.bool else torch.isneginf(kpm)
        if recorder.keep_grad:
            out, weights = _attention_in_graph(module, query, key, value, key_padding_mask, attn_mask, is_causal)
        else:
            out, weights = original(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=True,
                attn_mask=attn_mask,
                average_attn_weights=False,
                is_causal=is_causal,
            )
        # Unbatched input gives (H, L, S); the record is always batch-first. (In the keep_grad path the 4-D
        # tensor is stored as is: a reshaped view would not receive gradients.)
        weights4 = weights.unsqueeze(0) if weights.ndim == 3 else weights
        recorder.store(site, weights4)
        if weights.ndim == 4 and query.dim() == 2:
            weights = weights.squeeze(0)
        if not need_weights:
            return out, None
        return out, (weights.mean(dim=-3) if average_attn_weights else weights)

    return forward


def _attention_in_graph(
    m: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MultiheadAttention's forward with the per-head probabilities as a tensor the output depends on.

    Returns (output in the caller's layout, probabilities (B, H, L, S), B = 1 for unbatched input)."""
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError(
            "keep_grad=True supports nn.MultiheadAttention without add_bias_kv / add_zero_attn; "
            "capture without keep_grad or use modules=/to_probs="
        )
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif m.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    L, B, E = query.shape
    S = key.shape[0]
    H, d = m.num_heads, m.head_dim
    if m._qkv_same_embed_dim:
        w_q, w_k, w_v = m.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    b_q = b_k = b_v = None
    if m.in_proj_bias is not None:
        b_q, b_k, b_v = m.in_proj_bias.chunk(3)
    # (len, B, E) -> (B, H, len, d)
    q = nn.functional.linear(query, w_q, b_q).reshape(L, B, H, d).permute(1, 2, 0, 3)
    k = nn.functional.linear(key, w_k, b_k).reshape(S, B, H, d).permute(1, 2, 0, 3)
    v = nn.functional.linear(value, w_v, b_v).reshape(S, B, H, d).permute(1, 2, 0, 3)
    scores = (q * d**-0.5) @ k.transpose(-2, -1)
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=scores.device).triu(1)
    if attn_mask is not None:
        am = attn_mask.reshape(B, H, L, S) if attn_mask.dim() == 3 else attn_mask
        scores = scores.masked_fill(am, float("-inf")) if am.dtype == torch.bool else scores + am
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        scores = scores.masked_fill(kpm, float("-inf")) if kpm.dtype == torch.bool else scores + kpm
    probs = scores.softmax(dim=-1)
    used = nn.functional.dropout(probs, p=m.dropout, training=m.training)
    out = (used @ v).permute(2, 0, 1, 3).reshape(L, B, E)
    out = m.out_proj(out)
    if unbatched:
        return out.squeeze(1), used
    return (out.transpose(0, 1) if m.batch_first else out), used


# ------------------------------------------------------------------------------------------- layer anatomy
def _encoder_layer(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """``nn.TransformerEncoderLayer`` (fused ``self_attn.in_proj_weight`` or separate q / k / v weights,
    ``out_proj``, ``linear1`` / ``linear2``, ``norm1`` / ``norm2``, ``norm_first``)."""
    att = m.self_attn
    d = att.embed_dim
    if att._qkv_same_embed_dim:
        q, k, v = fused(m, "self_attn", d, weight="in_proj_weight",
                        bias="in_proj_bias" if att.in_proj_bias is not None else None)
    else:
        b = "in_proj_bias" if att.in_proj_bias is not None else None
        q, k, v = (Proj(module=att, path="self_attn", weight=f"{n}_proj_weight", bias=b,
                        rows=slice(j * d, (j + 1) * d)) for j, n in enumerate("qkv"))
    heads = int(att.num_heads)
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=proj(m, "self_attn.out_proj"), heads=heads,
        kv_heads=heads, pre_norm=bool(m.norm_first), norm1=m.norm1, norm2=m.norm2,
        norms=norms(m, ("norm1", "norm2")), fc1=proj(m, "linear1"), act=m.activation, fc2=proj(m, "linear2"),
    )


def _is_encoder_layer(m: nn.Module) -> bool:
    return isinstance(getattr(m, "self_attn", None), nn.MultiheadAttention) and hasattr(m, "linear1")


def _no_head(model: nn.Module, layers: list[LayerAnatomy]) -> tuple[dict[str, Any], str]:
    return {}, ""


#: The torch block kind: its head is the caller's own module (nothing read).
BLOCKS = (
    BlockKind(name="torch", matches=_is_encoder_layer, build=_encoder_layer,
              parts="self_attn (nn.MultiheadAttention) + linear1 (torch)", label="nn.TransformerEncoderLayer",
              refused="torch nn.TransformerEncoderLayer blocks: the value-aware methods do not record their states",
              head=_no_head),
)
