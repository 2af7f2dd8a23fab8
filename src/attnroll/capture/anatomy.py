"""Layer anatomy: where a model's transformer blocks, classification head and per-component parameters are.

The sanity check (``evaluate.sanity``) re-initialises these; it reads them only through this module, so the
names each family gives its blocks and projections (transformers v4 / v5, timm, torch) live in capture/.

Components of a block: "qk" (query and key projections), "value" (value and output projections), "mlp"
(the feed-forward layers), "all" (every parameter; normalisation layers reset to weight 1 / bias 0). A fused
q/k/v tensor (timm ``qkv``, torch ``in_proj_weight``) is split by rows: q and k are its first two thirds.
"""

from __future__ import annotations

from torch import nn

from .. import _checks

# Block-relative module names per component (see the module docstring).
_QK_LEAVES = {"query", "key", "q_proj", "k_proj", "q_lin", "k_lin"}
_V_LEAVES = {"value", "v_proj", "v_lin"}
_OUT_LEAVES = {"o_proj", "out_proj", "out_lin"}
_OUT_PATHS = ("attention.output.dense", "attn.proj")
_MLP_PATHS = ("intermediate.dense", "output.dense")
_MLP_PARENTS = {"mlp", "ffn"}
_MLP_LEAVES = {"linear1", "linear2"}
_FUSED_LEAVES = {"qkv"}

_LOOKED_FOR_BLOCKS = (
    "transformers' `encoder.layer` or `layers` (a ModuleList of identical layers), timm's `blocks`, or any "
    "nn.ModuleList / nn.Sequential of identical composite blocks with parameters"
)
_LOOKED_FOR_HEAD = (
    "a `classifier` (transformers) or `head` (timm) module with parameters, or an nn.Linear outside the blocks"
)


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
    """The transformer blocks of ``model``, first to last, and their path.

    Looked for, in order: a stack whose path ends with ``encoder.layer`` (transformers v4 ViT / DeiT / BERT),
    ``blocks`` (timm) or ``layers`` (transformers v5, nn.TransformerEncoder); else the largest (by parameter
    count) nn.ModuleList / nn.Sequential of identical composite blocks. Raises ValueError naming what was looked
    for when there is none."""
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


# (name, parameter, rows): rows None = the whole tensor, else a slice of its first axis (fused qkv).
Target = tuple[str, nn.Parameter, "slice | str | None"]  # rows: all, a slice of a fused tensor, or RESET


def _kind(path: str) -> str | None:
    """What a block-relative linear layer is: "qk", "value", "mlp", "fused" (q, k and v in one) or None."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf in _FUSED_LEAVES:
        return "fused"
    if leaf in _QK_LEAVES:
        return "qk"
    if leaf in _V_LEAVES or leaf in _OUT_LEAVES or path.endswith(_OUT_PATHS):
        return "value"
    if path in _MLP_PATHS or leaf in _MLP_LEAVES or any(seg in _MLP_PARENTS for seg in path.split(".")[:-1]):
        return "mlp"
    return None


#: ``rows`` marker of a normalisation parameter: reset to its default instead of drawn.
RESET = "reset"


def _fused_rows(size: int, component: str) -> slice:
    """Rows of a fused (3D, ...) q/k/v tensor that belong to ``component``: q and k, or v."""
    d = size // 3
    return slice(0, 2 * d) if component == "qk" else slice(2 * d, 3 * d)


def component_parameters(block: nn.Module, component: str) -> list[Target]:
    """The parameters (and, for fused q/k/v tensors, the rows) of ``block`` that ``component`` re-initialises,
    in registration order. Raises ValueError when a component other than "all" matches nothing."""
    component = _checks.check_choice("component", component, _checks.SANITY_COMPONENTS)
    if component == "all":
        norms = {id(p) for m in block.modules() if "norm" in type(m).__name__.lower()
                 for p in m.parameters(recurse=False)}
        return [(n, p, RESET if id(p) in norms else None) for n, p in block.named_parameters()]
    out: list[Target] = []
    for path, mod in block.named_modules():
        if isinstance(mod, nn.MultiheadAttention):
            # Fused input projection (3D, D) as direct parameters; out_proj is a Linear met below.
            if component in ("qk", "value"):
                for pname in ("in_proj_weight", "in_proj_bias"):
                    p = getattr(mod, pname, None)
                    if isinstance(p, nn.Parameter):
                        out.append((f"{path}.{pname}", p, _fused_rows(p.shape[0], component)))
                wanted = ("q_proj_weight", "k_proj_weight") if component == "qk" else ("v_proj_weight",)
                for pname in wanted:
                    p = getattr(mod, pname, None)
                    if isinstance(p, nn.Parameter):
                        out.append((f"{path}.{pname}", p, None))
            continue
        if not isinstance(mod, nn.Linear):
            continue
        kind = _kind(path)
        if kind == "fused" and component in ("qk", "value"):
            for pname, p in mod.named_parameters(recurse=False):
                out.append((f"{path}.{pname}", p, _fused_rows(p.shape[0], component)))
        elif kind == component:
            out.extend((f"{path}.{pname}", p, None) for pname, p in mod.named_parameters(recurse=False))
    if not out:
        _checks.check_found(
            f"{component!r} parameters",
            None,
            block,
            "linear layers named query/key/q_proj/k_proj, value/v_proj and attention.output.dense/o_proj/"
            "out_proj/attn.proj, intermediate.dense/output.dense/mlp.*, or a fused qkv / in_proj_weight; "
            "use component='all'",
        )
    return out
