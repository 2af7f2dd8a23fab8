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

from torch import nn

from .. import _checks

__all__ = ["Mixer", "MixerKind", "KNOWN_MIXERS", "MODES", "find_mixers", "check_mixers", "describe"]

#: The ``mixers=`` option: "compose" (default) composes every token mixer, refusing a model whose mixers attnroll
#: cannot compose; "attention_only" rolls out through the attention layers alone (a partial map, recorded in
#: ``Explanation.extra["mixers"]`` and warned about).
MODES = ("compose", "attention_only")


@dataclass(frozen=True)
class MixerKind:
    """A known kind of token mixer: the class names it has (a regular expression searched in the class name),
    how texts call it, and the models it is found in (README's refused row)."""

    pattern: str
    kind: str
    models: str


#: The mixer kinds of the transformers families (the registry's ``TRANSFORMERS`` entry lists them), tried in order.
KNOWN_MIXERS = (
    MixerKind(r"DeltaNet|DeltaAttention", "gated DeltaNet (linear attention with a delta-rule state)",
              "Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi-Linear, Bailing-Hybrid"),
    MixerKind(r"LightningAttention", "lightning attention (linear attention with a decaying state)", "MiniMax"),
    MixerKind(r"ShortConv", "short causal convolution (gated)", "LFM2"),
    MixerKind(r"RecurrentBlock|Rglru", "RG-LRU recurrent block (convolution + real-gated linear recurrence)",
              "RecurrentGemma"),
    MixerKind(r"Mamba2Mixer|^(Bamba|FalconH1)Mixer$|^Zamba2MambaMixer$|^GraniteMoeHybridMambaLayer$",
              "Mamba-2 (SSD) mixer", "Bamba, Zamba2, Falcon-H1, GraniteMoeHybrid, Nemotron-H"),
    MixerKind(r"Mamba(Mixer|Layer)$|MambaMixer", "Mamba (selective state-space) mixer", "Jamba, Zamba"),
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
    """The model's token mixers other than softmax attention. With ``mode`` "compose" a model that has any is
    refused (UnsupportedModelError naming the first mixer and the option that rolls out through attention
    alone); with "attention_only" they are returned, for the caller to record and warn about."""
    mode = _checks.check_choice("mixers", mode, MODES)
    mixers = find_mixers(model)
    if mixers and mode == "compose":
        m = mixers[0]
        more = f" (and {len(mixers) - 1} more mixer layers)" if len(mixers) > 1 else ""
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} layer {m.layer} mixes tokens with a {m.kind} ({m.cls} at {m.path}){more}, "
            f"which attnroll does not compose into method {method!r}'s map: the attention layers alone would leave "
            "out how those layers move information between tokens. Pass mixers='attention_only' to roll out "
            "through the attention layers alone (recorded in Explanation.extra['mixers'])."
        )
    return mixers
