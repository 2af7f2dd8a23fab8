"""Matrix-free layers: attention applied to relevance rows without ever forming the n×n matrix.

A layer is kept as what its attention kernel saw (:class:`KernelInputs`: queries and keys after position
encoding, the mask, scaling, softcapping, sinks; values and the output gradient for gradient rules). Its
probabilities are recomputed one block of queries at a time, exactly as an eager softmax attention computes
them, and folded straight into the product with the relevance rows:

    r ← r · Ã,   Ã = diag(1/s) · (a·P + c·I),   P = fuse_h(block rule)

with a, c the residual coefficients and s the renorm row sums (1 otherwise), the same affine form as
``attnroll.core.residual``. Memory is O(n·d) for the layer plus O(block·n) for one block; the cost is one
QKᵀ and one exponentiation per layer (plus dO·Vᵀ for gradient rules).

The common case — head-mean probabilities of logits that are q·k scaled, under causal / window rules or
none, without padding or renorm — takes a faster path (``apply_layer_tiled``): each row's log-sum-exp (the
one the fused kernel returned, else recomputed once) is folded into the product as one more coordinate, so
that P = exp2(q̃·k̃ᵀ) needs no max, sum or division, and tiles of keys x queries stay in cache.

At small n (one example's H·n² logits within ``WHOLE_ELEMENTS``: ViT-B/16's 197 tokens, short prompts) the
tiles' per-call costs dominate, and ``apply_layer_whole`` computes every live row of a chunk of examples at
once instead: one product, the row max, one exp2, the row sums, and the softmax's division moved onto the
relevance rows (O(n) instead of O(n²)); it needs no log-sum-exp from the kernel. For rollout's head mean
the capture goes one step further (``mean_probs``): every such layer but the top one is fused to its (B, n, n)
head-mean probabilities while the forward runs, right after its kernel, so that the record keeps that
matrix (no larger than q and k) and applying the layer afterwards is one product (``apply_fused``). Where
the model's kernel is transformers' SDPA on CPU, the capture computes such a layer's attention itself
(``attend_mean``): the probabilities once, for both the kernel's output and the head mean (SDPA's fused
CPU kernel computes them too and drops them), the top layer included. Inside ``kept_buffers`` (``explain``'s
capture and product) those fused matrices live in buffers the thread reuses from call to call.

Torch only, device-agnostic: everything runs where the captured tensors live (CPU or CUDA).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from . import fusion

#: Elements of one recomputed block (B·H·rows·keys): 1 Mi float32 = 4 MiB per temporary, so that the few
#: passes over a block (product, softmax, head sum) stay in cache.
BLOCK_ELEMENTS = 1 << 20


@dataclass
class KernelInputs:
    """One attention layer as its kernel received it.

    Attributes:
        q: (B, H, n_q, d) queries after position encoding (RoPE applied).
        k: (B, H_kv, n_k, d) keys after position encoding; H is a multiple of H_kv (grouped KV heads).
        scaling: factor on q·k.
        mask: None, or broadcastable to (B, H, n_q, n_k): bool (True = may attend) or additive float
            (large negative = masked; ALiBi-style biases included).
        causal: query i sees keys j ≤ i only (the kernel's ``is_causal``, when no mask tensor carries it).
        window: a sliding window: query i sees keys j > i − window only (flash's ``sliding_window``).
        softcap: logits become softcap·tanh(logits / softcap) before the mask (Gemma 2).
        sinks: (H,) per-head sink logits that join the softmax's denominator only (attention sinks).
        bias: additive position bias broadcastable to (B, H, n_q, n_k), added after softcapping.
        v: (B, H_kv, n_k, d_v) values (gradient rules only).
        grad_out: (B, H, n_q, d_v) gradient of the target with respect to the kernel's output (gradient
            rules only): dy/dA_ij = grad_out_i · v_j.
        is_causal_model: the attention module declares itself causal (a decoder), whatever the kernel did.
        lse: (B, H, n_q) float32 natural log-sum-exp of each query row's logits as the kernel itself returned
            it (fused kernels compute it anyway), or None; checked against a recomputation before use.
    """

    q: torch.Tensor
    k: torch.Tensor
    scaling: float
    mask: torch.Tensor | None = None
    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    v: torch.Tensor | None = None
    grad_out: torch.Tensor | None = None
    is_causal_model: bool = False
    lse: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, n_q, n_k): the shape of the attention this layer never materialises."""
        B, H, nq, _ = self.q.shape
        return B, H, nq, self.k.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.q.device

    def block_rows(self, budget: int = BLOCK_ELEMENTS) -> int:
        """Query rows per block so that one (B, H, rows, n_k) block holds about ``budget`` elements."""
        B, H, _, nk = self.shape
        return max(16, budget // max(1, B * H * nk))


# ----------------------------------------------------------------------------------------- probabilities
def _mask_block(mask: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    rows = slice(q0, q1) if mask.shape[-2] > 1 else slice(None)
    cols = slice(k0, k1) if mask.shape[-1] > 1 else slice(None)
    return mask[..., rows, cols]


def _allowed(m: torch.Tensor) -> torch.Tensor:
    """Bool of the entries a mask block lets through (additive masks: above half the dtype's minimum)."""
    if m.dtype == torch.bool:
        return m
    return m > torch.finfo(m.dtype).min / 2


def key_range(layer: KernelInputs, q0: int, q1: int) -> tuple[int, int]:
    """[k0, k1): the keys that any query of [q0, q1) may attend to; outside it every probability is 0."""
    nk = layer.k.shape[-2]
    k1 = min(nk, q1) if layer.causal else nk
    k0 = max(0, q0 - layer.window + 1) if layer.window is not None else 0
    if layer.mask is None or k1 <= k0:
        return k0, max(k0, k1)
    m = _mask_block(layer.mask, q0, q1, k0, k1)
    cols = _allowed(m).reshape(-1, m.shape[-1]).any(dim=0)
    if cols.numel() == 1:  # broadcast over keys
        return (k0, k1) if bool(cols) else (0, 0)
    idx = cols.nonzero()
    if idx.numel() == 0:
        return 0, 0
    return k0 + int(idx[0]), k0 + int(idx[-1]) + 1


def _structural_mask(layer: KernelInputs, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
    """Mask causal / sliding-window entries of the logits block ``s`` in place with −inf. Only the columns
    where the rule can bite are touched: j > q0 (causal), j ≤ q1 − 1 − window (window)."""
    dev = s.device
    qi = torch.arange(q0, q1, device=dev)[:, None]
    if layer.causal and k1 > q0 + 1:
        c0 = max(k0, q0 + 1)
        kj = torch.arange(c0, k1, device=dev)[None, :]
        s[..., c0 - k0 :].masked_fill_(kj > qi, float("-inf"))
    if layer.window is not None and k0 < q1 - layer.window:
        c1 = min(k1, q1 - layer.window)
        kj = torch.arange(k0, c1, device=dev)[None, :]
        s[..., : c1 - k0].masked_fill_(kj <= qi - layer.window, float("-inf"))


def logits_block(layer: KernelInputs, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """(B, H, rows, keys) float32 attention logits of queries [q0, q1) on keys [k0, k1), masked with −inf.

    Each key/value head is multiplied with its whole group of query heads at once (no repeated keys)."""
    B, H, _, d = layer.q.shape
    Hkv = layer.k.shape[1]
    rows = q1 - q0
    q = (layer.q[:, :, q0:q1].to(torch.float32) * layer.scaling).reshape(B, Hkv, (H // Hkv) * rows, d)
    k = layer.k[:, :, k0:k1].to(torch.float32)
    s = (q @ k.transpose(-1, -2)).view(B, H, rows, k1 - k0)
    if layer.softcap is not None:
        s = torch.tanh(s.div_(layer.softcap)).mul_(layer.softcap)
    if layer.bias is not None:
        s = s + _mask_block(layer.bias, q0, q1, k0, k1).to(torch.float32)
    if layer.mask is not None:
        m = _mask_block(layer.mask, q0, q1, k0, k1)
        if m.dtype == torch.bool:
            s = s.masked_fill(~m, float("-inf"))
        else:
            s = s + m.to(torch.float32)
    _structural_mask(layer, s, q0, q1, k0, k1)
    return s


def probs_block(layer: KernelInputs, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """(B, H, rows, keys) float32 softmax probabilities; [k0, k1) must cover every key the rows may see
    (``key_range``). Fully masked rows give 0 (they belong to padding); sinks join the denominator."""
    s = logits_block(layer, q0, q1, k0, k1)
    if layer.sinks is None:
        p = torch.softmax(s, dim=-1)
        return p.nan_to_num_(0.0) if layer.mask is not None else p
    sink = layer.sinks.to(torch.float32).reshape(1, -1, 1, 1)
    top = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=s.dtype, device=s.device))
    p = torch.exp(s - top)
    z = p.sum(dim=-1, keepdim=True) + torch.exp(sink - top)
    return p / z


# ------------------------------------------------------------------------------------- row log-sum-exp
def _lse_rows(layer: KernelInputs, q0: int, q1: int) -> torch.Tensor:
    """(B, H, q1 − q0) float32 log-sum-exp of the logits of queries [q0, q1), sinks included."""
    B, H = layer.shape[:2]
    k0, k1 = key_range(layer, q0, q1)
    if k1 <= k0:
        out = torch.full((B, H, q1 - q0), float("-inf"), device=layer.q.device)
    else:
        out = torch.logsumexp(logits_block(layer, q0, q1, k0, k1), dim=-1)
    if layer.sinks is not None:
        out = torch.logaddexp(out, layer.sinks.to(torch.float32).reshape(1, -1, 1))
    return out


def _lse_agrees(layer: KernelInputs, lse: torch.Tensor) -> bool:
    """Whether a kernel's log-sum-exp has the layer's shape and matches a recomputation at the first, middle
    and last query (a kernel that saw other logits than those recorded, e.g. another causality, differs).
    Only for layers whose logits are q·k scaled (masks, biases and softcapping: the caller recomputes)."""
    B, H, nq, d = layer.q.shape
    if tuple(lse.shape) != (B, H, nq):
        return False
    # The first example suffices: without a mask tensor every example's logits follow the same rules.
    rows = torch.tensor(sorted({0, nq // 2, nq - 1}), device=layer.q.device)
    q = layer.q[:1, :, rows].to(torch.float32).reshape(1, layer.k.shape[1], -1, d)
    s = (q @ layer.k[:1].to(torch.float32).transpose(-1, -2)).view(1, H, len(rows), -1) * layer.scaling
    j = torch.arange(s.shape[-1], device=s.device)
    allowed = torch.ones(len(rows), s.shape[-1], dtype=torch.bool, device=s.device)
    if layer.causal:
        allowed &= j[None, :] <= rows[:, None]
    if layer.window is not None:
        allowed &= j[None, :] > rows[:, None] - layer.window
    ref = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), dim=-1)
    if layer.sinks is not None:
        ref = torch.logaddexp(ref, layer.sinks.to(torch.float32).reshape(1, -1, 1))
    got = lse[:1, :, rows].to(torch.float32)
    return bool(torch.isfinite(got).all()) and torch.allclose(got, ref, atol=1e-4, rtol=1e-5)


def row_lse(layer: KernelInputs) -> torch.Tensor:
    """(B, H, n_q) float32 log-sum-exp of every query row's logits (sinks included; −inf where a row may see
    no key): the kernel's own (``layer.lse``) when the logits are q·k scaled (no mask tensor, bias or
    softcapping) and it agrees with a recomputation, else recomputed blockwise."""
    plain = layer.mask is None and layer.bias is None and layer.softcap is None
    if layer.lse is not None and plain and _lse_agrees(layer, layer.lse):
        return layer.lse.to(torch.float32)
    nq, rows = layer.shape[2], layer.block_rows()
    return torch.cat([_lse_rows(layer, q0, min(nq, q0 + rows)) for q0 in range(0, nq, rows)], dim=-1)


# ------------------------------------------------------------------------------------------ block rules
BlockRule = Callable[[KernelInputs, int, int, int, int], torch.Tensor]


def fused_probs(how: Any) -> BlockRule:
    """Block rule: head-fused probabilities fuse_h(A) (B, rows, keys); ``how`` as ``fuse_heads``."""

    def rule(layer: KernelInputs, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        return fusion.fuse_tensor(probs_block(layer, q0, q1, k0, k1), how)

    # rows of softmax probabilities: rollout checks sums
    rule.stochastic = True  # type: ignore[attr-defined]
    # the fusion, read by the layers that join attention and a mixer (core.joined)
    rule.how = how  # type: ignore[attr-defined]
    if isinstance(how, str) and how == "mean":
        # r·mean_h(A) = mean_h(r·A): see apply_layer
        rule.heads = probs_block  # type: ignore[attr-defined]
    return rule


def weighted_probs(clamp: str = "per_head") -> BlockRule:
    """Block rule: mean_h((dy/dA ⊙ A)^+) with dy/dA_ij = dO_i·V_j ("per_head"), or (mean_h(dy/dA ⊙ A))^+
    ("after_mean"); needs ``v`` and ``grad_out``."""

    def rule(layer: KernelInputs, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        a = probs_block(layer, q0, q1, k0, k1)
        if layer.v is None or layer.grad_out is None:
            raise ValueError("weighted_probs needs the kernel's v and grad_out (a gradient capture)")
        B, H = a.shape[:2]
        Hkv = layer.v.shape[1]
        go = layer.grad_out[:, :, q0:q1].to(torch.float32).reshape(B, Hkv, H // Hkv, q1 - q0, -1)
        v = layer.v[:, :, k0:k1].to(torch.float32).unsqueeze(2)
        grad = (go @ v.transpose(-1, -2)).reshape(a.shape)
        prod = grad.mul_(a)
        return prod.clamp_(min=0).mean(dim=1) if clamp == "per_head" else prod.mean(dim=1).clamp_(min=0)

    return rule


# ------------------------------------------------------------------------------------------ the operator
def apply_layer(
    r: torch.Tensor,
    layer: KernelInputs,
    rule: BlockRule,
    *,
    a: float,
    c: float,
    renorm: bool = False,
    mask: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """r · Ã for relevance rows r (B, R, n) -> (B, R, n), Ã = diag(1/s)·(a·P + c·I) built block by block.

    P is ``rule``'s (B, rows, keys) block; with a padding ``mask`` (B, n) bool, P is restricted to real
    tokens (padded rows and columns 0, real rows rescaled to their previous sum, as ``rollout`` drops
    padding) and the identity sits on real tokens only; ``renorm`` divides each row by its sum
    s_i = a·Σ_j P_ij + c·[i real] (a zero sum gives a zero row). Blocks whose rows carry no relevance are
    skipped. A :class:`FusedLayer` (probabilities fused during the forward) is applied as one product.
    """
    if hasattr(layer, "apply_joined"):  # attention and a token mixer joined in one layer (core.joined.JoinedRows)
        return layer.apply_joined(r, rule, a=a, c=c, renorm=renorm, mask=mask)
    if hasattr(layer, "apply_rows"):  # a token mixer other than attention (core.mixers.SSDRows)
        return layer.apply_rows(r, a=a, c=c, renorm=renorm, mask=mask)
    B, H, nq, nk = layer.shape
    if r.shape[-1] != nq:
        raise ValueError(f"relevance rows have {r.shape[-1]} entries, the layer has {nq} queries")
    if isinstance(layer, FusedLayer):
        return apply_fused(r, layer, a=a, c=c, renorm=renorm, mask=mask)
    if block is None and whole_applies(layer, rule, r, mask, renorm):
        return apply_layer_whole(r, layer, a=a, c=c)
    if tiled_applies(layer, rule, r, mask, renorm):
        return apply_layer_tiled(r, layer, a=a, c=c, rows=block)
    rows_per = block or layer.block_rows()
    out = torch.zeros(B, r.shape[1], nk, dtype=r.dtype, device=r.device)
    live = r.abs().amax(dim=(0, 1)) > 0  # (n,) queries with any relevance
    for b0 in range(0, nq, rows_per):
        hit = live[b0 : b0 + rows_per].nonzero()
        if hit.numel() == 0:
            continue
        # Only the rows that carry relevance: the top layer of a sweep starts from one row per example.
        q0, q1 = b0 + int(hit[0]), b0 + int(hit[-1]) + 1
        k0, k1 = key_range(layer, q0, q1)
        rb = r[..., q0:q1]
        ident = torch.full((B, q1 - q0), c, dtype=r.dtype, device=r.device)
        if mask is not None:
            ident = ident * mask[:, q0:q1]
        if k1 > k0 and mask is None and not renorm and hasattr(rule, "heads"):
            # One product over (head, row) pairs instead of forming the head mean first: one pass less.
            A = rule.heads(layer, q0, q1, k0, k1).to(r.dtype)
            u = rb.unsqueeze(2).expand(B, r.shape[1], H, q1 - q0).reshape(B, r.shape[1], -1)
            out[..., k0:k1] += (a / H) * (u @ A.view(B, -1, k1 - k0))
        elif k1 > k0:
            P = rule(layer, q0, q1, k0, k1).to(r.dtype)
            if mask is not None:
                P = _restrict(P, mask[:, q0:q1], mask[:, k0:k1])
            if renorm:
                s = a * P.sum(dim=-1) + ident
                rb = _divide(rb, s)
                ident = _divide(ident, s)
            out[..., k0:k1] += a * (rb @ P)
        elif renorm:
            ident = _divide(ident, ident)
        lo, hi = max(q0, 0), min(q1, nk)  # identity: query i -> key i (self-attention)
        out[..., lo:hi] += r[..., lo:hi] * ident[:, None, : hi - lo]
    return out


# ------------------------------------------------------------------------------------ the tiled fast path
#: Elements of one logits tile of the fast path (B·H·rows·keys): 256 Ki float32 = 1 MiB, so that the
#: product, the exponentiation and the row product run on a tile that stays in the core's cache.
TILE_ELEMENTS = 1 << 18
#: Keys per tile of the fast path.
TILE_KEYS = 256
LOG2E = 1.4426950408889634


def tiled_applies(layer: KernelInputs, rule: BlockRule, r: torch.Tensor, mask: Any, renorm: bool) -> bool:
    """Whether ``apply_layer_tiled`` computes this product: head-mean probabilities of a layer whose logits
    are q·k scaled and nothing else (causal and window rules and sinks allowed), float32 rows, no padding
    mask or renorm (those need each block's row sums)."""
    return (getattr(rule, "heads", None) is not None and mask is None and not renorm and r.dtype == torch.float32
            and layer.mask is None and layer.softcap is None and layer.bias is None)


def _augmented(layer: KernelInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """q̃ (B·H, n_q, d+1) and k̃ᵀ (B·H, d+1, n_k) with q̃_i·k̃_j = log2(P_ij) per head: the row's
    log-sum-exp folds into the product as one more coordinate, and base 2 because exp2 is cheaper than exp.
    Grouped key heads are repeated for their query heads (O(n·d) memory, like q itself)."""
    B, H, nq, d = layer.q.shape
    Hkv, nk = layer.k.shape[1], layer.k.shape[2]
    dev = layer.q.device
    lse = row_lse(layer)
    qa = torch.empty(B, H, nq, d + 1, dtype=torch.float32, device=dev)
    torch.mul(layer.q, layer.scaling * LOG2E, out=qa[..., :d])
    # A row that may see no key (−inf) gets −inf logits: probability 0, not inf.
    qa[..., d] = torch.where(torch.isfinite(lse), lse * -LOG2E, torch.full((), float("-inf"), device=dev))
    ka = torch.empty(B, Hkv, nk, d + 1, dtype=torch.float32, device=dev)
    ka[..., :d] = layer.k
    ka[..., d] = 1.0
    if Hkv != H:
        ka = ka.repeat_interleave(H // Hkv, dim=1)
    return qa.view(B * H, nq, d + 1), ka.view(B * H, nk, d + 1).transpose(1, 2)


def _live_blocks(layer: KernelInputs, r: torch.Tensor, rows: int) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) for each block of ``rows`` queries that carries relevance, trimmed to its live rows,
    with the keys its rows may see (``key_range``)."""
    live = (r.abs().amax(dim=(0, 1)) > 0).cpu()  # one transfer, not one per block, on an accelerator
    out = []
    for b0 in range(0, layer.shape[2], rows):
        hit = live[b0 : b0 + rows].nonzero()
        if hit.numel():
            q0, q1 = b0 + int(hit[0]), b0 + int(hit[-1]) + 1
            k0, k1 = key_range(layer, q0, q1)
            if k1 > k0:
                out.append((q0, q1, k0, k1))
    return out


def apply_layer_tiled(r: torch.Tensor, layer: KernelInputs, *, a: float, c: float,
                      rows: int | None = None, keys: int | None = None) -> torch.Tensor:
    """r · (a·mean_h(A_h) + c·I) for rows r (B, R, n) float32 -> (B, R, n), without normalising any block.

    P_ij = exp2(q̃_i·k̃_j) (``_augmented``) is computed one tile of (keys x rows), every head at once, at a
    time: one product, masking on the tiles the causal / window rule cuts, one exponentiation in place and
    one batched product with the rows (per head, summed over heads once per key tile); nothing of a tile
    outlives it. Keys are the outer loop, so a key tile stays in cache while the query blocks pass; blocks
    whose rows carry no relevance and keys outside ``key_range`` are skipped."""
    B, H, nq, nk = layer.shape
    R = r.shape[1]
    Tk = keys or min(nk, TILE_KEYS)
    Tq = rows or max(128, TILE_ELEMENTS // max(1, B * H * Tk))  # fewer rows: the products lose efficiency
    out = torch.zeros(B, R, nk, dtype=r.dtype, device=r.device)
    m = min(nq, nk)  # identity: query i -> key i (self-attention)
    out[..., :m] += c * r[..., :m]
    blocks = _live_blocks(layer, r, Tq)
    if not blocks:
        return out
    qa, ka = _augmented(layer)
    U = (r * (a / H)).unsqueeze(1).expand(B, H, R, nq).reshape(B * H, R, nq)
    buf = torch.empty(B * H * Tq * Tk, dtype=torch.float32, device=r.device)
    acc = torch.empty(B * H * R * Tk, dtype=torch.float32, device=r.device)
    lo, hi = min(b[2] for b in blocks), max(b[3] for b in blocks)
    for t0 in range(lo, hi, Tk):
        t1 = min(hi, t0 + Tk)
        part = acc[: B * H * R * (t1 - t0)].view(B * H, R, t1 - t0).zero_()
        for q0, q1, k0, k1 in blocks:
            if k1 <= t0 or k0 >= t1:
                continue
            s = buf[: B * H * (q1 - q0) * (t1 - t0)].view(B * H, q1 - q0, t1 - t0)
            torch.bmm(qa[:, q0:q1], ka[..., t0:t1], out=s)
            _structural_mask(layer, s.view(B, H, q1 - q0, t1 - t0), q0, q1, t0, t1)
            part.baddbmm_(U[..., q0:q1], s.exp2_())
        out[..., t0:t1] += part.view(B, H, R, t1 - t0).sum(dim=1)
    return out


# ------------------------------------------------------------------------------------- the small-n path
#: Logits elements of one example's layer (H·n_q·n_k) up to which the layer is recomputed whole, a few
#: examples at a time, in about a dozen torch calls per chunk (``apply_layer_whole``), rather than tile by
#: tile: at small n the tiles' per-call costs and the log-sum-exp check cost more than the arithmetic.
#: 2 Mi float32 = 8 MiB: n ≤ 418 at 12 heads. The kernel wrapper keeps no log-sum-exp for such layers.
WHOLE_ELEMENTS = 1 << 21
#: Logits elements (B'·H·rows·n_k) of one chunk of examples on the small-n path: 1 Mi float32 = 4 MiB, so
#: that exponentiation, row sums and the row product pass over a chunk still in (L2 / L3) cache.
CHUNK_ELEMENTS = 1 << 20


def whole_size(layer: KernelInputs) -> bool:
    """Whether one example's logits of ``layer`` (H·n_q·n_k) fit ``WHOLE_ELEMENTS``."""
    _, H, nq, nk = layer.shape
    return H * nq * nk <= WHOLE_ELEMENTS


def whole_applies(layer: KernelInputs, rule: BlockRule, r: torch.Tensor, mask: Any, renorm: bool) -> bool:
    """Whether ``apply_layer_whole`` computes this product: what ``tiled_applies`` takes, without sinks, for
    self-attention (n_q = n_k) of at most ``WHOLE_ELEMENTS`` logits per example."""
    return (tiled_applies(layer, rule, r, mask, renorm) and layer.sinks is None and layer.shape[2] == layer.shape[3]
            and whole_size(layer))


def _live_rows(r: torch.Tensor) -> torch.Tensor | None:
    """Indices of the queries whose relevance is non-zero in some example and row, or None when all are."""
    hit = r.reshape(-1, r.shape[-1]).any(dim=0).nonzero()[:, 0]
    return None if hit.numel() == r.shape[-1] else hit


def _structural_allowed(layer: KernelInputs, rows: torch.Tensor, nk: int) -> torch.Tensor:
    """(len(rows), n_k) bool: the keys each of the query ``rows`` may see under the causal / window rule."""
    qi, kj = rows[:, None], torch.arange(nk, device=rows.device)[None, :]
    ok = kj <= qi if layer.causal else torch.ones(len(rows), nk, dtype=torch.bool, device=rows.device)
    return ok & (kj > qi - layer.window) if layer.window is not None else ok


def apply_layer_whole(r: torch.Tensor, layer: KernelInputs, *, a: float, c: float) -> torch.Tensor:
    """r · (a·mean_h(A_h) + c·I) for rows r (B, R, n) float32 -> (B, R, n), the probabilities of every live
    query row (the rows of r that carry relevance) computed at once for a chunk of examples, every head:
    one product, the causal / window rule, the row max subtracted, one exp2, the row sums, and one product
    with the rows divided by their head count and row sums (the softmax's division moved onto r: O(n), not
    O(n²)). Exactly an eager softmax; no log-sum-exp of the kernel is used. Memory: one chunk's logits."""
    B, H, nq, nk = layer.shape
    out = r * c
    live = _live_rows(r)
    if a == 0 or (live is not None and live.numel() == 0):
        return out
    q = layer.q if live is None else layer.q.index_select(2, live)
    rl = r if live is None else r.index_select(2, live)
    allowed = None
    if layer.causal or layer.window is not None:
        allowed = ~_structural_allowed(layer, torch.arange(nq, device=r.device) if live is None else live, nk)
    chunks = -(-B * H * q.shape[2] * nk // CHUNK_ELEMENTS)  # ceil: chunks of even size
    step = -(-B // chunks)
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        out[b0:b1].baddbmm_(*_whole_chunk(rl[b0:b1], q[b0:b1], layer.k[b0:b1], layer.scaling, allowed, a))
    return out


#: Largest scratch (float32 elements) that the small-n path keeps per thread on CPU (``_scratch``): 16 MiB.
SCRATCH_ELEMENTS = 1 << 22
_SCRATCH = threading.local()


def _scratch(numel: int, device: torch.device) -> torch.Tensor | None:
    """A float32 CPU buffer of ``numel`` elements, the same one for every small-n layer of this thread, or
    None (an accelerator, or more than ``SCRATCH_ELEMENTS``): a fresh temporary of a few MiB per layer costs
    more in page faults than its arithmetic, since the C allocator gives it back to the system when it is
    freed and the next one faults its pages in again. Valid until the next call (not reentrant)."""
    if device.type != "cpu" or numel > SCRATCH_ELEMENTS:
        return None
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


#: Largest total (float32 elements) of the fused matrices that one thread's ``kept_buffers`` arena holds on to
#: between calls: 16 MiB (beyond it a fused matrix is a fresh tensor, as outside the arena).
ARENA_ELEMENTS = 1 << 22


class _Arena(threading.local):
    """One thread's buffers for the (B, n, n) matrices a capture keeps (``kept_buffers``)."""

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor] = []
        self.used = 0
        self.active = False


_ARENA = _Arena()


@contextmanager
def kept_buffers() -> Iterator[None]:
    """While active, the fused matrices that ``mean_probs`` / ``attend_mean`` return on CPU live in buffers
    this thread reuses from one call to the next (the k-th matrix of the call in the k-th buffer), instead of
    fresh tensors. Why: matrices that outlive the forward sit above the model's freed activations in the C
    heap, so that freeing them after the call lets the allocator give the heap's top back to the system and
    the next forward faults its activations in again (~1,000 page faults per call at B = 32, n = 65). The
    matrices are valid until the next ``kept_buffers`` of this thread: use them (the row product) inside it
    and keep nothing that aliases them. A nested one goes on with the outer one's buffers."""
    ar = _ARENA
    if ar.active:
        yield
        return
    ar.active, ar.used = True, 0
    try:
        yield
    finally:
        ar.active = False


def _kept(B: int, n: int, device: torch.device) -> torch.Tensor:
    """An uninitialised (B, n, n) float32 tensor for a fused matrix: from the thread's arena while
    ``kept_buffers`` is active (CPU, within ``ARENA_ELEMENTS``), else fresh."""
    ar = _ARENA
    numel = B * n * n
    if not ar.active or device.type != "cpu":
        return torch.empty(B, n, n, dtype=torch.float32, device=device)
    i = ar.used
    if i < len(ar.bufs) and ar.bufs[i].numel() >= numel:
        buf = ar.bufs[i]
    else:
        held = sum(b.numel() for k, b in enumerate(ar.bufs) if k != i)
        if held + numel > ARENA_ELEMENTS:
            return torch.empty(B, n, n, dtype=torch.float32, device=device)
        buf = torch.empty(numel, dtype=torch.float32)
        ar.bufs[i:i + 1] = [buf]
    ar.used += 1
    return buf[:numel].view(B, n, n)


#: Row sums of unshifted exponentials accepted by ``_exp_rows`` (outside them it shifts by the row max).
_SUM_RANGE = (2.0 ** -60, float("inf"))


#: Multiply-adds of one example's logits (H·m·n_k·d) from which ``_logits2`` multiplies example by example:
#: the kernel's q and k are views of (B, n, H, d) buffers, which one batched product over (B·H) would first
#: copy (measured: 2 of 12 ms per ViT-B layer at B = 8), while each example alone is a view.
PER_EXAMPLE_MACS = 1 << 22


def _logits2(q: torch.Tensor, k: torch.Tensor, scaling: float, disallowed: Any) -> torch.Tensor:
    """(B', H, m, n_k) float32 logits in base 2, log2(e)·scaling·q·kᵀ (the scale applied inside the product),
    −inf where ``disallowed``; in the thread's scratch on CPU (``_scratch``)."""
    B, H, m, d = q.shape
    Hkv, nk = k.shape[1], k.shape[2]
    G = H // Hkv
    # (dtype checks first: at small n each torch call, even a no-op conversion, costs as much as arithmetic)
    q = q if q.dtype == torch.float32 else q.to(torch.float32)
    k = k if k.dtype == torch.float32 else k.to(torch.float32)
    work = _scratch(B * H * m * nk, q.device)
    s = torch.empty(B * H * m * nk, dtype=torch.float32, device=q.device) if work is None else work
    alpha = scaling * LOG2E
    if B > 1 and H * m * nk * d >= PER_EXAMPLE_MACS:
        s4 = s.view(B, Hkv, G * m, nk)
        for b in range(B):
            s4[b].baddbmm_(q[b].reshape(Hkv, G * m, d), k[b].transpose(1, 2), beta=0, alpha=alpha)
    else:
        s.view(B * Hkv, G * m, nk).baddbmm_(q.reshape(B * Hkv, G * m, d), k.reshape(B * Hkv, nk, d).transpose(1, 2),
                                            beta=0, alpha=alpha)
    s = s.view(B, H, m, nk)
    if disallowed is not None:
        s.masked_fill_(disallowed, float("-inf"))
    return s


def _exp_rows(q: torch.Tensor, k: torch.Tensor, scaling: float, disallowed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(E (B', H, m, n_k), 1/z (B', H, m)): the exponentiated logits of the m queries q (B', H, m, d) on the keys
    k (B', H_kv, n_k, d) (base 2: exp2 is cheaper than exp) and their reciprocal row sums z, so that E / z are
    the softmax rows; ``disallowed`` (m, n_k) bool marks the causal / window rule's entries (probability 0).
    E may live in the thread's scratch (``_scratch``): use it before the next call.

    On CPU the logits are exponentiated as they are, without the row max: the same softmax whenever every
    row sum lies within ``_SUM_RANGE`` (no exponential overflows, and the largest ones stay normal floats, so
    that terms lost to underflow weigh < 2⁻⁵⁸ of a row); otherwise, and on accelerators (where the check
    would wait for the device), each row is shifted by its max first (every row sees its own key: finite)."""
    s = _logits2(q, k, scaling, disallowed)
    if s.device.type == "cpu":
        z = s.exp2_().sum(dim=-1)
        lo, hi = torch.aminmax(z)
        if float(lo) >= _SUM_RANGE[0] and float(hi) < _SUM_RANGE[1]:
            return s, z.reciprocal_()
        s = _logits2(q, k, scaling, disallowed)  # the exponentials replaced the logits: compute them again
    s.sub_(s.amax(dim=-1, keepdim=True)).exp2_()
    return s, s.sum(dim=-1).reciprocal_()


def _whole_chunk(r: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scaling: float, disallowed: Any,
                 a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(U (B', R, H·m), P (B', H·m, n_k)) with U @ P = a · r · mean_h(softmax rows) for one chunk: r (B', R, m)
    rows at the m queries q (B', H, m, d), keys k (B', H_kv, n_k, d). (A shift by an upper bound of each row's
    logits from the norms, instead of the row max, measured slower: baddbmm with a broadcast input.)"""
    B, H, m, _ = q.shape
    s, w = _exp_rows(q, k, scaling, disallowed)
    w.mul_(a / H)  # (B', H, m)
    U = (r[:, :, None, :] * w[:, None]).view(B, r.shape[1], H * m)
    return U, s.view(B, H * m, k.shape[2])


# ------------------------------------------------------------------ small layers fused during the forward
@dataclass
class FusedLayer:
    """A small layer reduced, while the model runs, to its head-mean probabilities (``mean_probs``): what
    ``apply_layer_whole`` recomputes for every row of a layer below the top one, computed once while its
    queries and keys are fresh, so that the record keeps (B, n, n) instead of q and k.

    Attributes:
        probs: (B, n, n) float32 mean_h softmax(scaling·q_h·k_hᵀ), the causal / window rule applied.
        heads: H, the number of query heads fused.
        is_causal_model: as in :class:`KernelInputs`.
    """

    probs: torch.Tensor
    heads: int
    is_causal_model: bool = False
    sinks = None  # the attributes of KernelInputs that the row methods' checks read
    mask = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, n, n), as ``KernelInputs.shape``."""
        B, nq, nk = self.probs.shape
        return B, self.heads, nq, nk

    @property
    def device(self) -> torch.device:
        return self.probs.device


def fusable(layer: KernelInputs) -> bool:
    """Whether ``mean_probs`` may stand in for ``layer``: logits q·k scaled under the causal / window rule or
    none (no mask tensor, bias, softcapping or sinks), self-attention within ``WHOLE_ELEMENTS``, and a
    (B, n, n) matrix no larger than the q and k it replaces (n ≤ d·(H + H_kv))."""
    _, H, nq, nk = layer.shape
    plain = layer.mask is None and layer.bias is None and layer.softcap is None and layer.sinks is None
    return plain and nq == nk and whole_size(layer) and nk <= layer.q.shape[-1] * (H + layer.k.shape[1])


def mean_probs(layer: KernelInputs) -> FusedLayer:
    """The layer's head-mean softmax probabilities (B, n, n), computed as ``apply_layer_whole`` does (one
    product, the row max, one exp2, the row sums), a chunk of examples (``CHUNK_ELEMENTS`` logits) at a time;
    ``layer`` must be ``fusable``. The matrix is one of ``kept_buffers``' while one is active (``_kept``)."""
    B, H, n, _ = layer.shape
    out = _kept(B, n, layer.q.device)
    disallowed = _disallowed(layer)
    for b0, b1, whole in _example_chunks(layer):
        q, k = (layer.q, layer.k) if whole else (layer.q[b0:b1], layer.k[b0:b1])
        s, w = _exp_rows(q, k, layer.scaling, disallowed)
        torch.sum(s.mul_(w.mul_(1.0 / H).unsqueeze_(-1)), dim=1, out=out if whole else out[b0:b1])
    return FusedLayer(out, H, layer.is_causal_model)


def _disallowed(layer: KernelInputs) -> torch.Tensor | None:
    """(n, n) bool, True where the causal / window rule gives probability 0; None without a rule."""
    if not (layer.causal or layer.window is not None):
        return None
    n = layer.shape[2]
    return ~_structural_allowed(layer, torch.arange(n, device=layer.q.device), n)


def _example_chunks(layer: KernelInputs) -> list[tuple[int, int, bool]]:
    """(b0, b1, whether the chunk is the whole batch): chunks of examples of even size whose logits fit
    ``CHUNK_ELEMENTS`` (at least one example each)."""
    B, H, nq, nk = layer.shape
    step = -(-B // -(-B * H * nq * nk // CHUNK_ELEMENTS))
    return [(b0, min(B, b0 + step), b0 == 0 and step >= B) for b0 in range(0, B, step)]


def attend_mean(layer: KernelInputs, v: torch.Tensor) -> tuple[torch.Tensor, FusedLayer]:
    """The attention of a ``fusable`` layer computed once for both what the model needs and what rollout
    needs: (its output softmax(scaling·q·kᵀ)·v as (B, n, H, d_v), contiguous — the layout transformers'
    kernels return — and the head-mean probabilities as ``mean_probs`` gives them). ``v`` (B, H_kv, n, d_v)
    the values (grouped heads as for k). The probabilities are the softmax of ``_exp_rows`` (row sums
    checked, max-shifted when out of range), normalised before the product with v: an eager softmax
    attention, to float32 rounding the output of any exact kernel. (Measured in the model and slower at one
    and two threads: the packed q / k / v and the product in per-thread scratch, the product per head on the
    strided v, 1/H folded into the row weights, the row sums from a product with [v | 1], a numba kernel per
    (example, head) row by row in L1; docs/research/batch-engine.md.)"""
    B, H, n, _ = layer.shape
    Hkv, dv = layer.k.shape[1], v.shape[-1]
    G = H // Hkv
    v = v if v.dtype == torch.float32 else v.to(torch.float32)
    out = torch.empty(B, n, H, dv, dtype=torch.float32, device=layer.q.device)
    probs = _kept(B, n, layer.q.device)
    disallowed = _disallowed(layer)
    for b0, b1, whole in _example_chunks(layer):
        q, k, vb = (layer.q, layer.k, v) if whole else (layer.q[b0:b1], layer.k[b0:b1], v[b0:b1])
        s, w = _exp_rows(q, k, layer.scaling, disallowed)
        p = s.mul_(w.unsqueeze_(-1))  # (b, H, n, n) softmax rows, in place
        o = torch.bmm(p.view((b1 - b0) * Hkv, G * n, n), vb.reshape((b1 - b0) * Hkv, n, dv))
        (out if whole else out[b0:b1]).copy_(o.view(b1 - b0, H, n, dv).transpose(1, 2))
        torch.sum(p, dim=1, out=probs if whole else probs[b0:b1]).mul_(1.0 / H)
    return out, FusedLayer(probs, H, layer.is_causal_model)


def apply_fused(r: torch.Tensor, layer: FusedLayer, *, a: float, c: float, renorm: bool = False,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """r · Ã for rows r (B, R, n) -> (B, R, n) with P = ``layer.probs``, as ``apply_layer`` defines Ã (padding
    ``mask`` (B, n) bool and ``renorm`` included)."""
    P = layer.probs if layer.probs.dtype == r.dtype else layer.probs.to(r.dtype)
    if mask is None and not renorm:
        return torch.baddbmm(r, r, P, beta=c, alpha=a)
    ident = torch.full((r.shape[0], r.shape[-1]), c, dtype=r.dtype, device=r.device)
    rb = r
    if mask is not None:
        ident = ident * mask
        P = _restrict(P, mask, mask)
    if renorm:
        s = a * P.sum(dim=-1) + ident
        rb, ident = _divide(r, s), _divide(ident, s)
    return a * (rb @ P) + r * ident[:, None, :]


def _restrict(P: torch.Tensor, row_ok: torch.Tensor, col_ok: torch.Tensor) -> torch.Tensor:
    """Padding dropped from a block: padded rows and columns zeroed, real rows rescaled to their sum."""
    before = P.sum(dim=-1, keepdim=True) * row_ok[..., None]
    kept = P * (row_ok[..., :, None] & col_ok[..., None, :])
    after = kept.sum(dim=-1, keepdim=True)
    scale = torch.where(after > 0, before / torch.where(after > 0, after, torch.ones_like(after)), after)
    return kept * scale


def _divide(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x (B, [R,] rows) divided by row sums s (B, rows) over the rows axis; zero sums give 0."""
    s = s if x.ndim == s.ndim else s[:, None, :]
    ok = s > 0
    return torch.where(ok, x / torch.where(ok, s, torch.ones_like(s)), torch.zeros((), dtype=x.dtype, device=x.device))


def rollout_rows(
    layers: list[KernelInputs],
    rows: torch.Tensor,
    rule: BlockRule,
    *,
    a: float,
    c: float,
    renorm: bool = False,
    mask: torch.Tensor | None = None,
    start: int = 0,
    end: int | None = None,
    return_layers: bool = False,
) -> torch.Tensor:
    """Rows of Ã(end−1)···Ã(start), right to left: ``rows`` (B, R, n) start vectors (one-hot output
    rows) -> (B, R, n). ``return_layers``: (end − start, B, R, n), entry k the rows of Ã(start+k)···Ã(start)
    (one right-to-left sweep per prefix: O(L²) layer applications)."""
    end = len(layers) if end is None else end
    if mask is not None:
        rows = rows * mask[:, None, :].to(rows.dtype)

    def sweep(top: int) -> torch.Tensor:
        v = rows
        for i in range(top - 1, start - 1, -1):
            v = apply_layer(v, layers[i], rule, a=a, c=c, renorm=renorm, mask=mask)
        return v

    if not return_layers:
        return sweep(end)
    return torch.stack([sweep(k) for k in range(start + 1, end + 1)])


def attention_rows(layer: KernelInputs, rows: list[int]) -> torch.Tensor:
    """(B, H, len(rows), n_k): the attention rows of the queries ``rows``, every example and head."""
    nk = layer.shape[3]
    return torch.stack([probs_block(layer, p, p + 1, 0, nk)[:, :, 0] for p in rows], dim=2)
