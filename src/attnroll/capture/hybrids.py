"""Readers of the hybrid layouts beyond :mod:`attnroll.capture.mixers`: the gated DeltaNets of Qwen3.5 and
OLMo-Hybrid, Kimi Linear's KDA (a delta rule with a per-channel decay), RecurrentGemma's RG-LRU recurrent block,
Falcon-H1's Mamba-2 mixer (run in parallel with attention in the same layer) and the Mamba / Mamba-2 mixers of
Zamba and Zamba2 (whose shared attention block feeds the mixer's input).

Each reader recomputes its layer's output from the forward hook's inputs, with the data-dependent gates held, as
one matrix per channel / head (:mod:`attnroll.core.mixers`), checks that it reproduces the layer's real output,
and returns its :class:`~attnroll.capture.mixers.MixerParts` (:data:`PARTS`): the fused row-stochastic
(b, 1, n, n) matrix of the layer's value-like input → mixed output (:func:`mixer_matrix`), and, for ``grad_rollout``
and ``gae``, its gradient-weighted matrix (:func:`mixer_reading`).

Where two token-mixing paths meet in one sum (Falcon-H1's attention + SSD branches; Zamba's hidden state + the
shared block's projected output at the mixer's input), the paths are weighted per output token by the norm of
each path's contribution to that sum (:func:`norm_weights`): w_i[t] = ‖y_i[t]‖ / Σ_j ‖y_j[t]‖; the gradient
methods join the paths' gradient-weighted matrices with the same weights (:class:`Wiring`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import _checks
from ..core import mixers as ops
from ..core.gradients import gradient_weighted
from ..core.joined import JoinedRows
from . import mixers as base
from .mixers import MixerParts, _causal_conv, _check_reproduces, _fold, _keep, _l2, _normalised

__all__ = ["PARTS", "READERS", "RowsWiring", "mixer_matrix", "mixer_reading", "norm_weights", "wired_rows"]


def norm_weights(*parts: torch.Tensor) -> list[torch.Tensor]:
    """Per output token, each path's share of a sum of paths (b, n, d) each: ‖y_i[t]‖ / Σ_j ‖y_j[t]‖, (b, n, 1)
    each (equal shares where every path is zero)."""
    norms = [p.detach().to(torch.float64).norm(dim=-1, keepdim=True) for p in parts]
    total = sum(norms)
    ok = total > 0
    return [torch.where(ok, nm / torch.where(ok, total, torch.ones_like(total)), torch.full_like(nm, 1 / len(parts)))
            for nm in norms]


# ------------------------------------------------------------------------------- delta rules
def _delta(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None, output: torch.Tensor,
           parts: Callable[[torch.Tensor], tuple]) -> MixerParts:
    """The layout-independent part of a gated DeltaNet / KDA reader. ``parts(h)`` gives, from the masked input h,
    the convolution's input (b, n, 2·key_dim + value_dim: q, k, v), β (b, n, Hv), the log decay g ((b, n, Hv) or
    (b, n, H, dk)) and ``finish(o)``: the layer's output from the delta rule's output o (b, n, Hv, dv). Returns the
    :class:`~attnroll.capture.mixers.MixerParts` of v_in → o (per value head, its convolution and SiLU folded)."""
    b, n, _ = hidden.shape
    keep = _keep(hidden, mask)
    mixed, beta, g, finish = parts(hidden * keep)
    u = _causal_conv(module, mixed.transpose(1, 2)).transpose(1, 2)
    dk = getattr(module, "head_k_dim", None) or module.head_dim
    key_dim = getattr(module, "key_dim", None) or module.qkv_dim
    q, k, v = F.silu(u).split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    Hv = beta.shape[-1]
    Hk = key_dim // dk
    q = _l2(q.reshape(b, n, Hk, dk)).repeat_interleave(Hv // Hk, 2) * dk ** -0.5
    k = _l2(k.reshape(b, n, Hk, dk)).repeat_interleave(Hv // Hk, 2)
    W = ops.delta_matrix(q, k, beta.to(hidden.dtype), g.to(hidden.dtype))  # (b, Hv, n, n)
    dv = v.shape[-1] // Hv
    o = ops.mix(W, v.reshape(b, n, Hv, dv)).reshape(b, n, Hv * dv)
    post = lambda o: finish(o.reshape(b, n, Hv, dv))  # noqa: E731
    _check_reproduces(module, post(o), output)
    start = 2 * key_dim
    return MixerParts(M=W, heads_of=dv, x_in=mixed[..., start:], y=o, post=post,
                      gate_in=torch.sigmoid(u[..., start:]) * keep, weight=module.conv1d.weight[start:, 0])


def _qwen3_5_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                   output: torch.Tensor) -> MixerParts:
    """Qwen3.5's gated DeltaNet: Qwen3-Next's delta rule with separate in_proj_qkv / in_proj_z / in_proj_b /
    in_proj_a projections; out = out_proj(RMSNorm(o) · SiLU(z))."""

    def parts(h: torch.Tensor) -> tuple:
        g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(h).float() + module.dt_bias)
        z = module.in_proj_z(h)
        dv = module.head_v_dim

        def finish(o: torch.Tensor) -> torch.Tensor:
            y = module.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(*h.shape[:2], -1)
            return module.out_proj(y)

        return module.in_proj_qkv(h), module.in_proj_b(h).sigmoid(), g, finish

    return _delta(module, hidden, mask, output, parts)


def _olmo_hybrid_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                       output: torch.Tensor) -> MixerParts:
    """OLMo-Hybrid's gated DeltaNet: separate q / k / v / a / b projections, β doubled when negative eigenvalues
    are allowed, out = o_proj(RMSNorm(o) · SiLU(g_proj(h)))."""

    def parts(h: torch.Tensor) -> tuple:
        beta = module.b_proj(h).sigmoid() * (2.0 if module.allow_neg_eigval else 1.0)
        g = -module.A_log.float().exp() * F.softplus(module.a_proj(h).float() + module.dt_bias)
        gate, dv = module.g_proj(h), module.head_v_dim

        def finish(o: torch.Tensor) -> torch.Tensor:
            y = module.o_norm(o.reshape(-1, dv), gate.reshape(-1, dv)).reshape(*h.shape[:2], -1)
            return module.o_proj(y)

        mixed = torch.cat([module.q_proj(h), module.k_proj(h), module.v_proj(h)], dim=-1)
        return mixed, beta, g, finish

    return _delta(module, hidden, mask, output, parts)


def _kimi_delta_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                      output: torch.Tensor) -> MixerParts:
    """Kimi Linear's KDA: the delta rule with a per-key-channel decay (its forget gate, (b, n, H, dk)), β = σ(b),
    out = o_proj(RMSNorm(o) · σ(g_b(g_a(h)))) per head."""

    def parts(h: torch.Tensor) -> tuple:
        shape = (*h.shape[:2], -1, module.head_dim)
        gate = module.g_b_proj(module.g_a_proj(h)).view(shape)

        def finish(o: torch.Tensor) -> torch.Tensor:
            return module.o_proj(module.o_norm(o, gate).reshape(*h.shape[:2], -1))

        mixed = torch.cat([module.q_proj(h), module.k_proj(h), module.v_proj(h)], dim=-1)
        return mixed, torch.sigmoid(module.b_proj(h)), module.forget_gate(h), finish

    return _delta(module, hidden, mask, output, parts)


# ------------------------------------------------------------------------------- RG-LRU
def _rg_lru_parts(module: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor | None,
                  output: torch.Tensor) -> MixerParts:
    """RecurrentGemma's recurrent block: x = conv(linear_x(h)) per channel; the RG-LRU h_t = a_t h_{t−1} +
    √(1 − a_t²) · i_t · x_t (a_t = exp(−8 r_t softplus(Λ)), the input gate i_t and recurrence gate r_t read from x
    and held; a_t = 0 and no normalisation where the position restarts at 0); out = linear_out(h · GeLU(linear_y)).
    Its parts: x_in = linear_x(h) → y = h · GeLU(linear_y) per channel (core.mixers.lru_matrix after
    core.mixers.conv_matrix, the output branch a diagonal on the rows)."""
    g = base.rg_lru_gates(module, hidden, position_ids)
    x_in, x, y, reset = g["x_in"], g["x"], g["y"], g["reset"]
    M = ops.lru_matrix(g["log_a"], g["scale"])  # (b, d, n, n)
    restarts = reset[..., 0].to(torch.int64).cumsum(1)  # a restart at r cuts every path from s < r to t ≥ r
    M = M * (restarts[:, None, :, None] == restarts[:, None, None, :])
    M = M * y.transpose(1, 2)[:, :, :, None]
    y_mix = ops.mix(M, x)
    _check_reproduces(module, module.linear_out(y_mix), output)  # the conv's bias: a constant of x
    return MixerParts(M=M, heads_of=1, x_in=x_in, y=y_mix, post=module.linear_out, gate_in=torch.ones_like(x),
                      weight=module.conv_1d.weight[:, 0])



# ------------------------------------------------------------------------------- Mamba-2 / Mamba layouts
class _FalconInput:
    """A Falcon-H1 mixer seen as a Mamba-2 mixer: its in_proj with the μP multipliers (the input's
    ``ssm_in_multiplier``, the projection's ``mup_vector``) and its output gate (a grouped RMSNorm, or SiLU(z) alone
    when the mixer has no norm) as Mamba2Mixer's."""

    def __init__(self, module: nn.Module):
        self._m = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)

    def in_proj(self, h: torch.Tensor) -> torch.Tensor:
        return self._m.in_proj(h * self._m.ssm_in_multiplier) * self._m.mup_vector.to(h.dtype)

    def norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self._m.norm(y, z) if self._m.mamba_rms_norm else y * F.silu(z)


def _falcon_h1_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                     output: torch.Tensor) -> MixerParts:
    """Falcon-H1's Mamba-2 mixer: Mamba2Mixer's reading (attnroll.capture.mixers) of its μP-scaled projection."""
    return base._mamba2_parts(_FalconInput(module), hidden, mask, output)


def _zamba_gates(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
    """Zamba's multi-head Mamba mixer's reading: in_proj's channels interleave x_in and z; u = conv(x_in),
    x = SiLU(u); per Mamba head its own x_proj / dt_proj / A / D give the selective scan's ``heads``
    [(C, B (b, n, N), Δ (b, n, P), A (P, N), D (P,))], and ``gate_in`` the SiLU's σ(u) on the real tokens."""
    b, n, _ = hidden.shape
    keep = _keep(hidden, mask)
    x_in, z = module.in_proj(hidden * keep).reshape(b, n, -1, 2).unbind(-1)
    u = _causal_conv(module, x_in.transpose(1, 2)).transpose(1, 2)
    x = F.silu(u) * keep
    Hm, P, R, N = module.n_mamba_heads, module.mamba_head_dim, module.time_step_rank, module.ssm_state_size
    heads = []
    for h in range(Hm):
        ts, B, C = (x[..., h * P:(h + 1) * P] @ module.x_proj_weight[h].T).split([R, N, N], dim=-1)
        dt = F.softplus(ts @ module.dt_proj_weight[h].T + module.dt_proj_bias[h])
        A = -torch.exp(module.A_log[h].float()).to(hidden.dtype)
        heads.append((C, B, dt, A, module.D[h].to(hidden.dtype)))
    return dict(x_in=x_in, z=z, x=x, heads=heads, gate_in=torch.sigmoid(u) * keep, head_dim=P)


def _zamba_mamba_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                       output: torch.Tensor) -> MixerParts:
    """Zamba's multi-head Mamba mixer (:func:`_zamba_gates`): y = scan(x) · SiLU(z) per Mamba head, out =
    out_proj(y). Returns the fused (b, 1, n, n) matrix of x_in → y, the conv and the SiLU (its sigmoid held)
    folded per channel."""
    g = _zamba_gates(module, hidden, mask)
    per_head = [ops.selective_matrix(*head) for head in g["heads"]]
    M = torch.cat(per_head, dim=1) * F.silu(g["z"]).transpose(1, 2)[:, :, :, None]  # (b, I, n, n), gate on rows
    y = ops.mix(M, g["x"])
    _check_reproduces(module, module.out_proj(y), output)
    return MixerParts(M=M, heads_of=1, x_in=g["x_in"], y=y, post=module.out_proj, gate_in=g["gate_in"],
                      weight=module.conv1d.weight[:, 0])


#: Mixer class -> parts(module, hidden, mask or position ids, output): its
#: :class:`~attnroll.capture.mixers.MixerParts`, checked to reproduce its output, for the classes this module reads.
PARTS: dict[str, Callable[..., MixerParts]] = {
    "Qwen3_5GatedDeltaNet": _qwen3_5_parts, "Qwen3_5MoeGatedDeltaNet": _qwen3_5_parts,
    "OlmoHybridGatedDeltaNet": _olmo_hybrid_parts, "KimiLinearDeltaAttention": _kimi_delta_parts,
    "RecurrentGemmaRecurrentBlock": _rg_lru_parts, "FalconH1Mixer": _falcon_h1_parts,
    "ZambaMambaMixer": _zamba_mamba_parts, "Zamba2MambaMixer": base._mamba2_parts,
}


def _reader(parts: Callable[..., MixerParts]) -> Callable[..., torch.Tensor]:
    def read(module: nn.Module, hidden: torch.Tensor, extra: Any, output: torch.Tensor) -> torch.Tensor:
        return _normalised(_fold(parts(module, hidden, extra, output)))

    read.__doc__ = f"The fused row-stochastic (b, 1, n, n) matrix of {parts.__name__}'s parts."
    return read


#: Mixer class -> reader(module, hidden, mask or position ids, output) -> its fused (b, 1, n, n) matrix.
READERS: dict[str, Callable[..., torch.Tensor]] = {name: _reader(parts) for name, parts in PARTS.items()}
#: Readers that take the block's position ids (a restart at position 0 resets the recurrence) instead of a mask.
_BY_POSITION = ("RecurrentGemmaRecurrentBlock",)


def _hook_reading(name: str, args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """A mixer's forward-hook args, kwargs and output as its reader takes them: hidden, the (b, n) padding mask or
    the position ids, and its output tensor."""
    hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_states"))
    if name in _BY_POSITION:
        extra = args[1] if len(args) > 1 else kwargs.get("position_ids")
    else:
        extra = kwargs.get("attention_mask")
        extra = extra if extra is None or extra.ndim == 2 else None
    return hidden, extra, output[0] if isinstance(output, (tuple, list)) else output


def mixer_matrix(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    """The fused (b, 1, n, n) matrix of a composed mixer's forward (its forward hook's args, kwargs and output):
    this module's readers, else :func:`attnroll.capture.mixers.mixer_matrix`."""
    name = type(module).__name__
    if name not in READERS:
        return base.mixer_matrix(module, args, kwargs, output)
    hidden, extra, out = _hook_reading(name, args, kwargs, output)
    with torch.no_grad():
        return READERS[name](module, hidden.detach(), extra, out)


def mixer_reading(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, Any]:
    """:func:`attnroll.capture.mixers.mixer_reading` for every class of its ``WEIGHTED``: the fused matrix and
    ``(out, weigh)``, weigh(g_out, clamp) -> the layer's gradient-weighted matrix mean_c((K_c ⊙ ∂y/∂K_c)^+) (b, n, n);
    this module's parts for its classes."""
    name = type(module).__name__
    if name not in PARTS:
        return base.mixer_reading(module, args, kwargs, output)
    hidden, extra, out = _hook_reading(name, args, kwargs, output)
    with torch.no_grad():
        parts = PARTS[name](module, hidden.detach(), extra, out)
    return base.weighted_reading(parts, out)


# ------------------------------------------------------------------------------- how the paths meet
class Wiring:
    """The hybrid layers in which a mixer is not one layer of its own: Falcon-H1's decoder layer runs its Mamba-2
    mixer and its attention in parallel on the same input and adds their outputs (with multipliers) to the
    residual: the layer's matrix is w_a·A_h + w_m·M per head (its record is the attention's site; the mixer is no
    site of its own). Zamba's / Zamba2's hybrid layer runs a shared attention block on [h, embeddings], projects
    its output T and feeds norm(h + T) to the layer's mixer, whose output is added to h: the layer's matrix is
    M·(w_h·I + w_T·A_h) per head (its record is the mixer's site; the shared attention, run by several layers, is
    no site). The w are :func:`norm_weights` of the summed paths, per output token.

    With gradients kept (``keep_grad``), each such layer's gradient-weighted matrix joins its paths' gradient-weighted
    matrices the same way: w_a·Ā_A + w_m·Ā_M (Falcon-H1) and Ā_M·(w_h·I + w_T·Ā_A) (Zamba), Ā_A = mean_h((A_h ⊙
    ∂y/∂A_h)^+) of the attention's probabilities, Ā_M the mixer's (capture/mixers.py ``mixer_reading``); the
    layer's entry of ``record.extra["mixer_weighted"]`` differentiates both tensors."""

    def __init__(self, model: nn.Module):
        self.parallel: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(attention) -> (mixer, decoder layer)
        self.shared: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(mixer) -> (hybrid layer, shared attention)
        for mod in model.modules():
            name = type(mod).__name__
            mixer = getattr(mod, "mamba", None) or getattr(getattr(mod, "mamba_decoder", None), "mamba", None)
            if type(mixer).__name__ not in base.COMPOSED:
                continue
            if name == "FalconH1DecoderLayer":
                self.parallel[id(mod.self_attn)] = (mod.mamba, mod)
            elif name in ("ZambaHybridLayer", "Zamba2HybridLayer"):
                block = getattr(mod, "shared_transf", None) or mod.shared_transformer
                self.shared[id(mod.mamba_decoder.mamba)] = (mod, block.self_attn)
        self.not_sites = {id(m) for m, _ in self.parallel.values()} | {id(a) for _, a in self.shared.values()}
        self.stash: dict[Any, Any] = {}
        self.keep_grad = False  # set by the adapter before a pass whose gradients are taken
        self.weighted: dict[int, Any] = {}  # id(attention) -> a parallel layer's gradient-weighted entry

    def __bool__(self) -> bool:
        return bool(self.parallel or self.shared)

    def install(self, hook: Callable[..., Any]) -> None:
        """Hook what the combinations read: ``hook(module, fn, pre=False)`` registers fn as a forward (pre-)hook
        with kwargs and arranges its removal."""
        for mixer, layer in self.parallel.values():
            hook(mixer, lambda m, a, k, o, layer=layer: self.stash.__setitem__(id(m), (
                *(mixer_reading(m, a, k, o) if self.keep_grad else (mixer_matrix(m, a, k, o), None)),
                o.detach() * layer.ssm_out_multiplier)))
        for attn in {id(a): a for _, a in self.shared.values()}.values():  # a shared block: its every call
            hook(attn, lambda m, a, k, o: self.stash.__setitem__(("attn", self.stash.get("current")), o[1]))
        for mixer_id, (layer, _) in self.shared.items():
            hook(layer, lambda m, a, k, key=mixer_id: self.stash.__setitem__("current", key), pre=True)
            hook(layer.mamba_decoder, lambda m, a, k, key=mixer_id: self.stash.__setitem__(("paths", key), (
                a[0] if a else k["hidden_states"], k["transformer_hidden_states"])), pre=True)

    def attention(self, module: nn.Module, probs: Any, output: Any) -> Any:
        """A parallel layer's matrix from its attention's probabilities (b, H, n, n) and output (with gradients
        kept, its gradient-weighted entry goes to ``weighted``)."""
        if id(module) not in self.parallel or probs is None:
            return probs
        mixer, layer = self.parallel[id(module)]
        M, entry, y_m = self.stash.pop(id(mixer))
        w_m, w_a = norm_weights(y_m, output[0].detach() * layer.attn_out_multiplier)
        if entry is not None:
            out, weigh_m = entry

            def weigh(grads: list[torch.Tensor], clamp: str) -> torch.Tensor:
                Aw = _weighted_attention(probs, grads[0], clamp)
                Mw = weigh_m(grads[1], clamp)
                return w_a.to(Aw.dtype) * Aw + w_m.to(Mw.dtype) * Mw

            self.weighted[id(module)] = ((probs, out), weigh)
        return (w_a[:, None] * probs + w_m[:, None] * M).to(probs.dtype)

    def _shared_paths(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A shared-attention layer's attention probabilities (b, H, n, n) and path weights w_h, w_T (b, n, 1)."""
        A = self.stash.pop(("attn", id(module)))
        h, T = self.stash.pop(("paths", id(module)))
        w_h, w_T = norm_weights(h, T)
        return A, w_h, w_T

    def mixer(self, module: nn.Module, M: torch.Tensor) -> torch.Tensor:
        """A shared-attention hybrid layer's matrix from its mixer's fused matrix M (b, 1, n, n)."""
        if id(module) not in self.shared:
            return M
        A, w_h, w_T = self._shared_paths(module)
        return _through(M, A.detach(), w_h, w_T)

    def mixer_weighted(self, module: nn.Module, M: torch.Tensor, entry: Any) -> tuple[torch.Tensor, Any]:
        """:meth:`mixer` and the layer's gradient-weighted entry from the mixer's ``mixer_reading`` (M, entry)."""
        if id(module) not in self.shared:
            return M, entry
        A, w_h, w_T = self._shared_paths(module)
        out, weigh_m = entry

        def weigh(grads: list[torch.Tensor], clamp: str) -> torch.Tensor:
            Aw = _weighted_attention(A, grads[1], clamp)[:, None]
            return _through(weigh_m(grads[0], clamp)[:, None], Aw, w_h, w_T)[:, 0]

        return _through(M, A.detach(), w_h, w_T), ((out, A), weigh)


def _through(M: torch.Tensor, A: torch.Tensor, w_h: torch.Tensor, w_T: torch.Tensor) -> torch.Tensor:
    """M (b, 1, n, n) · (diag(w_h)·I + diag(w_T)·A) with A (b, H, n, n) and the weights (b, n, 1)."""
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    return M @ (w_h[:, None].to(M.dtype) * eye + w_T[:, None].to(M.dtype) * A.to(M.dtype))


def _weighted_attention(A: torch.Tensor, g: torch.Tensor, clamp: str) -> torch.Tensor:
    """Chefer's mean_h((A_h ⊙ ∂y/∂A_h)^+) (or (mean_h(·))^+ with clamp "after_mean") of A (b, H, n, n), (b, n, n)."""
    return gradient_weighted([A.detach()], [g.detach()], clamp, dtype=None)[0]


# ------------------------------------------------------------------------------- the rows-only form
class _SummedRows(ops.MixerRows):
    """A mixer made of :class:`~attnroll.core.mixers.MixerRows` over disjoint channels (Zamba's Mamba heads): its
    block Σ_c |K_c| is the sum of theirs, normalised by :meth:`~attnroll.core.mixers.MixerRows.apply_rows`."""

    def __init__(self, parts: list[ops.MixerRows], heads: int = 1):
        first = parts[0]
        super().__init__(first.batch, first.n, first.device, heads, first.rows)
        self.parts = parts

    def block(self, t0: int, t1: int) -> torch.Tensor:
        total = self.parts[0].block(t0, t1)
        for part in self.parts[1:]:
            total = total + part.block(t0, t1)
        return total


def wired_rows(module: nn.Module, args: tuple, kwargs: dict, heads: int = 1) -> ops.MixerRows:
    """The rows-only form (core.mixers.MixerRows) of a mixer of ``capture.mixers.WIRED`` alone, from its forward
    hook's args and kwargs: the fused matrix of its reader here (:data:`READERS`), a block of rows at a time:
    Falcon-H1's (μP-scaled) and Zamba2's Mamba-2 mixers as ``SSDRows``, Zamba's multi-head Mamba as one
    ``SelectiveRows`` per Mamba head, summed."""
    name = type(module).__name__
    hidden, mask, _ = _hook_reading(name, args, kwargs, None)
    with torch.no_grad():
        hidden = hidden.detach()
        if name == "ZambaMambaMixer":
            g = _zamba_gates(module, hidden, mask)
            P, gate_out, weight = g["head_dim"], F.silu(g["z"]), module.conv1d.weight[:, 0]
            parts = [ops.SelectiveRows(*head, gate_out[..., h * P:(h + 1) * P], g["gate_in"][..., h * P:(h + 1) * P],
                                       weight[h * P:(h + 1) * P], heads=heads) for h, head in enumerate(g["heads"])]
            return _SummedRows(parts, heads)
        if name in ("FalconH1Mixer", "Zamba2MambaMixer"):
            g = base.mamba2_gates(_FalconInput(module) if name == "FalconH1Mixer" else module, hidden, mask)
            return ops.SSDRows(g.C, g.B, g.dt, g.A, g.D, torch.sigmoid(g.u) * _keep(hidden, mask), g.weight,
                               heads=heads)
    raise _checks.UnsupportedModelError(
        f"{name} is no mixer joined with attention in one layer (FalconH1Mixer, ZambaMambaMixer, Zamba2MambaMixer); "
        "use attention='dense'")


class RowsWiring:
    """:class:`Wiring`'s joined layers on the matrix-free route (capture/recompute.py): each becomes one
    :class:`~attnroll.core.joined.JoinedRows` of its attention's kernel inputs, its mixer's rows-only form
    (:func:`wired_rows`) and the per-token path weights (:func:`norm_weights`, (b, n, 1) each, from the forward
    hooks: O(n·d) kept, nothing n×n). A parallel (Falcon-H1) layer is its attention site's record, joined when the
    attention returns (``join``); a shared-attention (Zamba) layer is its mixer site's, the shared attention's
    kernel inputs noted per call (:meth:`attention_inputs`) for the hybrid layer that runs it."""

    def __init__(self, wiring: Wiring, heads: int = 1):
        self.wiring, self.heads = wiring, heads
        self.stash: dict[Any, Any] = {}
        #: id of every module the shared attention blocks' kernels may be called with
        self.shared_attention = {id(m) for _, attn in wiring.shared.values() for m in attn.modules()}

    def install(self, hook: Callable[..., Any], join: Callable[[nn.Module, Callable[[Any], Any]], None]) -> None:
        """``hook(module, fn, pre=False)`` as :meth:`Wiring.install`; ``join(attention, fn)`` replaces the kept layer
        K of the attention's site by fn(K)."""
        for mixer, layer in self.wiring.parallel.values():
            hook(mixer, lambda m, a, k, o, layer=layer: self.stash.__setitem__(id(m), (
                wired_rows(m, a, k, self.heads), _first(o).detach() * layer.ssm_out_multiplier)))
            hook(layer.self_attn, lambda m, a, k, o, mixer=mixer, layer=layer: join(
                m, lambda kept: self._parallel(kept, mixer, layer, _first(o))))
        for key, (layer, _) in self.wiring.shared.items():
            hook(layer, lambda m, a, k, key=key: self.stash.__setitem__("current", key), pre=True)
            hook(layer.mamba_decoder, lambda m, a, k, key=key: self.stash.__setitem__(("weights", key), norm_weights(
                a[0] if a else k["hidden_states"], k["transformer_hidden_states"])), pre=True)

    def _parallel(self, kept: Any, mixer: nn.Module, layer: nn.Module, y_a: torch.Tensor) -> JoinedRows:
        rows, y_m = self.stash.pop(id(mixer))
        w_m, w_a = norm_weights(y_m, y_a.detach() * layer.attn_out_multiplier)
        return JoinedRows(kept, rows, w_a, w_m, kind="parallel", name=_layer_name(layer, mixer))

    def attention_inputs(self, kept: Any) -> None:
        """A shared attention block's kernel inputs on this call, for the hybrid layer that runs it."""
        self.stash[("attn", self.stash.get("current"))] = kept

    def mixer(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """A WIRED mixer's layer of the row sweep from its forward hook: joined with the shared attention that fed
        it, or its rows alone (a Zamba layer without the shared block)."""
        rows = wired_rows(module, args, kwargs, self.heads)
        if id(module) not in self.wiring.shared:
            return rows
        kept = self.stash.pop(("attn", id(module)), None)
        if kept is None:
            raise _checks.CaptureError(
                f"the shared attention before {type(module).__name__} did not go through transformers' attention "
                "interface, so its layer cannot be joined rows-only; use attention='dense'")
        w_h, w_T = self.stash.pop(("weights", id(module)))
        layer = self.wiring.shared[id(module)][0]
        return JoinedRows(kept, rows, w_h, w_T, kind="shared", name=_layer_name(layer, module))


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _layer_name(layer: nn.Module, mixer: nn.Module) -> str:
    idx = getattr(mixer, "layer_idx", getattr(layer, "layer_idx", None))
    return f"{type(layer).__name__}" + ("" if idx is None else f" {idx}")


def rows_refusal(model: nn.Module, head_fusion: Any) -> str:
    """Why rollout's rows-only route cannot take ``model``'s joined layers with ``head_fusion`` ("" when it can):
    max / min over the heads of a shared-attention layer F·(w_h·I + w_T·A_h) (core.joined)."""
    if not isinstance(head_fusion, str) or head_fusion == "mean":
        return ""
    wiring = Wiring(model)
    if not wiring.shared:
        return ""
    layer, _ = next(iter(wiring.shared.values()))
    return (f"head_fusion={head_fusion!r} over its shared-attention layers ({type(layer).__name__}: F·(w_h·I + "
            "w_T·A_h) per head) has no rows-only form (the max / min over heads of a product is no product of rows); "
            "head_fusion='mean' or a weight vector has one")
