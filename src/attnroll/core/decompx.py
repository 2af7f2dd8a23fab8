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

Cost: every row carries n + 1 share vectors, so a block costs about (n + 1) · 10 / 12 times a forward block's
matrix products (value, output, fc1, fc2 per share; the forward also has queries and keys), O(n) forwards by
construction. The kernels keep the rest small: a norm before a linear map is folded into its weights
(:func:`norm_linear_shares`), the MLP's wide tensor is written, scaled and read once (:func:`mlp_shares`),
and a chunk of rows is mixed by one batched product per (example, head) over head-major value shares.
"""

from __future__ import annotations

import functools

import torch

from .value_aware import (
    Block,
    Mlp,
    Norm,
    Routed,
    apply_norm,
    linearised,
    mlp_terms,
    mlp_width,
    norm_scale,
    norm_share,
    with_rows,
)

__all__ = ["initial_shares", "absdot_weights", "add_bias", "norm_shares", "norm_linear_shares", "mlp_shares",
           "block_shares", "head_shares", "pool_shares", "separate_bias_shares", "linearised"]

_BIAS_MODES = ("absdot", "separate")


def initial_shares(x: torch.Tensor) -> torch.Tensor:
    """S (B, n, n + 1, d) with S[b, i, i] = x[b, i] (each token owns its own embedding), the rest 0."""
    B, n, d = x.shape
    S = x.new_zeros(B, n, n + 1, d)
    idx = torch.arange(n, device=x.device)
    S[:, idx, idx] = x
    return S


def absdot_weights(dots: torch.Tensor, mode: str = "absdot") -> torch.Tensor:
    """Each slot's weight in a bias (..., K) from the bias·share dot products ``dots`` (..., K) (the last
    slot, the bias share, is ignored): |b · s_k| / Σ_k' |b · s_k'|, or 1 in the bias share where every dot is
    0; ``mode="separate"``: 1 in the bias share. The weights of a row sum to 1."""
    if mode not in _BIAS_MODES:
        raise ValueError(f"bias must be one of {_BIAS_MODES}, got {mode!r}")
    if mode == "separate":
        w = dots.new_zeros(dots.shape)
        w[..., -1] = 1
        return w
    dots = dots.abs()
    dots[..., -1] = 0
    tot = dots.sum(-1, keepdim=True)
    w = dots / torch.where(tot > 0, tot, torch.ones_like(tot))
    w[..., -1] = (tot.squeeze(-1) <= 0).to(dots.dtype)
    return w


def _bias_dots(S: torch.Tensor, bias: torch.Tensor, mode: str) -> torch.Tensor:
    """b · s_k for every slot (..., K), bias (d,) or (..., d) per row; zeros for ``separate`` (unused there)."""
    if mode == "separate":
        return S.new_zeros(S.shape[:-1])
    return S @ bias if bias.ndim == 1 else (S @ bias.unsqueeze(-1)).squeeze(-1)


def add_bias(S: torch.Tensor, bias: torch.Tensor | None, mode: str = "absdot") -> torch.Tensor:
    """S (B, r, K, d) plus a bias (d,) or (B, r, d) split over the token slots by AbsDot (see module)."""
    if bias is None:
        return S
    return _add_bias_(S.clone(), bias, mode)


def _add_bias_(S: torch.Tensor, bias: torch.Tensor | None, mode: str) -> torch.Tensor:
    """:func:`add_bias` in place on S (an intermediate nobody else holds): no second (B, r, K, d) tensor."""
    if bias is None:
        return S
    w = absdot_weights(_bias_dots(S, bias, mode), mode)
    return S.addcmul_(w.unsqueeze(-1), bias if bias.ndim == 1 else bias.unsqueeze(-2))


def norm_shares(S: torch.Tensor, norm: Norm, bias: str = "absdot") -> torch.Tensor:
    """The norm applied to the shares S (B, r, K, d) of rows whose actual vectors are Σ_k S."""
    scale = norm_scale(S.sum(-2), norm)
    return _add_bias_(norm_share(S, scale, norm), norm.bias, bias)


def _folded(w: torch.Tensor, norm: Norm | None) -> torch.Tensor:
    """w (out, d) with the norm's γ and centring folded in: g(s) @ w.T = (s @ wf.T) / σ for every share s
    (Σ_j (s_j − mean s) γ_j w_oj = Σ_j s_j (γ_j w_oj − mean_j' γ_j' w_oj'))."""
    if norm is None:
        return w
    wf = w if norm.weight is None else w * norm.weight
    return wf if norm.rms else wf - wf.mean(-1, keepdim=True)


def _beta_weights(U: torch.Tensor, norm: Norm | None, scale: torch.Tensor, mode: str) -> torch.Tensor | None:
    """The AbsDot weights (B, r, K) of the norm's β over the shares U (B, r, K, d) of its input (β · g(s) =
    s · u / σ with u = β ⊙ γ centred); None without a norm or β."""
    if norm is None or norm.bias is None:
        return None
    if mode == "separate":
        return absdot_weights(U.new_zeros(U.shape[:-1]), mode)
    u = norm.bias if norm.weight is None else norm.bias * norm.weight
    return absdot_weights((U @ (u if norm.rms else u - u.mean())) / scale, mode)


def norm_linear_shares(U: torch.Tensor, norm: Norm, w: torch.Tensor, bias: str = "absdot") -> torch.Tensor:
    """``norm_shares(U, norm, bias) @ w.T`` (B, r, K, out) without forming the normalised shares: γ and the
    centring folded into w, the row divisor and β's AbsDot share applied to the (narrower or equal) output."""
    scale = norm_scale(U.sum(-2), norm)  # (B, r, 1)
    out = (U @ _folded(w, norm).T).div_(scale.unsqueeze(-1))
    wb = _beta_weights(U, norm, scale, bias)
    return out if wb is None or norm.bias is None else out.addcmul_(wb.unsqueeze(-1), w @ norm.bias)


def mlp_shares(U: torch.Tensor, mlp: Mlp | Routed, bias: str = "absdot", norm: Norm | None = None) -> torch.Tensor:
    """The MLP applied to the shares U (B, r, K, d) of its input (see module): (B, r, K, d); with ``norm``,
    to the shares of norm(U) (= ``mlp_shares(norm_shares(U, norm, bias), mlp, bias)``).

    The wide (B, r, K, f) tensor is written once by fc1, scaled once in place by the slopes and read once by
    fc2: the norm is folded into fc1 (:func:`_folded`), and the β and fc1-bias shares, w_k·c for one vector
    c per row, pass the linearised activation and fc2 as rank-one terms w_k · ((c ⊙ θ) W2ᵀ). A mixture of
    experts (:class:`Routed`, its weights aligned with U's rows) is the weighted sum of each chosen expert's
    shares, every expert run on the rows that chose it only."""
    if isinstance(mlp, Routed):
        return _routed_shares(U, mlp, bias, norm)
    actual = U.sum(-2)  # (B, r, d)
    scale = None if norm is None else norm_scale(actual, norm)
    h = actual if norm is None else apply_norm(actual, norm)
    _, coef, const = mlp_terms(mlp, h)  # the actual fc1 output's slopes (B, r, f), a gated up path's constant
    w1f = _folded(mlp.w1, norm)
    P = U @ w1f.T
    P.mul_((coef if scale is None else coef / scale).unsqueeze(-2))
    Y = P @ mlp.w2.T
    del P
    wb = None if norm is None or scale is None else _beta_weights(U, norm, scale, bias)
    c = None if wb is None or norm is None or norm.bias is None else mlp.w1 @ norm.bias  # β's image under fc1 (f,)
    if wb is not None and c is not None:
        Y.addcmul_(wb.unsqueeze(-1), ((c * coef) @ mlp.w2.T).unsqueeze(-2))
    if mlp.b1 is not None:  # b1 · ζ_k = u_k · (W1fᵀ b1) / σ + w^β_k (c · b1), without the wide tensor
        dots = _bias_dots(U, w1f.T @ mlp.b1, bias)
        dots = dots if scale is None else dots / scale
        w = absdot_weights(dots if wb is None or c is None else dots + wb * (c @ mlp.b1), bias)
        Y.addcmul_(w.unsqueeze(-1), ((mlp.b1 * coef) @ mlp.w2.T).unsqueeze(-2))
    Y = _add_bias_(Y, None if const is None else const @ mlp.w2.T, bias)  # a gated up path's constant (GPT-OSS)
    return _add_bias_(Y, mlp.b2, bias)


def _routed_shares(U: torch.Tensor, mlp: Routed, bias: str, norm: Norm | None) -> torch.Tensor:
    """:func:`mlp_shares` of a mixture of experts: Σ_e w_e · expert_e's shares, each expert on its rows."""
    weights = mlp.bound().to(U.dtype)
    Y = torch.zeros_like(U)
    for e, expert in enumerate(mlp.experts):
        chosen = weights[..., e] != 0  # (B, r)
        if bool(chosen.any()):
            part = mlp_shares(U[chosen].unsqueeze(0), expert, bias, norm).squeeze(0)  # (m, K, d)
            Y[chosen] += weights[..., e][chosen][:, None, None] * part
    return Y


def _value_shares(S: torch.Tensor, block: Block, bias: str) -> torch.Tensor:
    """Per-head value shares (B, H, n, K·d_h) of the tokens (norm1 folded in for pre-LN blocks), no b_V:
    heads first, so that mixing a chunk of rows is one batched product per (example, head)."""
    if block.latent is not None:  # multi-head latent attention: the latent's shares, through its own norm
        wa, ba, inner = block.latent
        U = norm_linear_shares(S, block.norm1, wa, bias) if block.pre_norm else S @ wa.T
        v = norm_shares(_add_bias_(U, ba, bias), inner, bias) @ block.wv.T
    else:
        v = norm_linear_shares(S, block.norm1, block.wv, bias) if block.pre_norm else S @ block.wv.T
    B, n, K, _ = S.shape
    v = v.view(B, n, K, block.kv_heads, block.head_dim).permute(0, 3, 1, 2, 4)
    if block.heads != block.kv_heads:
        v = v.repeat_interleave(block.heads // block.kv_heads, dim=1)
    return v.reshape(B, block.heads, n, K * block.head_dim)


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
    (default all). ``chunk`` rows at a time through the MLP bound the memory (default: all at once); the
    attention, whose intermediates are narrower, takes f / d times as many rows per product."""
    v = _value_shares(S, block, bias)
    B, n, K, d = S.shape
    rows = torch.arange(n, device=S.device) if rows is None else rows
    step = len(rows) if chunk is None else max(1, int(chunk))
    wide = max(1, mlp_width(block.mlp) // d)
    out = S.new_empty(B, len(rows), K, d)  # filled chunk by chunk (no list of parts to concatenate)
    for start in range(0, len(rows), step * wide):
        R = rows[start:start + step * wide]
        a = (alpha[:, :, R].to(v.dtype) @ v).view(B, block.heads, len(R), K, block.head_dim)
        z = a.permute(0, 2, 3, 1, 4).reshape(B, len(R), K, -1) @ block.wo.T
        del a
        z = _add_bias_(z.add_(S[:, R]), _attention_bias(block, alpha[:, :, R]), bias)
        for j in range(0, len(R), step):
            zj = z[:, j:j + step]
            mlp = with_rows(block, functools.partial(_take_rows, rows=R[j:j + step])).mlp  # a mixture's routing
            if block.pre_norm:
                got = mlp_shares(zj, mlp, bias, norm=block.norm2).add_(zj)
            else:
                h = norm_shares(zj, block.norm1, bias)
                got = norm_shares(mlp_shares(h, mlp, bias).add_(h), block.norm2, bias)
            out[:, start + j:start + j + zj.shape[1]] = got
    return out


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
        X = Z * linearised(act, Z.sum(-2)).unsqueeze(-2)
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


def _frozen_mlp(u: torch.Tensor, mlp: Mlp | Routed) -> torch.Tensor:
    """The MLP with its slopes, gates and routing frozen at their actual values: affine in u."""
    if isinstance(mlp, Routed):
        weights = mlp.bound().to(u.dtype)
        out = torch.zeros_like(u)
        for e, expert in enumerate(mlp.experts):
            chosen = (weights[..., e] != 0).nonzero(as_tuple=True)
            if chosen[0].numel():
                part = weights[..., e][chosen].unsqueeze(-1) * _frozen_mlp(u[chosen], expert)
                out = out.index_put(chosen, part, accumulate=True)
        return out
    z, coef, const = mlp_terms(mlp, u)
    z = coef.detach() * z if const is None else coef.detach() * z + const.detach()
    out = z @ mlp.w2.T
    return out if mlp.b2 is None else out + mlp.b2


def _frozen_block(x: torch.Tensor, alpha: torch.Tensor, block: Block) -> torch.Tensor:
    """The block with attention, norm divisors and activation slopes frozen: affine in x."""
    B, n, _ = x.shape
    xv = _frozen_norm(x, block.norm1) if block.pre_norm else x
    if block.latent is not None:  # multi-head latent attention: its latent norm frozen too
        wa, ba, inner = block.latent
        xv = _frozen_norm(xv @ wa.T + (0 if ba is None else ba), inner)
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
            v = linearised(act, z).detach() * z
        W, b = classifier
        y = (v * W[classes]).sum(-1) + (0 if b is None else b[classes])
        (g,) = torch.autograd.grad(y.sum(), x)
    return (g * x0).sum(-1), y.detach()


def _take_rows(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` of a per-token tensor (B, n, ...): a mixture of experts' routing of those tokens."""
    return w[:, rows]
