"""Layers that join softmax attention and a token mixer in one matrix, applied to relevance rows without any n×n
matrix (the matrix-free route of rollout).

Two wirings (``capture/hybrids.py`` reads them off the models):

- ``"parallel"`` (Falcon-H1: attention and a Mamba-2 mixer on the same input, outputs summed):
  L = diag(w_a)·Ā + diag(w_m)·F, so r·L = (r∘w_a)·Ā + (r∘w_m)·F;
- ``"shared"`` (Zamba, Zamba2: a shared attention block's projected output added to the mixer's input):
  L = F·(diag(w_h) + diag(w_T)·Ā), so r·L = (r·F)∘w_h + ((r·F)∘w_T)·Ā.

Ā is the attention's head-fused probabilities (the block rule's fusion), F the mixer's fused row-stochastic matrix
(any layer with ``apply_rows(r, a=, c=, renorm=, mask=)``: ``core.mixers.MixerRows``), w the per-token path weights
(b, n). Per head the dense record holds w_a·A_h + w_m·F (resp. F·(w_h·I + w_T·A_h)); fusing those heads equals the
formulas above for the head mean and weight vectors (both wirings) and for max / min (parallel only: w_a ≥ 0 and
F is the same on every head); max / min over the heads of F·A_h is refused.

The residual blend is the one of ``core.operators.apply_layer``: Ã = diag(1/s)·(a·P + c·I), P = L with padding
dropped (padded rows and columns 0, real rows rescaled to their full sum, as ``rollout`` drops padding) and s the
renorm row sums. Padding and renorm need L·1 and L·real (its row sums, all and over the real columns), two column
products computed block by block from the same pieces: memory O(block·n), never (n, n).
"""

from __future__ import annotations

from typing import Any

import torch

from .operators import BlockRule, FusedLayer, _divide, apply_layer, fused_probs, key_range

KINDS = ("parallel", "shared")


class JoinedRows:
    """One layer L joining an attention layer (``core.operators.KernelInputs`` or ``FusedLayer``) and a mixer
    layer (``apply_rows``) with per-token weights ``first`` / ``second`` (b, n, 1) or (b, n): w_a / w_m for
    ``kind="parallel"``, w_h / w_T for ``kind="shared"`` (module docstring). ``core.operators.apply_layer``
    dispatches to :meth:`apply_joined` with the block rule of the sweep."""

    sinks = None  # the attributes of an attention layer that the row methods' checks read
    mask = None
    causal = True
    is_causal_model = True

    def __init__(self, attention: Any, mixer: Any, first: torch.Tensor, second: torch.Tensor, *, kind: str,
                 name: str = ""):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.attention, self.mixer, self.kind, self.name = attention, mixer, kind, name
        self.first = first.reshape(first.shape[0], -1)
        self.second = second.reshape(second.shape[0], -1)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.attention.shape

    @property
    def device(self) -> torch.device:
        return self.attention.device

    # ----------------------------------------------------------------------------------------- the paths
    def check_rule(self, rule: BlockRule) -> None:
        """The rule must be head-fused probabilities (``operators.fused_probs``); max / min fusion only in a
        parallel layer (module docstring)."""
        how = getattr(rule, "how", None)
        if how is None:
            raise ValueError(f"the joined attention-and-mixer layer {self.name or self.kind!r} is rows-only for "
                             "rollout's head-fused probabilities only; use attention='dense'")
        if self.kind == "shared" and isinstance(how, str) and how != "mean":
            raise ValueError(
                f"head_fusion={how!r} cannot be applied rows-only to the shared-attention layer {self.name!r} "
                "(F·(w_h·I + w_T·A_h) per head: the max / min over heads of a product is no product of rows); use "
                "head_fusion='mean' or a weight vector, or attention='dense'")

    def _attention_rows(self, r: torch.Tensor, rule: BlockRule) -> torch.Tensor:
        """r·Ā (b, R, n)."""
        return apply_layer(r, self.attention, rule, a=1.0, c=0.0)

    def _attention_columns(self, V: torch.Tensor, rule: BlockRule) -> torch.Tensor:
        """Ā·V for columns V (b, n, m), one block of query rows at a time."""
        layer = self.attention
        if isinstance(layer, FusedLayer):
            return layer.probs.to(V.dtype) @ V
        B, _, nq, _ = layer.shape
        out = V.new_zeros(B, nq, V.shape[-1])
        step = layer.block_rows()
        for q0 in range(0, nq, step):
            q1 = min(nq, q0 + step)
            k0, k1 = key_range(layer, q0, q1)
            if k1 > k0:
                out[:, q0:q1] = rule(layer, q0, q1, k0, k1).to(V.dtype) @ V[:, k0:k1]
        return out

    def _mixer_rows(self, r: torch.Tensor) -> torch.Tensor:
        """r·F (b, R, n), F as the dense record holds it (normalised over every column)."""
        return self.mixer.apply_rows(r, a=1.0, c=0.0)

    def _mixer_columns(self, V: torch.Tensor) -> torch.Tensor:
        """F·V for columns V (b, n, m): F's rows a block at a time (one-hot rows through ``apply_rows``)."""
        B, n, _ = V.shape
        step = int(getattr(self.mixer, "rows", 64))
        out = V.new_zeros(B, n, V.shape[-1])
        for t0 in range(0, n, step):
            t1 = min(n, t0 + step)
            E = V.new_zeros(B, t1 - t0, n)
            E[:, torch.arange(t1 - t0), torch.arange(t0, t1)] = 1
            out[:, t0:t1] = self._mixer_rows(E) @ V
        return out

    def left(self, r: torch.Tensor, rule: BlockRule) -> torch.Tensor:
        """r·L for rows r (b, R, n)."""
        w1, w2 = self.first.to(r.dtype)[:, None], self.second.to(r.dtype)[:, None]
        if self.kind == "parallel":
            return self._attention_rows(r * w1, rule) + self._mixer_rows(r * w2)
        y = self._mixer_rows(r)
        return y * w1 + self._attention_rows(y * w2, rule)

    def right(self, V: torch.Tensor, rule: BlockRule) -> torch.Tensor:
        """L·V for columns V (b, n, m)."""
        w1, w2 = self.first.to(V.dtype)[..., None], self.second.to(V.dtype)[..., None]
        if self.kind == "parallel":
            return w1 * self._attention_columns(V, rule) + w2 * self._mixer_columns(V)
        return self._mixer_columns(w1 * V + w2 * self._attention_columns(V, rule))

    # ---------------------------------------------------------------------------------- the residual blend
    def apply_joined(self, r: torch.Tensor, rule: BlockRule, *, a: float, c: float, renorm: bool = False,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """r · diag(1/s)·(a·P + c·I) for rows r (b, R, n), P = L with the padding of ``mask`` (b, n) dropped
        and the identity on real tokens, s the renorm row sums (``core.operators.apply_layer``)."""
        self.check_rule(rule)
        if mask is None and not renorm:
            return a * self.left(r, rule) + c * r
        B, _, n = r.shape
        ones = torch.ones(B, n, dtype=r.dtype, device=r.device)
        real = ones if mask is None else mask.to(r.dtype)
        if mask is None:
            scale, sums = ones, self.right(ones[..., None], rule)[..., 0]
        else:  # P_t = L_t ∘ real · (L_t·1) / (L_t·real) on real rows, 0 on padded ones
            S = self.right(torch.stack([ones, real], dim=-1), rule)
            total, kept = S[..., 0], S[..., 1]
            ok = kept > 0
            scale = torch.where(ok, total / torch.where(ok, kept, ones), torch.zeros_like(kept)) * real
            sums = torch.where(ok, total, torch.zeros_like(total)) * real
        ident = c * real
        rb = r
        if renorm:
            s = a * sums + ident
            rb, ident = _divide(r, s), _divide(ident, s)
        return a * self.left(rb * scale[:, None], rule) * real[:, None] + r * ident[:, None]

    def apply_rows(self, r: torch.Tensor, *, a: float, c: float, renorm: bool = False,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`apply_joined` with the head mean (what readers of a layer's head-mean rows take: sink detection)."""
        return self.apply_joined(r, fused_probs("mean"), a=a, c=c, renorm=renorm, mask=mask)
