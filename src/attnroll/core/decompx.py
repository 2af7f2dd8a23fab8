"""DecompX (Modarressi et al., ACL 2023): every token's share of every hidden vector, carried through the blocks.

Shares are a tensor S (B, n, K, d) with K = n + 1: S[b, i, k] is the part of token i's vector that comes from
input token k, and the last slot (k = n) is the *bias share*, what no token is given. Σ_k S[b, i, k] equals
the actual vector exactly. Per block (see :class:`~attnroll.core.value_aware.Block` for the layout):

* attention: z_{i←k} = Σ_h Σ_j α^h_ij (s_{j←k} W_V^h) W_O^h + s_{i←k}; the bias Σ_h (Σ_j α^h_ij) W_O^h b_V^h
  + b_O (W_O b_V + b_O, as attention rows sum to 1) is spread by AbsDot;
* a norm: g(s) = (s − mean(s)) / σ_actual ⊙ γ (no centring for RMSNorm), β spread by AbsDot;
* the MLP: fc1 shares (+ b1 by AbsDot), the activation linearised per element with the *actual*
  pre-activation ζ: θ = act(ζ) / ζ, the same θ for every share (gated MLPs: the gate act(ζ_gate) is held
  at its actual value and multiplies the fc1 shares); fc2 shares (+ b2 by AbsDot);
* the head (final norm, optional pooler with its activation linearised the same way, classifier). A head
  that pools rows (timm ``global_pool='avg'``, DINOv2's CLS ⊕ mean of the patch rows) reads
  :func:`pool_shares`: each row's shares through the per-token final norm, then the pooled parts' weighted
  sums of the rows' shares concatenated along the features -- linear, so the shares still add up exactly.

AbsDot: a bias b joins share k with weight |b · s_k| / Σ_k' |b · s_k'| (token slots only); a row where every
weight is 0 puts b in the bias share. ``bias="separate"`` puts every bias in the bias share instead.
"""

from __future__ import annotations

from typing import Callable

import torch

from .value_aware import Block, Mlp, Norm, norm_scale, norm_share

__all__ = ["initial_shares", "add_bias", "norm_shares", "mlp_shares", "block_shares", "head_shares",
           "pool_shares", "separate_bias_shares"]

_BIAS_MODES = ("absdot", "separate")


def initial_shares(x: torch.Tensor) -> torch.Tensor:
    """S (B, n, n + 1, d) with S[b, i, i] = x[b, i] (each token owns its own embedding), the rest 0."""
    B, n, d = x.shape
    S = x.new_zeros(B, n, n + 1, d)
    idx = torch.arange(n, device=x.device)
    S[:, idx, idx] = x
    return S


def add_bias(S: torch.Tensor, bias: torch.Tensor | None, mode: str = "absdot") -> torch.Tensor:
    """S (B, r, K, d) plus a bias (d,) or (B, r, d) split over the token slots by AbsDot (see module)."""
    if bias is None:
        return S
    if mode not in _BIAS_MODES:
        raise ValueError(f"bias must be one of {_BIAS_MODES}, got {mode!r}")
    b = bias if bias.ndim == 1 else bias.unsqueeze(-2)  # (d,) or (B, r, 1, d)
    if mode == "separate":
        w = S.new_zeros(S.shape[:-1])
        w[..., -1] = 1
    else:
        dots = (S * b).sum(-1).abs() if bias.ndim > 1 else (S @ b).abs()
        dots[..., -1] = 0
        tot = dots.sum(-1, keepdim=True)
        w = dots / torch.where(tot > 0, tot, torch.ones_like(tot))
        w[..., -1] = (tot.squeeze(-1) <= 0).to(S.dtype)
    return S + w.unsqueeze(-1) * b


def norm_shares(S: torch.Tensor, norm: Norm, bias: str = "absdot") -> torch.Tensor:
    """The norm applied to the shares S (B, r, K, d) of rows whose actual vectors are Σ_k S."""
    scale = norm_scale(S.sum(-2), norm)
    return add_bias(norm_share(S, scale, norm), norm.bias, bias)


def _linearised(act: Callable, pre: torch.Tensor) -> torch.Tensor:
    """θ = act(ζ) / ζ elementwise (0 where ζ = 0, where any θ gives the same product)."""
    nz = pre != 0
    return torch.where(nz, act(pre) / torch.where(nz, pre, torch.ones_like(pre)), torch.zeros_like(pre))


def mlp_shares(U: torch.Tensor, mlp: Mlp, bias: str = "absdot") -> torch.Tensor:
    """The MLP applied to the shares U (B, r, K, d) of its input (see module): (B, r, K, d)."""
    Z = add_bias(U @ mlp.w1.T, mlp.b1, bias)
    if mlp.wg is not None:
        gate = U.sum(-2) @ mlp.wg.T
        if mlp.bg is not None:
            gate = gate + mlp.bg
        coef = mlp.act(gate)
    else:
        coef = _linearised(mlp.act, Z.sum(-2))
    return add_bias((Z * coef.unsqueeze(-2)) @ mlp.w2.T, mlp.b2, bias)


def _value_shares(S: torch.Tensor, block: Block, bias: str) -> torch.Tensor:
    """Per-head value shares (B, n, K, H, d_h) of the tokens (norm1 first for pre-LN blocks), no b_V."""
    X = norm_shares(S, block.norm1, bias) if block.pre_norm else S
    B, n, K, _ = X.shape
    v = (X @ block.wv.T).view(B, n, K, block.kv_heads, block.head_dim)
    if block.heads != block.kv_heads:
        v = v.repeat_interleave(block.heads // block.kv_heads, dim=3)
    return v


def _attention_bias(block: Block, alpha_rows: torch.Tensor) -> torch.Tensor | None:
    """What the biases add to each row of the attention output, (B, r, d): Σ_h (Σ_j α^h_ij) W_O^h b_V^h + b_O
    (the value bias passes through weighted by the row sums of α, 1 up to the softmax's rounding)."""
    out = block.bo
    if block.bv is not None:
        bv = block.bv.view(block.kv_heads, block.head_dim)
        if block.heads != block.kv_heads:
            bv = bv.repeat_interleave(block.heads // block.kv_heads, dim=0)
        wo = block.wo.view(block.wo.shape[0], block.heads, block.head_dim)
        per_head = torch.einsum("dhe,he->hd", wo, bv)
        vb = torch.einsum("bhr,hd->brd", alpha_rows.sum(-1), per_head)
        out = vb if out is None else out + vb
    return out


def block_shares(S: torch.Tensor, alpha: torch.Tensor, block: Block, *, rows: torch.Tensor | None = None,
                 bias: str = "absdot", chunk: int | None = None) -> torch.Tensor:
    """Shares of the block's output, (B, r, K, d), from the shares S (B, n, K, d) of its input and the
    attention alpha (B, H, n, n) the block actually used; ``rows`` (r,) long = only those output rows
    (default all). ``chunk`` rows at a time bound the memory (default: all at once)."""
    v = _value_shares(S, block, bias)
    rows = torch.arange(S.shape[1], device=S.device) if rows is None else rows
    step = len(rows) if chunk is None else max(1, int(chunk))
    parts = []
    for start in range(0, len(rows), step):
        R = rows[start:start + step]
        a = torch.einsum("bhij,bjkhe->bikhe", alpha[:, :, R], v)
        z = add_bias(a.flatten(-2) @ block.wo.T + S[:, R], _attention_bias(block, alpha[:, :, R]), bias)
        if block.pre_norm:
            parts.append(z + mlp_shares(norm_shares(z, block.norm2, bias), block.mlp, bias))
        else:
            h = norm_shares(z, block.norm1, bias)
            parts.append(norm_shares(h + mlp_shares(h, block.mlp, bias), block.norm2, bias))
    return torch.cat(parts, dim=1)


def head_shares(S: torch.Tensor, *, final_norm: Norm | None, pooler: tuple | None,
                classifier: tuple, bias: str = "absdot", classes: torch.Tensor | None = None) -> torch.Tensor:
    """Shares of the logits from the shares S (B, K, d) of the vector the head reads: (B, K, C), or with
    ``classes`` (B,) long only each example's class, (B, K).

    ``pooler`` = (W, b, act) or None (BERT: act(W h + b), linearised); ``classifier`` = (W, b or None). A
    classifier bias is spread by AbsDot over the whole logit vector, as every other bias; without one, only
    the asked columns are computed (an LM head's vocabulary is never formed)."""
    X = S.unsqueeze(1)
    if final_norm is not None:
        X = norm_shares(X, final_norm, bias)
    if pooler is not None:
        W, b, act = pooler
        Z = add_bias(X @ W.T, b, bias)
        X = Z * _linearised(act, Z.sum(-2)).unsqueeze(-2)
    W, b = classifier
    X = X.squeeze(1)
    if classes is not None and b is None:
        return torch.einsum("bkd,bd->bk", X, W[classes])
    out = add_bias((X @ W.T).unsqueeze(1), b, bias).squeeze(1)
    if classes is None:
        return out
    return out[torch.arange(out.shape[0], device=out.device), :, classes]


def pool_shares(S: torch.Tensor, pools: list[torch.Tensor], *, token_norm: Norm | None = None,
                bias: str = "absdot") -> torch.Tensor:
    """Shares of the vector a pooling head reads, (B, K, G·d), from the shares S (B, n, K, d) of every output
    row: ``token_norm`` applied to each row (its own statistics, β by AbsDot), then for each of the G
    ``pools`` (B, n) row weights the weighted sum of the rows' shares, the parts concatenated in order."""
    if token_norm is not None:
        S = norm_shares(S, token_norm, bias)
    return torch.cat([torch.einsum("bn,bnkd->bkd", w.to(S.dtype), S) for w in pools], dim=-1)


# ------------------------------------------------------------------------------------------- fast exact path
def _frozen_norm(v: torch.Tensor, norm: Norm) -> torch.Tensor:
    """The norm with its divisor frozen at the actual value (no gradient through the statistics)."""
    scale = norm_scale(v, norm).detach()
    out = (v if norm.rms else v - v.mean(-1, keepdim=True)) / scale
    out = out if norm.weight is None else out * norm.weight
    return out if norm.bias is None else out + norm.bias


def _frozen_mlp(u: torch.Tensor, mlp: Mlp) -> torch.Tensor:
    z = u @ mlp.w1.T
    if mlp.b1 is not None:
        z = z + mlp.b1
    if mlp.wg is not None:
        g = u @ mlp.wg.T
        coef = mlp.act(g if mlp.bg is None else g + mlp.bg).detach()
    else:
        coef = _linearised(mlp.act, z).detach()
    out = (coef * z) @ mlp.w2.T
    return out if mlp.b2 is None else out + mlp.b2


def _frozen_block(x: torch.Tensor, alpha: torch.Tensor, block: Block) -> torch.Tensor:
    """The block with attention, norm divisors and activation slopes frozen: affine in x."""
    B, n, _ = x.shape
    xv = _frozen_norm(x, block.norm1) if block.pre_norm else x
    v = xv @ block.wv.T
    if block.bv is not None:
        v = v + block.bv
    v = v.view(B, n, block.kv_heads, block.head_dim).transpose(1, 2)
    if block.heads != block.kv_heads:
        v = v.repeat_interleave(block.heads // block.kv_heads, dim=1)
    o = (alpha.detach() @ v).transpose(1, 2).reshape(B, n, -1) @ block.wo.T
    z = x + (o if block.bo is None else o + block.bo)
    if block.pre_norm:
        return z + _frozen_mlp(_frozen_norm(z, block.norm2), block.mlp)
    h = _frozen_norm(z, block.norm1)
    return _frozen_norm(h + _frozen_mlp(h, block.mlp), block.norm2)


def separate_bias_shares(x0: torch.Tensor, alphas: list[torch.Tensor], blocks: list[Block], *,
                         positions: torch.Tensor, classes: torch.Tensor, final_norm: Norm | None,
                         pooler: tuple | None, classifier: tuple, pools: list[torch.Tensor] | None = None,
                         token_norm: Norm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DecompX with every bias in the bias share (``bias="separate"``) in one forward + one backward pass.

    With attention, norm divisors and activation slopes frozen at their actual values the network is affine
    in the input embeddings x0 (B, n, d), y = Σ_k J_k x0_k + c, so token k's share of the logit,
    J_k x0_k = Σ_d ∂y/∂x0_kd · x0_kd, is exactly what :func:`block_shares` / :func:`head_shares` carry
    forward, and c is the bias share. Returns (token shares (B, n), logits y (B,)) at ``positions`` (B,)
    for ``classes`` (B,); a pooling head reads ``pools`` (row weights (B, n) per part, see
    :func:`pool_shares`, after ``token_norm``) instead of the rows at ``positions``."""
    x = x0.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        h = x
        for blk, a in zip(blocks, alphas):
            h = _frozen_block(h, a, blk)
        if pools is None:
            v = h[torch.arange(h.shape[0], device=h.device), positions]
        else:
            h = h if token_norm is None else _frozen_norm(h, token_norm)
            v = torch.cat([torch.einsum("bn,bnd->bd", w.to(h.dtype), h) for w in pools], dim=-1)
        if final_norm is not None:
            v = _frozen_norm(v, final_norm)
        if pooler is not None:
            W, b, act = pooler
            z = v @ W.T + (0 if b is None else b)
            v = _linearised(act, z).detach() * z
        W, b = classifier
        y = (v * W[classes]).sum(-1) + (0 if b is None else b[classes])
        (g,) = torch.autograd.grad(y.sum(), x)
    return (g * x0).sum(-1), y.detach()
