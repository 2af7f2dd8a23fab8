"""What the family anatomy builders share: the :class:`BlockKind` record each family declares for the blocks
it knows, and the small readers a builder uses to fill a :class:`~attnroll.capture.layers.LayerAnatomy`
(projections, fused q/k/v thirds, norms, layer scales, head counts, the probe of a residual layout).

No family knowledge lives here: the builders themselves sit beside their adapters (``hf_anatomy.py``,
``timm.py``, ``torch_mha.py``) and the family registry (``registry.py``) lists their block kinds in the
order they are tried; ``anatomy.py`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .layers import LayerAnatomy, Proj

__all__ = ["BlockKind", "Builder", "HeadReader", "sub", "proj", "fused", "norms", "real_module", "heads_of",
           "block_scale", "probe_residual"]

#: ``build(index, path, block) -> LayerAnatomy``: one block's anatomy (raises AttributeError / TypeError /
#: ValueError when a part it reads is missing: the block is then refused naming the kind).
Builder = Callable[[int, str, nn.Module], LayerAnatomy]
#: ``head(model, layers) -> (ModelAnatomy head fields, why decompx cannot read the head or "")``.
HeadReader = Callable[[nn.Module, list[LayerAnatomy]], tuple[dict[str, Any], str]]


@dataclass(frozen=True, kw_only=True)
class BlockKind:
    """One kind of transformer block the layer anatomy knows, recognised by its structure (never by the
    model's class name).

    ``name``: :attr:`ModelAnatomy.family` of a model made of these blocks; ``matches(block)``: whether a
    module is such a block (the registry's kinds are tried in order, the first match wins); ``build``: its
    :class:`LayerAnatomy`; ``parts``: the parts it looks for, named when no kind knows a block; ``label``:
    the models it describes, for the "known families" text; ``value_aware``: how the value-aware methods
    read it (the "value-aware families" text), "" when they do not; ``refused``: why the value-aware methods
    refuse every model of this kind ("" when only the generic checks apply); ``head``: how the model's head
    is read (None: ``head_not_read`` says why it is not described, or there is no head to read)."""

    name: str
    matches: Callable[[nn.Module], bool]
    build: Builder
    parts: str
    label: str
    value_aware: str = ""
    refused: str = ""
    head: HeadReader | None = None
    head_not_read: str = ""

    def read_head(self, model: nn.Module, layers: list[LayerAnatomy]) -> tuple[dict[str, Any], str]:
        """(head fields, why decompx cannot read the head or "")."""
        if self.head is not None:
            return self.head(model, layers)
        if self.head_not_read:
            return {"readout": "first"}, f"the {self.name} head ({self.head_not_read}) is not described"
        return {}, ""


# ------------------------------------------------------------------------------------------- readers
def sub(block: nn.Module, path: str) -> nn.Module:
    """The module at dotted ``path`` inside ``block`` (AttributeError when a part is missing)."""
    mod = block
    for part in path.split("."):
        mod = getattr(mod, part)
    return mod


def proj(block: nn.Module, path: str, **kw: Any) -> Proj:
    """A projection at ``path`` inside ``block`` (bias None when the module has none)."""
    mod = sub(block, path)
    if not isinstance(getattr(mod, "bias", None), torch.Tensor) and "bias" not in kw:
        kw["bias"] = None
    return Proj(module=mod, path=path, **kw)


def fused(block: nn.Module, path: str, d: int, **kw: Any) -> tuple[Proj, Proj, Proj]:
    """q, k, v of a fused (3d, ...) projection: its row thirds."""
    return tuple(proj(block, path, rows=slice(i * d, (i + 1) * d), **kw) for i in range(3))  # type: ignore


def norms(block: nn.Module, paths: tuple[str, ...]) -> tuple[tuple[str, nn.Module], ...]:
    """(path, module) of each norm of ``paths`` the block has (missing and Identity ones skipped)."""
    out = []
    for p in paths:
        try:
            mod = sub(block, p)
        except AttributeError:
            continue
        if isinstance(mod, nn.Module) and not isinstance(mod, nn.Identity):
            out.append((p, mod))
    return tuple(out)


def real_module(mod: Any) -> nn.Module | None:
    """``mod``, or None for None / an Identity (an absent layer scale or norm)."""
    return None if mod is None or isinstance(mod, nn.Identity) else mod


def heads_of(att: nn.Module) -> tuple[int, int]:
    """(query heads, key/value heads) of a transformers attention module."""
    cfg = getattr(att, "config", None)
    heads = (
        getattr(att, "num_heads", None) or getattr(att, "num_attention_heads", None) or getattr(att, "n_heads", None)
    )
    if heads is None and cfg is not None:
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads", None)
    if heads is None:
        heads = att.o_proj.in_features // att.head_dim
    kv = getattr(att, "num_key_value_heads", None) or getattr(cfg, "num_key_value_heads", None) or heads
    groups = getattr(att, "num_key_value_groups", None)
    if groups:
        kv = int(heads) // int(groups)
    return int(heads), int(kv)


class _Scale(nn.Module):
    """A layer scale kept as a bare parameter on the block (BEiT's ``lambda_1``): y ↦ y ⊙ γ. The parameter
    stays the block's own (this module is not attached to the model); :func:`layers._scaled` reads ``gamma``."""

    def __init__(self, gamma: nn.Parameter) -> None:
        super().__init__()
        self.gamma = gamma

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.gamma


def block_scale(m: nn.Module, name: str) -> nn.Module | None:
    """The layer scale held as the block's parameter ``name`` (BEiT's ``lambda_1``, EVA's ``gamma_1``), or
    None when the block has none."""
    p = getattr(m, name, None)
    return _Scale(p) if isinstance(p, nn.Parameter) else None


def probe_residual(block: nn.Module, layout: Callable[[int, str, nn.Module, bool], LayerAnatomy]) -> bool:
    """Whether ``block`` computes the pre-norm (True) or the post-norm (False) residual layout, from one forward
    of a hook-free copy of it on a random (1, 3, d) input (a running capture's hooks see nothing): the first
    norm's input must be the block input (pre-norm) or block input + attention branch (post-norm), and
    :meth:`LayerAnatomy.finish` of that layout (``layout(0, "", copy, pre_norm)``) must give the block's output.
    ValueError when neither holds (another layout)."""
    import copy

    work = copy.deepcopy(block)
    for mod in work.modules():
        mod._forward_hooks.clear()
        mod._forward_pre_hooks.clear()
    cand = {pre: layout(0, "", work, pre) for pre in (True, False)}
    seen: dict[str, torch.Tensor] = {}

    def keep_in(mod: nn.Module, args: tuple) -> None:  # hooks return None: the block's own values flow on
        seen.setdefault("n1", args[0])

    def keep_out(mod: nn.Module, args: tuple, out: Any) -> None:
        seen.setdefault("attn", out[0] if isinstance(out, tuple) else out)

    cand[True].norm1.register_forward_pre_hook(keep_in)
    cand[True].attention.register_forward_hook(keep_out)
    w = cand[True].fc1.arrays()[0]
    x = torch.randn(1, 3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w)
    with torch.no_grad():
        try:
            out = work(x, attention_mask=None)
        except Exception as e:  # noqa: BLE001  (a block that cannot run alone on (1, 3, d): not this layout)
            raise ValueError(f"the block does not run alone on a (1, 3, d) probe: {type(e).__name__}: {e}") from None
        out = out[0] if isinstance(out, (tuple, list)) else out
        for pre, start in ((True, x), (False, x + seen["attn"])):
            if torch.allclose(seen["n1"], start, atol=1e-5, rtol=1e-4) and torch.allclose(
                    cand[pre].finish(x, seen["attn"]), out, atol=1e-4, rtol=1e-4):
                return pre
    raise ValueError("the block computes neither the pre-norm nor the post-norm residual layout")
