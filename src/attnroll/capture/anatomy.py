"""The layer anatomy of a model: its stack of blocks and its head, each block described by the first block kind
of the family registry that recognises it by its structure (never by the model's class name).

The builders of each block kind live beside their family's adapter (``hf_anatomy.py``, ``timm.py``,
``torch_mha.py``) and the family registry (``registry.py``) lists their :class:`BlockKind` records in the
order they are tried. This module holds the generic machinery: the probe over a model's modules, the checks
that refuse a block or model the anatomy would describe wrongly, and structural finders.

:func:`anatomy` returns the model's :class:`~attnroll.capture.layers.ModelAnatomy` (head included);
:func:`layer_anatomy` one block's. :func:`find_blocks` / :func:`find_head` are structural finders (a stack
of identical blocks, the module producing the logits) for any model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _checks
from . import registry
from .anatomy_parts import BlockKind
from .layers import RESET, Experts, LayerAnatomy, ModelAnatomy, Target, norm_params

__all__ = ["anatomy", "anatomy_or_reason", "layer_anatomy", "find_blocks", "find_head", "component_parameters",
           "KNOWN_FAMILIES", "VALUE_AWARE_FAMILIES", "Target", "RESET"]


def _by_family(text: Any) -> str:
    """A text over the registry's block kinds, grouped by family: "transformers a, b; timm c; torch d"."""
    groups = []
    for family in registry.FAMILIES:
        items = [text(k) for k in family.blocks if text(k)]
        if items:
            groups.append(f"{family.name} {', '.join(items)}")
    return "; ".join(groups)


#: The blocks the layer anatomy describes (named in its refusals).
KNOWN_FAMILIES = _by_family(lambda k: k.label)
#: The blocks the value-aware methods read.
VALUE_AWARE_FAMILIES = _by_family(lambda k: k.value_aware)
#: What a block must have for each block kind (named in the refusal of an unknown block).
_LOOKED_FOR_PARTS = ", ".join(k.parts for k in registry.block_kinds())
_LOOKED_FOR_BLOCKS = (
    "transformers' `encoder.layer` or `layers` (a ModuleList of identical layers), timm's `blocks`, or any "
    "nn.ModuleList / nn.Sequential of identical composite blocks with parameters"
)
_LOOKED_FOR_HEAD = (
    "a `classifier` (transformers) or `head` (timm) module with parameters, or an nn.Linear outside the blocks"
)


# ------------------------------------------------------------------------------------------- block kinds
def _kind(m: nn.Module) -> BlockKind | None:
    """Which block kind ``m`` is, from its structure (None: not a block attnroll knows): the registry's
    kinds in order, the first match wins."""
    return next((k for k in registry.block_kinds() if k.matches(m)), None)


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
        layer = kind.build(index, path, block)
    except (AttributeError, TypeError, ValueError) as e:
        if kind.refused:  # a block kind recognised only to be refused, naming why
            raise _checks.UnsupportedModelError(f"{name} ({kind.label}): {kind.refused}") from None
        raise _checks.UnsupportedModelError(
            f"{name} looks like a {kind.name} block but lacks a part the layer anatomy reads ({e}). "
            f"Known families: {KNOWN_FAMILIES}"
        ) from None
    _check_layer(layer, kind.name)
    return layer


#: Parameters a builder may leave unplaced: they only shape the attention probabilities (captured as such).
_SCORE_ONLY = ("distance_embedding", "relative_position", "rel_pos", "relative_attention_bias",
               "self_attn.sinks",  # GPT-OSS's per-head sink logits: they take a share of each softmax row
               "self_attn.q_a_proj")  # multi-head latent attention's query compression: queries only


def _check_layer(layer: LayerAnatomy, family: str) -> None:
    """Refuse (UnsupportedModelError) a block the anatomy would describe wrongly: a parameter that no part
    of the anatomy places (an extra branch, norm or convolution), a norm that does not compute what its
    arrays say (e.g. Gemma's x ⊙ (1 + γ)), or a residual scaled by a multiplier."""
    name = type(layer.module).__name__
    if any(p.is_meta for p in layer.module.parameters()):
        raise _checks.UnsupportedModelError(f"{name} is on the meta device: there are no weights to describe")
    latent = (layer.latent[0],) if layer.latent is not None else ()
    placed = {id(t[1]) for proj in (layer.q, layer.k, layer.v, layer.o, layer.fc1, layer.fc2, layer.gate,
                                     *(layer.cross or ()), *latent) if proj is not None for t in proj.targets()}
    if layer.experts is not None:  # a mixture of experts: its experts', router's and shared gate's parameters
        placed |= {id(t[1]) for proj in layer.experts.projections() for t in proj.targets()}
        gate = layer.experts.shared_gate
        placed |= {id(p) for p in gate.parameters()} if gate is not None else set()
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
    if layer.experts is not None and not _experts_match(layer.experts):
        raise _checks.UnsupportedModelError(
            f"{name}.{layer.experts.path} ({type(layer.experts.module).__name__}) does not compute the experts its "
            "weights describe (fc2(act(gate(h)) ⊙ up(h)) per expert, the gate rows first): the layer anatomy's "
            "arrays would be wrong"
        )
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


def _experts_match(experts: Experts) -> bool:
    """Whether the experts module, given one probe row per expert routed to that expert alone with weight 1,
    returns what each expert's arrays compute: W2 (coef ⊙ ζ + const) + b2 (:func:`~attnroll.core.value_aware.
    mlp_terms`; the first and last expert probed)."""
    from ..core.value_aware import mlp_terms

    mlps = experts.mlps(None, None)
    picked = sorted({0, len(experts.routed) - 1})
    w1 = mlps[0].w1
    h = torch.randn(len(picked), w1.shape[1], generator=torch.Generator().manual_seed(0)).to(w1)
    idx = torch.tensor(picked, device=w1.device).unsqueeze(1)
    try:
        with torch.no_grad():  # forward, not __call__: no hook of a running capture sees the probe
            got = experts.source.forward(h, idx, torch.ones(len(picked), 1, dtype=h.dtype, device=h.device))
    except Exception:  # noqa: BLE001  (an experts module that cannot run the probe is not one described here)
        return False
    want = []
    for row, e in enumerate(picked):
        m = mlps[e]
        zeta, coef, const = mlp_terms(m, h[row])
        out = (coef * zeta + (0 if const is None else const)) @ m.w2.T
        want.append(out if m.b2 is None else out + m.b2)
    return torch.allclose(got.to(torch.float64), torch.stack(want).to(torch.float64), atol=1e-4, rtol=1e-3)


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


# ------------------------------------------------------------------------------------------- the model
def _value_aware_reason(kind: BlockKind, layers: list[LayerAnatomy]) -> str:
    """Why the value-aware methods cannot use this anatomy ("" when they can)."""
    if kind.refused:
        return kind.refused
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


def _known_blocks(model: nn.Module) -> list[tuple[str, nn.Module, BlockKind]]:
    """(path, block, kind) of the outermost modules a block kind knows, in module order."""
    found: list[tuple[str, nn.Module, BlockKind]] = []
    inside: set[int] = set()
    for path, m in model.named_modules():
        if id(m) in inside:
            continue
        kind = _kind(m)
        if kind is not None:
            found.append((path, m, kind))
            inside.update(id(s) for s in m.modules())
    return found


def _refuse_unknown_stacks(model: nn.Module, found: list[tuple[str, nn.Module, BlockKind]]) -> None:
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
            f"{type(model).__name__} mixes block families ({', '.join(sorted(k.name for k in kinds))}); the "
            f"layer anatomy describes one stack of blocks. Known families: {KNOWN_FAMILIES}"
        )
    layers = [layer_anatomy(m, i, path) for i, (path, m, _) in enumerate(found)]
    kind = found[0][2]
    stack = found[0][0].rsplit(".", 1)[0] if "." in found[0][0] else ""
    reason = _value_aware_reason(kind, layers)
    try:
        fields, head_reason = kind.read_head(model, layers)
    except (AttributeError, TypeError) as e:  # a head laid out otherwise: no logit layer, with the reason
        fields, head_reason = {}, f"a {type(model).__name__} head the layer anatomy cannot read ({e})"
    try:
        head_path, head_module = find_head(model, stack)
    except ValueError:
        head_path, head_module = "", None
    if head_reason and not reason:
        fields["classifier"] = None
        head_reason = f"{head_reason}: decompx cannot decompose this head"
    return ModelAnatomy(family=kind.name, path=stack, layers=tuple(layers), head_path=head_path,
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
