"""The layer anatomy of a model: the part of the adapter contract that says where every block's weights are.

Per layer (:class:`LayerAnatomy`): the block module and its attention module, the query / key / value /
output projections (:class:`Proj`: a module's parameters, or a row range of a fused q/k/v tensor), the head
count and key/value grouping, the two norms and whether they sit before the residual branches (pre-norm)
or after the residual sums (post-norm), every other normalisation module of the block, the MLP (fc1, an
optional gate, the activation, fc2) and layer scales. Per model (:class:`ModelAnatomy`): the layers in
order and the head (final norm, pooling of the output rows, pooler, the logit layer).

No family knowledge lives here: each family's builders (beside its adapter; the family registry
:mod:`attnroll.capture.registry` lists them) fill these dataclasses, by keyword only. Downstream code (the
value-aware methods, the sanity check) reads weights only through them, as plain arrays
(:meth:`LayerAnatomy.block`, :meth:`ModelAnatomy.head`) or as the parameter tensors a component is made of
(:meth:`LayerAnatomy.targets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .. import _checks
from ..core.value_aware import Block, Mlp, Norm, Routed

__all__ = ["Proj", "Experts", "LayerAnatomy", "ModelAnatomy", "Target", "RESET", "linear_params", "norm_params"]

#: (parameter name relative to the block, the parameter, index): index None = the whole tensor, a slice /
#: tuple of slices = the part of a fused tensor, or :data:`RESET` (a norm's parameter, set to its default).
Target = tuple[str, nn.Parameter, Any]

#: ``Target`` index of a normalisation parameter: reset to weight 1 / bias 0 instead of drawn.
RESET = "reset"


@dataclass(frozen=True, kw_only=True)
class Proj:
    """One projection y = x Wᵀ + b, read from parameters of ``module``.

    ``weight`` / ``bias``: the parameter names on ``module`` (bias None when it has none); ``rows``: the
    output features this projection owns when the tensor is fused (q, k, v thirds of a qkv projection);
    ``in_out``: the weight is stored (in, out) (transformers' ``Conv1D``) instead of (out, in); ``expert``: the
    index of one expert in a parameter stacking every expert's weights (E, ...) first (then ``rows``); ``path``:
    the module's path inside its block ("" = the block itself); ``bias_module`` / ``bias_path``: the module
    holding the bias when it is not ``module`` (timm EVA / BEiT: separate q / v biases beside a bias-free fused
    qkv), a whole (out,) tensor that ``rows`` does not index."""

    module: nn.Module
    path: str
    weight: str = "weight"
    bias: str | None = "bias"
    rows: slice | None = None
    in_out: bool = False
    bias_module: nn.Module | None = None
    bias_path: str = ""
    expert: int | None = None

    def _param(self, name: str | None, of: nn.Module | None = None) -> nn.Parameter | None:
        p = None if name is None else getattr(of if of is not None else self.module, name, None)
        return p if isinstance(p, torch.Tensor) else None

    def arrays(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W (out, in), b (out,) or None), detached, in ``dtype`` (None = as stored)."""
        w, b = self._param(self.weight).detach(), self._param(self.bias, self.bias_module)
        if self.expert is not None:  # one expert of a (E, ...) stack of experts' weights
            w, b = w[self.expert], None if b is None else b[self.expert]
        w = w.T if self.in_out else w
        b = None if b is None else b.detach()
        if self.rows is not None:
            w = w[self.rows]
            b = b if b is None or self.bias_module is not None else b[self.rows]
        if dtype is not None:
            w, b = w.to(dtype), None if b is None else b.to(dtype)
        return w, b

    def targets(self) -> list[Target]:
        """The parameters (and the part of a fused one) this projection is made of, weight first."""
        out: list[Target] = []
        for pname, is_weight in ((self.weight, True), (self.bias, False)):
            own = is_weight or self.bias_module is None
            p = self._param(pname, None if own else self.bias_module)
            if p is None:
                continue
            idx = self.rows if own else None
            if idx is not None and is_weight and self.in_out:
                idx = (slice(None), idx)
            if self.expert is not None and own:
                idx = (self.expert,) + (() if idx is None else idx if isinstance(idx, tuple) else (idx,))
            path = self.path if own else self.bias_path
            out.append((f"{path}.{pname}" if path else pname, p, idx))
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The projection applied to x (..., in) with the module's current parameters."""
        w, b = self.arrays(x.dtype)
        return x @ w.T if b is None else x @ w.T + b


@dataclass(frozen=True, kw_only=True)
class Experts:
    """A mixture-of-experts MLP: per token Σ_e w_e · expert_e(h) over the experts its router chose, plus shared
    experts, each expert fc2(act(gate(h)) ⊙ up(h)) (GPT-OSS: fc2(act(gate(h)) ⊙ (``up_act``(up(h)) +
    ``up_offset``))).

    ``module`` the MLP module (its forward routes, then mixes); ``path`` its path in the block; ``source`` the
    experts module, whose forward receives (hidden states (N, d), the chosen experts' indices (N, k), their
    weights (N, k)): the routing the value-aware methods hold fixed is read there; ``routed`` (fc1, gate, fc2)
    per routed expert, in index order; ``shared`` the same for shared experts, always applied; ``shared_gate``
    a module whose sigmoid scales the shared experts per token (Qwen2-MoE), or None (scale 1); ``router``
    the projections that only choose and weight the experts; ``act`` the gate activation."""

    module: nn.Module
    path: str
    source: nn.Module
    routed: tuple[tuple[Proj, Proj, Proj], ...]
    shared: tuple[tuple[Proj, Proj, Proj], ...] = ()
    shared_gate: nn.Module | None = None
    router: tuple[Proj, ...] = ()
    act: Callable
    up_act: Callable | None = None
    up_offset: float = 0.0

    def projections(self) -> list[Proj]:
        """Every projection of the MLP: the experts' (routed, shared), then the router's."""
        return [p for trio in (*self.routed, *self.shared) for p in trio] + list(self.router)

    def mlps(self, dtype: torch.dtype | None, ls2: nn.Module | None) -> tuple[Mlp, ...]:
        """The routed experts, then the shared ones, as arrays (a layer scale folded into each fc2)."""
        out = []
        for fc1, gate, fc2 in (*self.routed, *self.shared):
            w1, b1 = fc1.arrays(dtype)
            wg, bg = gate.arrays(dtype)
            w2, b2 = _scaled(fc2.arrays(dtype), ls2, dtype)
            out.append(Mlp(w1=w1, b1=b1, w2=w2, b2=b2, act=self.act, wg=wg, bg=bg, up_act=self.up_act,
                           up_offset=self.up_offset))
        return tuple(out)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The model's own MLP module on h (..., n, d) (it routes again: the routing follows h)."""
        out = self.module(h.reshape(-1, *h.shape[-2:]))
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.reshape(h.shape)


@dataclass(frozen=True, kw_only=True)
class LayerAnatomy:
    """One transformer block.

    ``module`` the block, ``path`` its path in the model, ``attention`` its attention module; ``q``, ``k``,
    ``v``, ``o`` the projections (value rows of a fused qkv in ``v.rows``); ``heads`` query heads,
    ``kv_heads`` key/value heads (grouped KV when fewer: query head h reads kv head h // (heads/kv_heads));
    ``pre_norm``: h = x + Attn(norm1(x)), out = h + MLP(norm2(h)); else (post-norm) h = norm1(x + Attn(x)),
    out = norm2(h + MLP(h)); ``norm1`` / ``norm2`` those norm modules; ``norms`` every normalisation module
    of the block (path, module), q/k norms included; ``fc1``, ``act``, ``fc2`` and ``gate`` (gated MLPs:
    fc2(act(gate(h)) ⊙ fc1(h))) the MLP, or with ``experts`` (a mixture of experts, :class:`Experts`) its first
    routed expert's (the widths; ``experts`` describes the MLP); ``ls1`` / ``ls2`` layer-scale modules after the
    attention / MLP branch, or None; ``latent`` (projection, norm): multi-head latent attention (DeepSeek-V2 / V3),
    where ``v`` reads norm(projection(x̃)) instead of x̃; ``cross`` the (q, k, v, o) projections of a decoder block's
    cross-attention (encoder-decoder models), or None: sanity counts its q / k in "qk" and its v / o in "value"."""

    index: int
    module: nn.Module
    path: str
    attention: nn.Module
    q: Proj
    k: Proj
    v: Proj
    o: Proj
    heads: int
    kv_heads: int
    pre_norm: bool
    norm1: nn.Module
    norm2: nn.Module
    norms: tuple[tuple[str, nn.Module], ...]
    fc1: Proj
    act: Callable
    fc2: Proj
    gate: Proj | None = None
    ls1: nn.Module | None = None
    ls2: nn.Module | None = None
    cross: tuple[Proj, Proj, Proj, Proj] | None = None
    experts: Experts | None = None
    latent: tuple[Proj, nn.Module] | None = None

    @property
    def residual(self) -> str:
        """How the residual is laid out: "pre-norm" or "post-norm" (see the class docstring)."""
        return "pre-norm" if self.pre_norm else "post-norm"

    def block(self, dtype: torch.dtype | None = None, routing: torch.Tensor | None = None) -> Block:
        """The value path as a pure :class:`~attnroll.core.value_aware.Block` (layer scales folded in); a
        mixture of experts as a :class:`~attnroll.core.value_aware.Routed` MLP with ``routing`` (B, n, E) as
        its weights (the forward pass's, :class:`~attnroll.capture.value_path.LayerStates`)."""
        wv, bv = self.v.arrays(dtype)
        wo, bo = _scaled(self.o.arrays(dtype), self.ls1, dtype)
        latent = None
        if self.latent is not None:
            wa, ba = self.latent[0].arrays(dtype)
            latent = (wa, ba, norm_params(self.latent[1], dtype))
        if self.experts is not None:
            weights = None if routing is None else routing.to(dtype or routing.dtype)
            mlp: Mlp | Routed = Routed(experts=self.experts.mlps(dtype, self.ls2), weights=weights)
        else:
            w1, b1 = self.fc1.arrays(dtype)
            w2, b2 = _scaled(self.fc2.arrays(dtype), self.ls2, dtype)
            wg, bg = self.gate.arrays(dtype) if self.gate is not None else (None, None)
            mlp = Mlp(w1=w1, b1=b1, w2=w2, b2=b2, act=self.act, wg=wg, bg=bg)
        return Block(
            pre_norm=self.pre_norm, norm1=norm_params(self.norm1, dtype), norm2=norm_params(self.norm2, dtype),
            wv=wv, bv=bv, wo=wo, bo=bo, heads=self.heads, kv_heads=self.kv_heads, mlp=mlp, latent=latent,
        )

    def mlp_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP branch through the model's own modules and activation (layer scale included); a mixture of
        experts routes again on h."""
        if self.experts is not None:
            out = self.experts.forward(h)
        else:
            u = self.fc1(h)
            out = self.fc2(self.act(self.gate(h)) * u if self.gate is not None else self.act(u))
        return out if self.ls2 is None else self.ls2(out)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The block's output given its input x (..., d) and its attention branch's output ``attn``
        (b_O and layer scale included), through the model's own norm modules and MLP."""
        if self.pre_norm:
            h = x + attn
            return h + self.mlp_forward(self.norm2(h))
        h = self.norm1(x + attn)
        return self.norm2(h + self.mlp_forward(h))

    def targets(self, component: str) -> list[Target]:
        """The parameters sanity's ``component`` re-initialises, in the block's registration order: "qk"
        (query and key projections), "value" (value and output projections), "mlp" (fc1, gate, fc2), "all"
        (every parameter; those of the block's norms marked :data:`RESET`). Parts of one fused tensor are
        merged into one row range."""
        component = _checks.check_choice("component", component, _checks.SANITY_COMPONENTS)
        if component == "all":
            reset = {id(p) for _, m in self.norms for p in m.parameters(recurse=False)}
            return [(n, p, RESET if id(p) in reset else None) for n, p in self.module.named_parameters()]
        if component == "mlp" and self.experts is not None:  # every expert's and the router's parameters
            prefix = f"{self.experts.path}." if self.experts.path else ""
            return [(prefix + n, p, None) for n, p in self.experts.module.named_parameters()]
        cq, ck, cv, co = self.cross if self.cross is not None else (None,) * 4
        projs = {"qk": (self.q, self.k, cq, ck), "value": (self.v, self.o, cv, co),
                 "mlp": (self.fc1, self.gate, self.fc2)}[component]
        projs = tuple(p for p in projs if p is not None)
        order = {id(p): i for i, (_, p) in enumerate(self.module.named_parameters())}
        merged = _merge([t for proj in projs for t in proj.targets()])
        return sorted(merged, key=lambda t: order.get(id(t[1]), len(order)))


def _merge(targets: list[Target]) -> list[Target]:
    """One target per parameter: adjacent row ranges of one fused tensor joined (q then k -> q and k)."""
    out: dict[int, Target] = {}
    for name, p, idx in targets:
        if id(p) not in out:
            out[id(p)] = (name, p, idx)
            continue
        _, _, prev = out[id(p)]
        out[id(p)] = (name, p, _join(prev, idx, p))
    return list(out.values())


def _join(a: Any, b: Any, p: torch.Tensor) -> Any:
    """The union of two basic indices of p, which must be adjacent slices on one axis (else the whole)."""
    if a is None or b is None:
        return None
    ta, tb = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    sa, sb = ta[-1], tb[-1]
    if ta[:-1] == tb[:-1] and sa.stop == sb.start:
        joined = ta[:-1] + (slice(sa.start, sb.stop),)
        return joined if len(joined) > 1 else joined[0]
    return None


@dataclass(frozen=True, kw_only=True)
class ModelAnatomy:
    """The blocks in order and the head.

    ``family``: the block kind that described it (a :class:`~attnroll.capture.anatomy_parts.BlockKind`'s
    name: "bert", "distilbert", "vit", "gpt2", "llama", "timm", "torch", ...); ``path``: the path of the
    block stack; ``final_norm``: the norm applied to the vector the logit layer reads (pre-norm models'
    final norm; timm's ``fc_norm`` after pooling); ``token_norm``: a norm applied to every output row
    before pooling (a pooled head's final norm), else None; ``pool``: how the head reads the output rows, a
    tuple of parts concatenated along the features, each ("row", None) (the explained row: CLS or the
    decoder's position) or ("mean", start) (the mean of rows start .. n − 1); ``pooler`` (Linear,
    activation) (BERT); ``classifier`` the Linear producing the logits, or None; ``readout`` "first" (CLS)
    or "last" (decoders); ``head_path`` / ``head_module`` the module sanity's head step re-draws ("" / None
    when none); ``value_aware``: "" when the value-aware methods support the family, else why not;
    ``head_reason``: why the logit layer cannot be decomposed ("" otherwise)."""

    family: str
    path: str
    layers: tuple[LayerAnatomy, ...]
    final_norm: nn.Module | None = None
    token_norm: nn.Module | None = None
    pool: tuple[tuple[str, int | None], ...] = (("row", None),)
    pooler: tuple[nn.Module, Callable] | None = None
    classifier: nn.Module | None = None
    readout: str = "first"
    head_path: str = ""
    head_module: nn.Module | None = None
    value_aware: str = ""
    head_reason: str = ""

    def blocks(self, dtype: torch.dtype | None = None, routing: list | None = None) -> list[Block]:
        """Every layer's value path as pure arrays (see :meth:`LayerAnatomy.block`); ``routing`` the forward
        pass's routing per layer (None for a dense MLP), for mixtures of experts."""
        return [layer.block(dtype, None if routing is None else routing[layer.index]) for layer in self.layers]

    @property
    def pooled(self) -> bool:
        """Whether the head reads more than the explained row (mean pooling, CLS ⊕ mean)."""
        return self.pool != (("row", None),)

    @property
    def stream_norm(self) -> nn.Module | None:
        """The final norm applied to every output row (``token_norm`` of a pooled head, else
        ``final_norm``), or None."""
        return self.token_norm if self.pooled else self.final_norm

    def final_norm_params(self, dtype: torch.dtype | None = None) -> Norm | None:
        """The final norm (of the vector the logit layer reads) as arrays, or None."""
        return None if self.final_norm is None else norm_params(self.final_norm, dtype)

    def stream_norm_params(self, dtype: torch.dtype | None = None) -> Norm | None:
        """:attr:`stream_norm` as arrays, or None."""
        return None if self.stream_norm is None else norm_params(self.stream_norm, dtype)

    def token_norm_params(self, dtype: torch.dtype | None = None) -> Norm | None:
        """``token_norm`` as arrays, or None."""
        return None if self.token_norm is None else norm_params(self.token_norm, dtype)

    def head(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The head as arrays for :func:`attnroll.core.decompx.head_shares`: ``final_norm``, ``pooler``
        (W, b, act) and ``classifier`` (W, b). Raises UnsupportedModelError when there is no logit layer."""
        if self.classifier is None:
            raise _checks.UnsupportedModelError(
                f"{self.family}: {self.head_reason}" if self.head_reason else
                f"{self.family}: this model has no classification / LM head attnroll knows (a bare encoder?); "
                "decompx needs the layer that produces the logits"
            )
        pool = None
        if self.pooler is not None:
            w, b = linear_params(self.pooler[0], dtype)
            pool = (w, b, self.pooler[1])
        return {"final_norm": self.final_norm_params(dtype), "pooler": pool,
                "classifier": linear_params(self.classifier, dtype)}

    def pool_weights(self, n: int, rows: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """The head's pooling parts as row weights (B, n): one-hot at ``rows`` (B,) for ("row", None), 1 /
        (n − start) on rows start .. n − 1 for ("mean", start)."""
        B = rows.shape[0]
        out = []
        for kind, start in self.pool:
            w = torch.zeros(B, n, dtype=dtype, device=rows.device)
            if kind == "row":
                w[torch.arange(B, device=rows.device), rows] = 1
            else:
                w[:, start:] = 1.0 / (n - start)
            out.append(w)
        return out

    def head_targets(self) -> list[Target]:
        """Every parameter of the head module (sanity's first step)."""
        if self.head_module is None:
            return []
        return [(f"{self.head_path}.{n}", p, None) for n, p in self.head_module.named_parameters()]


# ------------------------------------------------------------------------------------------- arrays
def linear_params(mod: nn.Module, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W (out, in), b (out,) or None) of an ``nn.Linear`` or a transformers ``Conv1D`` (stored (in, out))."""
    return Proj(module=mod, path="", in_out=type(mod).__name__ == "Conv1D").arrays(dtype)


def norm_params(mod: nn.Module, dtype: torch.dtype | None = None) -> Norm:
    """A LayerNorm / RMSNorm module as a :class:`~attnroll.core.value_aware.Norm`."""
    eps = getattr(mod, "eps", None)
    rms = "RMSNorm" in type(mod).__name__
    if eps is None:
        eps = getattr(mod, "variance_epsilon")
        rms = True
    w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
    cast = (lambda t: None if t is None else t.detach().to(dtype or t.dtype))  # noqa: E731
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
