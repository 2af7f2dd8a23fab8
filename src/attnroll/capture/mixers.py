"""Token mixers other than softmax attention in a model's block stack (Mamba / Mamba-2 mixers, gated DeltaNet and
other linear attention, short convolutions, RG-LRU recurrent blocks): found, named, and refused by the methods
that would otherwise compose the attention layers alone and return a partial map without saying so.

A mixer is found two ways, per family and generically:

- by its class, from the families' known mixer kinds (:data:`KNOWN_MIXERS`, listed by the registry's entries:
  Jamba, Bamba, Zamba, Zamba2, Falcon-H1, GraniteMoeHybrid, Nemotron-H, LFM2, RecurrentGemma, Kimi-Linear,
  Qwen3-Next, Qwen3.5, OLMo-Hybrid, MiniMax, Bailing-Hybrid, ...);
- structurally: a module inside a block of the stack that owns a 1-D convolution wider than one token (a
  causal convolution over the sequence, which every Mamba, DeltaNet, LFM2 and RG-LRU block has), whatever its
  class is called.

The outermost such module below each block is the block's mixer; its kind is read from its parameters
(a per-head decay ``A_log`` of one axis: Mamba-2 / SSD; of two axes: Mamba's selective SSM) or its class name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _checks
from ..core import mixers as ops

__all__ = ["Mixer", "MixerKind", "KNOWN_MIXERS", "MODES", "find_mixers", "check_mixers", "describe"]

#: The ``mixers=`` option: "compose" (default) composes every token mixer, refusing a model whose mixers attnroll
#: cannot compose; "attention_only" rolls out through the attention layers alone (a partial map, recorded in
#: ``Explanation.extra["mixers"]`` and warned about).
MODES = ("compose", "attention_only")


@dataclass(frozen=True)
class MixerKind:
    """A known kind of token mixer: the class names it has (a regular expression searched in the class name),
    how texts call it, and the models refused for it (README's refused row; "" when every family of that kind
    attnroll knows is :data:`COMPOSED`)."""

    pattern: str
    kind: str
    models: str


#: The mixer kinds of the transformers families (the registry's ``TRANSFORMERS`` entry lists them), tried in order.
KNOWN_MIXERS = (
    MixerKind(r"DeltaNet|DeltaAttention", "gated DeltaNet (linear attention with a delta-rule state)",
              "Bailing-Hybrid"),
    MixerKind(r"LightningAttention", "lightning attention (linear attention with a decaying state)", "MiniMax"),
    MixerKind(r"ShortConv", "short causal convolution (gated)", "other gated short convolutions"),
    MixerKind(r"RecurrentBlock|Rglru", "RG-LRU recurrent block (convolution + real-gated linear recurrence)", ""),
    MixerKind(r"Mamba2Mixer|^(Bamba|FalconH1)Mixer$|^Zamba2MambaMixer$|^GraniteMoeHybridMambaLayer$",
              "Mamba-2 (SSD) mixer", ""),
    MixerKind(r"Mamba(Mixer|Layer)$|MambaMixer", "Mamba (selective state-space) mixer", ""),
)

#: Class names the structural search never takes for a mixer: the blocks themselves (a hybrid layer holding a
#: Mamba decoder layer names the Mamba mixer inside, not the decoder layer).
_BLOCK_NAMES = re.compile(r"(DecoderLayer|HybridLayer|EncoderLayer)$")


@dataclass(frozen=True)
class Mixer:
    """A token mixer of block ``layer`` of the stack: its path, class name and kind."""

    layer: int
    path: str
    cls: str
    kind: str

    def describe(self) -> str:
        return f"layer {self.layer}: {self.kind} ({self.cls} at {self.path})"


def _owns_sequence_conv(module: nn.Module) -> bool:
    return any(isinstance(c, nn.Conv1d) and c.kernel_size[0] > 1 for c in module.children())


def _kind(module: nn.Module) -> str:
    name = type(module).__name__
    for known in KNOWN_MIXERS:
        if re.search(known.pattern, name):
            return known.kind
    a_log = getattr(module, "A_log", None)
    if a_log is not None and getattr(a_log, "ndim", 0) == 1:
        return "Mamba-2 (SSD) mixer"
    if a_log is not None and getattr(a_log, "ndim", 0) == 2:
        return "Mamba (selective state-space) mixer"
    return "token mixer (a convolution over the sequence)"


def _is_candidate(module: nn.Module) -> bool:
    name = type(module).__name__
    if _BLOCK_NAMES.search(name):
        return False
    return _owns_sequence_conv(module) or any(re.search(k.pattern, name) for k in KNOWN_MIXERS)


_STACK_NAMES = ("layers", "layer", "blocks", "h")


def _stack(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The block stack: the largest (by parameter count) nn.ModuleList named ``layers`` / ``layer`` / ``blocks`` /
    ``h`` whose children are composite modules, of one type or several (a hybrid's attention and mixer layers);
    else the largest such nn.ModuleList of any name; None when there is none."""
    best: dict[bool, tuple[int, str, list[nn.Module]]] = {}
    for path, mod in model.named_modules():
        kids = list(mod.children()) if isinstance(mod, nn.ModuleList) else []
        if not kids or not all(any(True for _ in k.children()) for k in kids):
            continue
        named = path.rsplit(".", 1)[-1] in _STACK_NAMES
        size = sum(p.numel() for p in mod.parameters())
        if named not in best or size > best[named][0]:
            best[named] = (size, path, kids)
    found = best.get(True) or best.get(False)
    return None if found is None else (found[1], found[2])


def find_mixers(model: nn.Module) -> list[Mixer]:
    """The token mixers other than softmax attention in ``model``'s block stack, in layer order (outermost module
    per finding; none for a model without a block stack)."""
    found_stack = _stack(model)
    if found_stack is None:
        return []
    stack, blocks = found_stack
    found: list[Mixer] = []
    for i, block in enumerate(blocks):
        taken: list[str] = []
        for path, mod in block.named_modules():
            if not path or any(path.startswith(t + ".") for t in taken) or not _is_candidate(mod):
                continue
            taken.append(path)
            found.append(Mixer(i, f"{stack}.{i}.{path}" if stack else f"{i}.{path}", type(mod).__name__, _kind(mod)))
    return found


def describe(mixers: list[Mixer]) -> list[str]:
    """One line per mixer, as ``Explanation.extra["mixers_left_out"]`` records them."""
    return [m.describe() for m in mixers]


def check_mixers(model: nn.Module, mode: str, method: str) -> list[Mixer]:
    """The model's token mixers other than softmax attention that ``method``'s map leaves out.

    A mixer attnroll composes (:data:`COMPOSED`) is a layer of the record: methods of :data:`COMPOSING_METHODS`
    compose it; any other method refuses the model naming it (UnsupportedModelError), whatever ``mode``. Other
    mixers: with ``mode`` "compose" the model is refused naming the first one and the option that rolls out
    through attention alone; with "attention_only" they are returned, for the caller to record and warn about.
    With "attention_only" the composed mixers are returned too (their layers are dropped from the record:
    ``record.extra["mixer_layers"]``), except those joined with attention in one layer (:data:`WIRED`), refused."""
    mode = _checks.check_choice("mixers", mode, MODES)
    found = find_mixers(model)
    composed = [m for m in found if m.cls in COMPOSED]
    if mode == "attention_only" and composed:  # the composed mixers are left out as well: attention alone
        wired = next((m for m in composed if m.cls in WIRED), None)
        if wired is not None:
            raise _checks.UnsupportedModelError(
                f"mixers='attention_only' cannot leave out {type(model).__name__}'s {wired.kind} ({wired.cls} at "
                f"{wired.path}): its layers sum the mixer and attention paths into one matrix (capture/hybrids.py), "
                "so there is no attention-only layer to roll out; use mixers='compose'")
        return found
    weighted = method in GRADIENT_METHODS and all(m.cls in WEIGHTED for m in composed)
    if composed and method not in COMPOSING_METHODS and not weighted:
        m = next((m for m in composed if m.cls not in WEIGHTED), composed[0])
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} layer {m.layer} mixes tokens with a {m.kind} ({m.cls} at {m.path}), which "
            f"method {method!r} does not compose (it reads attention heads, their gradients or value vectors that "
            f"such a mixer does not have); methods that compose it: "
            f"{', '.join(COMPOSING_METHODS + (GRADIENT_METHODS if m.cls in WEIGHTED else ()))}"
        )
    left = [m for m in found if m.cls not in COMPOSED]
    if left and mode == "compose":
        m = left[0]
        more = f" (and {len(left) - 1} more mixer layers)" if len(left) > 1 else ""
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} layer {m.layer} mixes tokens with a {m.kind} ({m.cls} at {m.path}){more}, "
            f"which attnroll does not compose into method {method!r}'s map: the attention layers alone would leave "
            "out how those layers move information between tokens. Pass mixers='attention_only' to roll out "
            "through the attention layers alone (recorded in Explanation.extra['mixers'])."
        )
    return left


# ------------------------------------------------------------------------------- composed mixers
#: Mixer classes whose forward attnroll reads and composes (their matrix is checked against the layer's own
#: output on every pass): the Mamba-2 mixers of Mamba2, Bamba, Nemotron-H and GraniteMoeHybrid, and the
#: Mamba mixers of Mamba, Falcon-Mamba and Jamba, the gated short convolutions of LFM2 / LFM3, Qwen3-Next's gated
#: DeltaNet; and those of :data:`HYBRID_MIXERS`, read by attnroll.capture.hybrids (Falcon-H1's mixer runs in
#: parallel with attention, Zamba's / Zamba2's follow a shared attention block: capture/hybrids.py Wiring).
MAMBA2_MIXERS = ("Mamba2Mixer", "BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer")
#: The gated short convolutions of LFM2 / LFM3.
CONV_MIXERS = ("Lfm2ShortConv", "Lfm3ShortConv")
#: The gated DeltaNets read with Qwen3-Next's layout (in_proj_qkvz / in_proj_ba, a convolution over q, k, v).
DELTA_MIXERS = ("Qwen3NextGatedDeltaNet",)
#: Mixers read by attnroll.capture.hybrids: Qwen3.5's and OLMo-Hybrid's gated DeltaNets, Kimi Linear's KDA,
#: RecurrentGemma's recurrent block, Falcon-H1's parallel Mamba-2 mixer, Zamba's / Zamba2's Mamba / Mamba-2 mixers.
HYBRID_MIXERS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet",
                 "KimiLinearDeltaAttention", "RecurrentGemmaRecurrentBlock", "FalconH1Mixer", "ZambaMambaMixer",
                 "Zamba2MambaMixer")
#: Composed mixers whose layer joins attention in one matrix (parallel branches, a shared attention block).
WIRED = ("FalconH1Mixer", "ZambaMambaMixer", "Zamba2MambaMixer")
COMPOSED = (*MAMBA2_MIXERS, "MambaMixer", "FalconMambaMixer", "JambaMambaMixer", *CONV_MIXERS, *DELTA_MIXERS,
            *HYBRID_MIXERS)
#: Methods that compose these mixers' fused matrices (the dense record: one row-stochastic layer each).
COMPOSING_METHODS = ("rollout", "raw", "flow")
#: Relative tolerance of the check that the matrices reproduce the layer's output.
_GUARD = 1e-4


def composable_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of the mixers attnroll composes, in module order."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in COMPOSED]


def _causal_conv(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The mixer's depthwise causal convolution of x (b, ch, n), before its activation."""
    conv = module.conv1d
    n = x.shape[-1]
    return F.conv1d(x, conv.weight, conv.bias, padding=conv.weight.shape[-1] - 1, groups=x.shape[1])[..., :n]


def _check_reproduces(module: nn.Module, got: torch.Tensor, output: torch.Tensor) -> None:
    scale = output.detach().abs().max().clamp_min(1e-30)
    err = (got - output.detach()).abs().max() / scale
    if not torch.isfinite(err) or err > _GUARD:
        import transformers

        raise _checks.CaptureError(
            f"attnroll's reading of {type(module).__name__} (its in_proj, causal convolution, scan and gate) does not "
            f"reproduce the layer's output under transformers {transformers.__version__} (relative error "
            f"{float(err):.2e}); this attnroll knows the transformers 5.x torch path of that mixer"
        )


@dataclass
class MixerParts:
    """A composed mixer's reading, per channel c: y[:, :, c] = K_c · x_in[:, :, c] (+ what no token gives: a
    convolution bias), K_c = M_{h(c)} · diag(gate_in_c) · T_c with M (b, H, n, n) per head (``heads_of`` channels
    each; per channel when 1), T_c the causal convolution of ``weight`` (C, K) and gate_in (b, n, C) the SiLU's
    sigmoid held; without ``weight`` K_c = M_c. ``post`` maps y (b, n, C) to the module's output."""

    M: torch.Tensor
    heads_of: int
    x_in: torch.Tensor
    y: torch.Tensor
    post: Any
    gate_in: torch.Tensor | None = None
    weight: torch.Tensor | None = None


#: How a mixer's causal convolution enters its layer's fused matrix (core.mixers.CONVOLUTIONS): "apart" (default;
#: Σ_c |M_{h(c)}| · |diag(σ(u_c)) · T_c|, the convolution one more operator composed after |·|) or "folded"
#: (Σ_c |M_{h(c)} · diag(σ(u_c)) · T_c|). Read on every reading, by the dense record and the rows-only layers
#: alike; benchmarks/state_space_evidence.py compares the two (docs/methods.md).
CONVOLUTION = "apart"


def _fold(p: MixerParts, g_y: torch.Tensor | None = None, clamp: str = "per_head") -> torch.Tensor:
    """Σ_c |K_c| over channels, (b, n, n) (with a convolution, as :data:`CONVOLUTION` says: apart, Σ_c |M_{h(c)}| ·
    |diag(gate_in_c) T_c|, or folded); with the gradient g_y (b, n, C) of a target with respect to y, the
    gradient-weighted Σ_c (K_c ⊙ ∂y/∂K_c)^+ (``clamp`` "per_head": each channel's positive part) or
    Σ_c K_c ⊙ ∂y/∂K_c (``clamp`` "after_mean", the caller clamps), ∂y/∂K_c[t, s] = g_y[t, c] · x_in[s, c]."""
    if g_y is None and p.weight is not None and CONVOLUTION == "apart":
        return ops.fold_rows(p.M, p.gate_in, p.weight, p.heads_of, "apart")
    b, G, n, _ = p.M.shape
    total = p.M.new_zeros(b, n, n)
    T = None if p.weight is None else ops.conv_matrix(p.weight.to(p.M.dtype), n)[0]  # (C, n, n)
    step = p.heads_of if T is not None or p.heads_of > 1 else G  # per head; all channels at once without a conv
    for c0 in range(0, G * p.heads_of, step):
        c1 = c0 + step
        if T is None:
            K = p.M[:, c0:c1] if p.heads_of == 1 else p.M[:, c0 // p.heads_of, None].expand(-1, step, -1, -1)
        else:
            h = c0 // p.heads_of
            K = (p.M[:, h, None] * p.gate_in[:, :, c0:c1].transpose(1, 2)[:, :, None, :]) @ T[c0:c1]
        if g_y is None:
            total += K.abs().sum(1)
            continue
        Q = K * g_y[:, :, c0:c1].transpose(1, 2)[..., :, None] * p.x_in[:, :, c0:c1].transpose(1, 2)[..., None, :]
        total += (Q.clamp(min=0) if clamp == "per_head" else Q).sum(1)
    return total


def _normalised(total: torch.Tensor) -> torch.Tensor:
    s = total.sum(-1, keepdim=True)
    return (total / torch.where(s > 0, s, torch.ones((), dtype=s.dtype, device=s.device)))[:, None]


@dataclass
class SSDGates:
    """What a Mamba-2 mixer's scan read on one pass: its value x (b, n, H, P) after the convolution and SiLU, the
    SSD gates (C, B: (b, n, H, N) repeated to heads; dt: (b, n, H) after softplus and clamping; A, D: (H,)), the
    output gate z (b, n, I), the convolution's pre-activation u of x's channels (b, n, I) and its weight (I, K)."""

    x: torch.Tensor
    C: torch.Tensor
    B: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    z: torch.Tensor
    u: torch.Tensor
    weight: torch.Tensor

    def block(self, t0: int, t1: int) -> torch.Tensor:
        """Rows [t0, t1) of the per-head SSD matrices (core.mixers.ssd_block), for core.mixers.fused_rows."""
        return ops.ssd_block(self.C, self.B, self.dt, self.A, self.D, t0, t1, causal_cols=True)


def mamba2_gates(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None = None,
                 projected: torch.Tensor | None = None) -> SSDGates:
    """A Mamba-2 mixer's :class:`SSDGates` from its input ``hidden`` (b, n, d) as its torch path computes them;
    ``projected``: its ``in_proj`` output of that same pass (b, n, I + conv + H, what :class:`InProjTap` keeps),
    read instead of recomputing the projection. Without a mask nothing is multiplied by ones (same values); C and
    B are compact copies (a kept gate does not hold the whole convolution output alive)."""
    b, n, _ = hidden.shape
    I, H, P, G, N = (module.intermediate_size, module.num_heads, module.head_dim, module.n_groups,
                     module.ssm_state_size)
    keep = None if mask is None else _keep(hidden, mask)
    if projected is None:
        projected = module.in_proj(hidden if keep is None else hidden * keep)
    gate, xbc, dt = projected.split([I, module.conv_dim, H], dim=-1)
    u = _causal_conv(module, xbc.transpose(1, 2)).transpose(1, 2)
    act = F.silu(u)
    x, B, C = (act if keep is None else act * keep).split([I, G * N, G * N], dim=-1)
    lo, hi = module.time_step_limit
    return SSDGates(x=x.reshape(b, n, H, P), C=_to_heads(C.reshape(b, n, G, N).contiguous(), H),
                    B=_to_heads(B.reshape(b, n, G, N).contiguous(), H),
                    dt=torch.clamp(F.softplus(dt + module.dt_bias), lo, hi),
                    A=-torch.exp(module.A_log.float()).to(hidden.dtype), D=module.D.to(hidden.dtype), z=gate,
                    u=u[..., :I] if keep is None else u[..., :I] * keep, weight=module.conv1d.weight[:I, 0])


def _to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, n, G, N) groups repeated to (b, n, heads, N), each group over heads // G consecutive heads: a view
    when there is one group (repeat_interleave's values, no copy)."""
    G = t.shape[2]
    if G == heads:
        return t
    if G == 1:
        return t.expand(-1, -1, heads, -1)
    return t.repeat_interleave(heads // G, 2)


class InProjTap:
    """A forward hook on a Mamba-2 mixer's ``in_proj`` that keeps the projection of the mixer's current pass, so
    that its gates are read off the mixer's own product (:func:`mamba2_gates` ``projected``) instead of
    recomputing it. :meth:`take` hands it over once, only when that projection's input is the mixer's input as
    :func:`mamba2_gates` would project it (the same tensor, or equal values: a padded single row that the
    mixer does not mask, another layout whose ``in_proj`` saw something else, a mixer without an ``in_proj``
    module or outside :data:`MAMBA2_MIXERS` (Falcon-H1 scales its projection) gives None: the caller recomputes)."""

    def __init__(self, module: nn.Module):
        proj = getattr(module, "in_proj", None)  # hooked on the mixers of MAMBA2_MIXERS alone (their raw in_proj)
        self._seen: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handle = (proj.register_forward_hook(self._keep)
                        if isinstance(proj, nn.Module) and type(module).__name__ in MAMBA2_MIXERS else None)

    def _keep(self, _m: nn.Module, args: tuple, out: Any) -> None:
        self._seen = (args[0], out) if args and isinstance(out, torch.Tensor) else None

    def take(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The kept projection if its input was ``hidden`` masked by ``mask`` (b, n) as :func:`mamba2_gates`
        masks it; else None. Forgets it either way."""
        seen, self._seen = self._seen, None
        if seen is None:
            return None
        inp, out = seen
        if inp.shape != hidden.shape or out.shape[:-1] != hidden.shape[:-1]:
            return None
        whole = mask is None or bool(mask.all())
        if (inp is hidden and whole) or torch.equal(inp, hidden if mask is None else hidden * _keep(hidden, mask)):
            return out
        return None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._seen = None


def _keep(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return torch.ones(*hidden.shape[:2], 1, dtype=hidden.dtype, device=hidden.device)
    return mask[:, :, None].to(hidden.dtype)


def _mamba2(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor:
    """Mamba2Mixer: x = SiLU(conv(x_in)) per channel, y = SSD(x) per head (core.mixers.ssd_matrix), out =
    out_proj(RMSNorm(y · SiLU(z))). Returns the fused (b, 1, n, n) matrix of x_in → y, the conv and the SiLU
    (its sigmoid held) folded per channel."""
    return _normalised(_fold(_mamba2_parts(module, hidden, mask, output)))


def _mamba2_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                  output: torch.Tensor) -> "MixerParts":
    """:class:`MixerParts` of a Mamba2Mixer (see :func:`_mamba2`), checked to reproduce its output."""
    g = mamba2_gates(module, hidden, mask)
    b, n, H, P = g.x.shape
    M = ops.ssd_matrix(g.C, g.B, g.dt, g.A, g.D)
    y = ops.mix(M, g.x).reshape(b, n, H * P)
    post = lambda y: module.out_proj(module.norm(y, g.z))  # noqa: E731
    _check_reproduces(module, post(y), output)
    keep = _keep(hidden, mask)
    x_in = module.in_proj(hidden * keep)[..., g.z.shape[-1]:g.z.shape[-1] + H * P]
    return MixerParts(M=M, heads_of=P, x_in=x_in, y=y, post=post, gate_in=torch.sigmoid(g.u) * keep,
                      weight=g.weight)


def _mamba(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor:
    """MambaMixer / FalconMambaMixer: x = SiLU(conv(x_in)), y_d = SiLU(z_d) · selective scan_d(x) per channel
    (core.mixers.selective_matrix; Falcon-Mamba normalises Δ, B, C first). Returns the fused (b, 1, n, n)
    matrix of x_in → y, the conv, the SiLU (its sigmoid held) and the output gate folded per channel."""
    return _normalised(_fold(_mamba_parts(module, hidden, mask, output)))


def _mamba_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                 output: torch.Tensor) -> "MixerParts":
    """:class:`MixerParts` of a MambaMixer / FalconMambaMixer (see :func:`_mamba`), checked against its output."""
    g = _mamba_gates(module, hidden, mask)
    M = ops.selective_matrix(g["C"], g["B"], g["dt"], g["A"], g["D"])  # (b, I, n, n)
    M = M * F.silu(g["z"]).transpose(1, 2)[:, :, :, None]  # the output gate, a diagonal on the rows
    y = ops.mix(M, g["x"])
    _check_reproduces(module, module.out_proj(y), output)
    return MixerParts(M=M, heads_of=1, x_in=g["x_in"], y=y, post=module.out_proj, gate_in=g["gate_in"],
                      weight=module.conv1d.weight[:, 0])


def _mamba_gates(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A MambaMixer's / FalconMambaMixer's reading: its value input x_in, output gate z, x = SiLU(conv(x_in)),
    the selective scan's C, B (b, n, N), Δ (b, n, I) after softplus, A (I, N), D (I,) and the SiLU's σ(u)."""
    N, R = module.ssm_state_size, module.time_step_rank
    keep = _keep(hidden, mask)
    x_in, z = module.in_proj(hidden * keep).chunk(2, dim=-1)
    u = _causal_conv(module, x_in.transpose(1, 2)).transpose(1, 2)
    x = F.silu(u) * keep
    ts, B, C = module.x_proj(x).split([R, N, N], dim=-1)
    for name, t in (("dt_layernorm", "ts"), ("b_layernorm", "B"), ("c_layernorm", "C")):
        norm = getattr(module, name, None)
        if norm is not None:
            ts, B, C = (norm(v) if k == t else v for k, v in (("ts", ts), ("B", B), ("C", C)))
    dt = F.softplus(ts @ module.dt_proj.weight.T + module.dt_proj.bias)
    A = -torch.exp(module.A_log.float()).to(hidden.dtype)
    return dict(x_in=x_in, z=z, x=x, C=C, B=B, dt=dt, A=A, D=module.D.to(hidden.dtype),
                gate_in=torch.sigmoid(u) * keep)


def _short_conv(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                output: torch.Tensor) -> torch.Tensor:
    """LFM2's gated short convolution: B, C, x = in_proj(h); y = out_proj(C · conv(B · x)). Returns the fused
    (b, 1, n, n) matrix of x → C · conv(B · x) per channel (core.mixers.conv_matrix, B and C as diagonals)."""
    return _normalised(_fold(_short_conv_parts(module, hidden, mask, output)))


def _short_conv_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                      output: torch.Tensor) -> "MixerParts":
    """:class:`MixerParts` of a gated short convolution (see :func:`_short_conv`), checked against its output."""
    n = hidden.shape[1]
    pre, post, x = _short_conv_gates(module, hidden, mask)
    M = ops.conv_matrix(module.conv.weight[:, 0], n, pre=pre, post=post)  # (b, d, n, n)
    bias = 0 if module.conv.bias is None else module.conv.bias
    y = ops.mix(M, x) + post * bias
    _check_reproduces(module, module.out_proj(y), output)
    return MixerParts(M=M, heads_of=1, x_in=x, y=y, post=module.out_proj)


def _short_conv_gates(module: nn.Module, hidden: torch.Tensor,
                      mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gated short convolution's input gate B (padding zeroed), output gate C and value x, each (b, n, d)."""
    keep = _keep(hidden, mask)
    Bg, Cg, x = module.in_proj(hidden * keep).chunk(3, dim=-1)
    return Bg * keep, Cg, x


def _l2(x: torch.Tensor) -> torch.Tensor:
    """The delta rule's L2 normalisation: x / √(Σx² + 1e-6) (not max(‖x‖, eps))."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _gated_delta(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                 output: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's gated DeltaNet: q, k, v = SiLU(conv(·)) of in_proj_qkvz's parts, q and k L2-normalised (q
    scaled by 1/√d_k), β = σ(b), log α = −exp(A_log)·softplus(a + dt_bias); o = the delta rule
    (core.mixers.delta_matrix per value head), out = out_proj(RMSNorm(o) · SiLU(z)). Returns the fused (b, 1, n, n)
    matrix of v_in → o, the convolution and the SiLU (its sigmoid held) folded per value channel."""
    return _normalised(_fold(_gated_delta_parts(module, hidden, mask, output)))


def _gated_delta_parts(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None,
                       output: torch.Tensor) -> "MixerParts":
    """:class:`MixerParts` of Qwen3-Next's gated DeltaNet (see :func:`_gated_delta`), checked against its output."""
    b, n, _ = hidden.shape
    g = _delta_gates(module, hidden, mask)
    Hv, dv = module.num_v_heads, module.head_v_dim
    W = ops.delta_matrix(g["q"], g["k"], g["beta"], g["g"])  # (b, Hv, n, n)
    o = ops.mix(W, g["v"].reshape(b, n, Hv, dv)).reshape(b, n, Hv * dv)
    z = g["z"]
    post = lambda o: module.out_proj(  # noqa: E731
        module.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, n, -1))
    _check_reproduces(module, post(o), output)
    return MixerParts(M=W, heads_of=dv, x_in=g["v_in"], y=o, post=post, gate_in=g["gate_in"], weight=g["weight"])


def _delta_gates(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Qwen3-Next's gated DeltaNet read from its input: q, k (b, n, Hv, dk) as the delta rule reads them, β, the log
    decay g (b, n, Hv), the value v = SiLU(conv(v_in)), its input v_in, the output gate z, the SiLU's σ(u) on the
    value channels and their convolution weight."""
    b, n, _ = hidden.shape
    keep = _keep(hidden, mask)
    h = hidden * keep
    q, k, v, z, bb, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h), module.in_proj_ba(h))
    mixed = torch.cat([t.reshape(b, n, -1) for t in (q, k, v)], dim=-1)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return {**_delta_inputs(module, mixed, bb.sigmoid(), g.to(hidden.dtype), keep), "z": z}


def _delta_inputs(module: nn.Module, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                  keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """A delta rule's inputs from its convolution's input ``mixed`` (b, n, 2·key_dim + value_dim: q, k, v), β
    (b, n, Hv) and the log decay g: q, k (b, n, Hv, dk) L2-normalised (q scaled by 1/√d_k, key heads repeated to
    the value heads), v = SiLU(conv(v_in)), v_in, the SiLU's σ(u) on the value channels and their conv weight."""
    b, n, _ = mixed.shape
    u = _causal_conv(module, mixed.transpose(1, 2)).transpose(1, 2)
    dk = getattr(module, "head_k_dim", None) or module.head_dim
    key_dim = getattr(module, "key_dim", None) or module.qkv_dim
    q, k, v = F.silu(u).split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    Hv, Hk = beta.shape[-1], key_dim // dk
    q = _l2(q.reshape(b, n, Hk, dk)).repeat_interleave(Hv // Hk, 2) * dk ** -0.5
    k = _l2(k.reshape(b, n, Hk, dk)).repeat_interleave(Hv // Hk, 2)
    start = 2 * key_dim
    return dict(q=q, k=k, beta=beta.to(mixed.dtype), g=g.to(mixed.dtype), v=v, v_in=mixed[..., start:],
                gate_in=torch.sigmoid(u[..., start:]) * keep, weight=module.conv1d.weight[start:, 0])


def _hook_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A mixer's forward-hook input: its hidden states and its (b, n) padding mask (None for any other mask)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    mask = kwargs.get("attention_mask")
    return hidden, mask if mask is not None and mask.ndim == 2 else None


def mixer_matrix(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    """The fused (b, 1, n, n) token-to-token matrix of a composed mixer's forward (its forward hook's args,
    kwargs and output), checked to reproduce the layer's output; row-stochastic (the "abs_mean" fusion)."""
    hidden, mask = _hook_inputs(args, kwargs)
    out = output[0] if isinstance(output, (tuple, list)) else output
    with torch.no_grad():
        name = type(module).__name__
        read = (_mamba2 if name in MAMBA2_MIXERS else _short_conv if name in CONV_MIXERS else
                _gated_delta if name in DELTA_MIXERS else _mamba)
        return read(module, hidden.detach(), mask, out)


# ------------------------------------------------------------------------------- gradient-weighted mixers
#: Methods that compose a mixer's gradient-weighted matrix (:func:`mixer_reading`), for the classes of
#: :data:`WEIGHTED`: Ā = mean_c((K_c ⊙ ∂y/∂K_c)^+) per layer, Chefer's rule on the mixer's per-channel matrices.
GRADIENT_METHODS = ("grad_rollout", "gae")
_PARTS = {**{c: _mamba2_parts for c in MAMBA2_MIXERS}, "MambaMixer": _mamba_parts, "FalconMambaMixer": _mamba_parts,
          "JambaMambaMixer": _mamba_parts, **{c: _short_conv_parts for c in CONV_MIXERS},
          **{c: _gated_delta_parts for c in DELTA_MIXERS}}
#: Mixer classes whose gradient-weighted matrix attnroll computes: these, and those of :data:`HYBRID_MIXERS`
#: (their parts read by attnroll.capture.hybrids, whose ``mixer_reading`` takes every class of this tuple).
WEIGHTED = (*_PARTS, *HYBRID_MIXERS)


def mixer_reading(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, Any]:
    """A composed mixer's fused (b, 1, n, n) matrix (as :func:`mixer_matrix`) and ``(out, weigh)``: the module's
    output tensor (differentiate the target with respect to it) and ``weigh(g_out, clamp)`` -> (b, n, n), the
    layer's gradient-weighted matrix from that gradient g_out (b, n, d):

    Ā = mean_c((K_c ⊙ G_c)^+) ("per_head") or (mean_c(K_c ⊙ G_c))^+ ("after_mean"), K_c the channel's matrix of
    x_in → y (:class:`MixerParts`) and G_c[t, s] = ∂target/∂K_c[t, s] = (∂target/∂y)[t, c] · x_in[s, c], with
    ∂target/∂y the vector-Jacobian product of the module's own output map (``MixerParts.post``) at y."""
    hidden, mask = _hook_inputs(args, kwargs)
    out = output[0] if isinstance(output, (tuple, list)) else output
    with torch.no_grad():
        parts = _PARTS[type(module).__name__](module, hidden.detach(), mask, out)
    return weighted_reading(parts, out)


def weighted_reading(parts: MixerParts, out: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """:func:`mixer_reading`'s answer from a mixer's :class:`MixerParts` and its output tensor ``out``."""
    with torch.no_grad():
        fused = _normalised(_fold(parts))

    def weigh(g_out: torch.Tensor, clamp: str) -> torch.Tensor:
        with torch.enable_grad():
            y = parts.y.detach().requires_grad_(True)
            (g_y,) = torch.autograd.grad(parts.post(y), y, g_out.to(y.dtype))
        with torch.no_grad():
            W = _fold(parts, g_y, clamp) / parts.y.shape[-1]
        return W if clamp == "per_head" else W.clamp(min=0)

    return fused, (out, weigh)


# ------------------------------------------------------------------------------- rows-only mixers
#: Mixer classes with a rows-only form (the matrix-free route of ``rollout``, core.mixers.MixerRows): the Mamba-2
#: mixers, the Mamba mixers, the gated short convolutions, the gated DeltaNets / KDA and RecurrentGemma's RG-LRU
#: block; not the mixers joined with attention in one layer (:data:`WIRED`).
#: The gated DeltaNets / KDA of capture/hybrids.py's layouts (Qwen3.5, OLMo-Hybrid, Kimi Linear).
HYBRID_DELTAS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet",
                 "KimiLinearDeltaAttention")
ROWS_MIXERS = (*MAMBA2_MIXERS, "MambaMixer", "FalconMambaMixer", "JambaMambaMixer", *CONV_MIXERS, *DELTA_MIXERS,
               *HYBRID_DELTAS, "RecurrentGemmaRecurrentBlock")


def _hybrid_delta_gates(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The delta-rule inputs (:func:`_delta_inputs`) of Qwen3.5's / OLMo-Hybrid's gated DeltaNets and Kimi Linear's
    KDA, read from their projections as capture/hybrids.py's readers do (OLMo-Hybrid's β doubled when negative
    eigenvalues are allowed; KDA's per-key-channel forget gate)."""
    keep = _keep(hidden, mask)
    h = hidden * keep
    name = type(module).__name__
    if name.startswith("Qwen3_5"):
        g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(h).float() + module.dt_bias)
        return _delta_inputs(module, module.in_proj_qkv(h), module.in_proj_b(h).sigmoid(), g, keep)
    mixed = torch.cat([module.q_proj(h), module.k_proj(h), module.v_proj(h)], dim=-1)
    if name == "KimiLinearDeltaAttention":
        return _delta_inputs(module, mixed, torch.sigmoid(module.b_proj(h)), module.forget_gate(h), keep)
    beta = module.b_proj(h).sigmoid() * (2.0 if module.allow_neg_eigval else 1.0)
    g = -module.A_log.float().exp() * F.softplus(module.a_proj(h).float() + module.dt_bias)
    return _delta_inputs(module, mixed, beta, g, keep)


def rg_lru_gates(module: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """RecurrentGemma's recurrent block's inputs and held gates: ``x_in`` = linear_x(h), ``x`` its causal
    convolution, ``y`` = GeLU(linear_y(h)) (the output branch), the RG-LRU's ``log_a`` (−8 r_t softplus(Λ), 0 at a
    restart) and input ``scale`` (i_t · √(1 − a_t²), i_t at a restart), and ``reset`` (b, n, d): position 0."""
    b, n, _ = hidden.shape
    lru = module.rg_lru
    y = module.act_fn(module.linear_y(hidden))
    x_in = module.linear_x(hidden)
    x = module.conv_1d(x_in.transpose(1, 2))[..., :n].transpose(1, 2)
    act = x.reshape(b, n, lru.num_attention_heads, lru.block_width)
    i_gate = torch.sigmoid(torch.einsum("bnhi,hij->bnhj", act, lru.input_gate_weight) + lru.input_gate_bias)
    r_gate = torch.sigmoid(torch.einsum("bnhi,hij->bnhj", act, lru.recurrent_gate_weight) + lru.recurrent_gate_bias)
    log_a = (-8.0 * r_gate.reshape(b, n, -1) * F.softplus(lru.recurrent_param)).to(hidden.dtype)
    if position_ids is None:
        position_ids = torch.arange(n, device=hidden.device)[None].expand(b, n)
    reset = (position_ids == 0)[:, :, None].expand_as(log_a)
    scale = i_gate.reshape(b, n, -1) * torch.where(reset, torch.ones_like(log_a), torch.sqrt(1 - torch.exp(2 * log_a)))
    return {"x_in": x_in, "x": x, "y": y, "log_a": log_a.masked_fill(reset, 0.0), "scale": scale, "reset": reset}


def _rg_lru_rows(module: nn.Module, args: tuple, kwargs: dict, heads: int) -> ops.LRURows:
    """RecurrentGemma's recurrent block as core.mixers.LRURows (:func:`rg_lru_gates`; a restart where the
    position is 0: no path across it), the output branch GeLU(linear_y(h)) on the rows, the convolution folded."""
    hidden = args[0] if args else kwargs.get("input_states", kwargs.get("hidden_states"))
    position_ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
    g = rg_lru_gates(module, hidden, position_ids)
    return ops.LRURows(g["log_a"], g["scale"], g["y"], module.conv_1d.weight[:, 0],
                       segment=g["reset"][..., 0].to(torch.int64).cumsum(1), heads=heads)


def rows_layer(module: nn.Module, args: tuple, kwargs: dict, heads: int = 1,
               tap: InProjTap | None = None) -> ops.MixerRows:
    """A composed mixer's layer of the matrix-free row sweep (core.mixers.MixerRows) from its forward hook's args
    and kwargs: its gates, O(n·d) kept (a gated DeltaNet's state scan O(n·d_k) per head); the same fused matrix as
    :func:`mixer_matrix` (the convolution as :data:`CONVOLUTION` says), applied row block by row block. Classes of
    :data:`ROWS_MIXERS` only. ``tap``: a Mamba-2 mixer's :class:`InProjTap`, its gates read off its own in_proj
    output (else recomputed)."""
    lay = _rows_layer(module, args, kwargs, heads, tap)
    lay.convolution = _checks.check_choice("convolution", CONVOLUTION, ops.CONVOLUTIONS)
    return lay


def _rows_layer(module: nn.Module, args: tuple, kwargs: dict, heads: int, tap: InProjTap | None) -> ops.MixerRows:
    name = type(module).__name__
    if name == "RecurrentGemmaRecurrentBlock":
        with torch.no_grad():
            return _rg_lru_rows(module, tuple(a.detach() if torch.is_tensor(a) else a for a in args), kwargs, heads)
    hidden, mask = _hook_inputs(args, kwargs)
    projected = None if tap is None or name not in MAMBA2_MIXERS else tap.take(hidden, mask)
    with torch.no_grad():
        hidden = hidden.detach()
        if name in MAMBA2_MIXERS:
            g = mamba2_gates(module, hidden, mask, None if projected is None else projected.detach())
            return ops.SSDRows(g.C, g.B, g.dt, g.A, g.D, torch.sigmoid(g.u) * _keep(hidden, mask), g.weight,
                               heads=heads)
        if name in CONV_MIXERS:
            pre, post, _ = _short_conv_gates(module, hidden, mask)
            return ops.ConvRows(module.conv.weight[:, 0], pre, post, heads=heads)
        if name in DELTA_MIXERS or name in HYBRID_DELTAS:
            d = (_delta_gates if name in DELTA_MIXERS else _hybrid_delta_gates)(module, hidden, mask)
            return ops.DeltaRows(d["q"], d["k"], d["beta"], d["g"], d["gate_in"], d["weight"], heads=heads)
        if name in ROWS_MIXERS:
            m = _mamba_gates(module, hidden, mask)
            return ops.SelectiveRows(m["C"], m["B"], m["dt"], m["A"], m["D"], F.silu(m["z"]), m["gate_in"],
                                     module.conv1d.weight[:, 0], heads=heads)
    raise _checks.UnsupportedModelError(
        f"{name} has no rows-only form in this attnroll (those that have: {', '.join(ROWS_MIXERS)}); "
        "use attention='dense'")
