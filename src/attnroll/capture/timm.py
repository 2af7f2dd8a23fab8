"""timm adapter: VisionTransformer (vit_*, deit_* including distilled, register tokens, parallel blocks, attention
pooling) and the other global-attention ViTs built the same way (EVA / EVA02 and the RoPE ViTs, BEiT, relpos
ViT, NaFlexViT): every attention module with a ``fused_attn`` switch and an ``attn_drop`` module. CaiT
(talking heads + class attention) is ``cait.py``, Swin ``swin.py``; ``capture`` dispatches to them.

timm's ``Attention`` uses ``F.scaled_dot_product_attention`` when ``fused_attn`` is set (the default on
recent torch), and then never calls ``attn_drop`` — the module every hook-based tool listens to. For the
duration of the capture each attention module's ``fused_attn`` is set to False (restored afterwards), and
the *output* of ``attn_drop`` is recorded: the softmax probabilities exactly as multiplied with the values
(identical to the softmax in eval mode), which is also the tensor gradients flow through.

The layer anatomy of timm blocks is read here too (:data:`BLOCKS`): the ViT blocks (fused ``attn.qkv``,
``ls1`` / ``ls2``) and the EVA / EVA02 / BEiT blocks (fused ``attn.qkv`` with separate ``q_bias`` /
``v_bias``, or ``attn.{q,k,v}_proj``; plain, SwiGLU or packed-GLU MLP; ``gamma_1`` / ``gamma_2``): pre-norm.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .. import _checks
from .anatomy_parts import BlockKind, block_scale, fused, norms, proj, real_module
from .hooks import Adapter, Recorder, Site, make_sites, set_attr_temporarily, supported_families
from .layers import LayerAnatomy, Proj
from .record import AttentionRecord, ModelFacts


def is_timm_model(model: nn.Module) -> bool:
    return "timm" in sys.modules and type(model).__module__.startswith("timm.")


class TimmAdapter(Adapter):
    family = "timm:vit"
    inputs_example = "For example inputs = a (B, 3, H, W) float tensor of preprocessed images."

    def __init__(self, model: nn.Module):
        super().__init__(model)
        name = type(model).__name__
        if "swin" in name.lower():
            raise _checks.UnsupportedModelError(
                f"timm model {name}: Swin computes attention inside shifted local windows, so there is no global "
                "token-to-token matrix to roll out; attnroll scatters the windows into stage matrices for timm "
                f"SwinTransformer and SwinTransformerV2 (swin_*, swinv2_*), not for {name}. Supported: "
                f"{supported_families()}"
            )
        _refuse_partial_stack(model)
        self.attn_modules = [
            (n, m)
            for n, m in model.named_modules()
            if hasattr(m, "fused_attn") and isinstance(getattr(m, "attn_drop", None), nn.Module)
            and not n.startswith("attn_pool")
        ]
        if not self.attn_modules:
            raise _checks.UnsupportedModelError(
                f"timm model {name} has no attention module with a switchable fused path (fused_attn + attn_drop), "
                f"so attnroll cannot read its probabilities. Supported: {supported_families()}"
            )
        from timm.models.vision_transformer import VisionTransformer

        self.family = "timm:vit" if isinstance(model, VisionTransformer) else f"timm:{name}"
        diff = [n for n, m in self.attn_modules if type(m).__name__ == "DiffAttention"]
        if diff:
            raise _checks.UnsupportedModelError(
                f"timm model {type(model).__name__} uses differential attention ({diff[0]}, ...): each head mixes "
                "tokens with the difference of two softmax maps (a1 − λ·a2), which is not one row-stochastic "
                "matrix, so rollout's product of attention matrices does not describe it; attnroll refuses "
                "rather than roll out one of the two maps."
            )
        self.pool_attn: dict[str, torch.Tensor] = {}

    def check_batch(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        """The attention's batch axis must be the images': windowed attention (a window per row of the batch
        axis) read as if every window were an image would be a wrong map."""
        x = inputs.get("x")
        B = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.ndim >= 1 else None
        batches = sorted({int(t.shape[0]) for t in record.streams["self"]})
        if B is not None and batches != [B]:
            raise _checks.UnsupportedModelError(
                f"timm model {type(self.model).__name__}: its attention runs on {batches} rows of the batch axis "
                f"for {B} images (windows or grid cells as the batch), so no layer is one token-to-token matrix per "
                "image; attnroll refuses rather than read each window as an image."
            )

    def sites(self) -> list[Site]:
        entries = []
        for n, m in self.attn_modules:
            # ParallelThingsBlock: blocks.<i>.attns.<j>.attn — branches j of block i are one layer.
            parts = n.split(".")
            group = ".".join(parts[: parts.index("attns")]) if "attns" in parts else None
            entries.append((f"{n}.attn_drop", m.attn_drop, "self", group))
        return make_sites(entries)

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        for _, m in self.attn_modules:
            set_attr_temporarily(stack, m, "fused_attn", False)
        pool = getattr(self.model, "attn_pool", None)
        if isinstance(pool, nn.Module):
            handle = pool.register_forward_hook(self._pool_hook)
            stack.callback(handle.remove)
        super().install(stack, recorder, sites)

    def _pool_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        """The attention-pool head's own attention (latent queries over the tokens), recomputed from its
        weights on its input: (B, n_in), mean over heads and latent queries (the head pools latent 0 for
        pool='token')."""
        x = args[0]
        B, N, C = x.shape
        with torch.no_grad():
            if module.pos_embed is not None:
                x = x + module.pos_embed.unsqueeze(0).to(x.dtype)
            q = module.q(module.latent.expand(B, -1, -1)).reshape(B, module.latent_len, module.num_heads, -1)
            k = module.kv(x).reshape(B, N, 2, module.num_heads, -1).permute(2, 0, 3, 1, 4)[0]
            q, k = module.q_norm(q.transpose(1, 2)), module.k_norm(k)
            attn = ((q * module.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, H, latent, N)
            attn = attn[:, :, :1] if getattr(module, "pool", "token") == "token" else attn
            self.pool_attn["self"] = attn.mean(dim=(1, 2)).float().cpu()

    def readout_spec(self, stream: str, record: AttentionRecord, info: Any, inputs: dict[str, Any]) -> tuple[Any, str]:
        m = self.model
        n = record.streams[stream][0].shape[-1]
        include_prefix = bool(getattr(m, "pool_include_prefix", False))
        if getattr(m, "attn_pool", None) is not None:
            w = self.pool_attn.get("self")
            if w is None:
                return None, "the attention-pool head did not run (forward_features only?): pass readout="
            if w.shape[-1] != n:  # the head saw the tokens after the prefix
                w = torch.cat([torch.zeros(w.shape[0], n - w.shape[-1]), w], dim=-1)
            why = "timm attention-pool head: its latent query's attention over the tokens (mean over heads)"
            return ("attention_pool", w), why
        pool = getattr(m, "global_pool", "token")
        if pool == "token" and getattr(m, "head_dist", None) is not None:
            w = torch.zeros(n)
            w[:2] = 0.5
            return w, "timm distilled ViT: its logits average the class and distillation tokens' heads"
        if pool == "token":
            return "cls", "timm global_pool='token': the class token"
        if pool == "avg":
            if include_prefix:
                return torch.ones(n), "timm global_pool='avg' (prefix tokens included)"
            return "mean", "timm global_pool='avg': the mean of the patch tokens"
        if not pool:
            return "cls", "timm global_pool='': no pooling; the first token"
        if pool == "avgmax":
            return None, (
                "timm global_pool='avgmax' is ½(mean + max) over the tokens; the max half takes each feature channel "
                "from whichever token is largest there, so no fixed weighting of rows describes the pooled vector: "
                "pass readout='mean' to explain the mean half (or a position / weight vector)"
            )
        return None, (
            f"timm global_pool={pool!r} takes a maximum over tokens, which is no weighted set of rows: pass "
            "readout= ('cls', 'mean', a position or a weight vector)"
        )

    def stream_kind(self, stream: str, record: AttentionRecord, inputs: dict[str, Any]) -> str:
        return "image"

    def facts(self) -> ModelFacts:
        return ModelFacts(family=self.family, input_key="x", keyword_call=False)

    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        self.check_batch(record, inputs)
        shapes = {tuple(t.shape[-2:]) for t in record.streams["self"]}
        if len(shapes) != 1 or any(q != k for q, k in shapes):
            raise _checks.UnsupportedModelError(
                f"timm model {type(self.model).__name__}: its attention layers have shapes {sorted(shapes)}: tokens "
                "are pooled, windowed or queried by a subset between layers, so there is no single token-to-token "
                "product to roll out"
            )
        record.prefix = int(getattr(self.model, "num_prefix_tokens", 0))
        x = inputs.get("x")
        pe = getattr(self.model, "patch_embed", None) or getattr(self.model, "embeds", None)
        record.extra["grid_reason"] = "no patch embedding with a known patch size"
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or pe is None or not hasattr(pe, "patch_size"):
            return
        size = (int(x.shape[-2]), int(x.shape[-1]))
        if hasattr(pe, "dynamic_feat_size"):
            grid = tuple(int(g) for g in pe.dynamic_feat_size(size))
        else:
            ph, pw = pe.patch_size
            grid = (size[0] // ph, size[1] // pw)
        n = record.streams["self"][0].shape[-1]
        if record.prefix + grid[0] * grid[1] == n:
            record.grid = grid  # type: ignore[assignment]
        else:
            record.extra["grid_reason"] = f"{n} tokens, but {record.prefix} prefix + {grid[0]}x{grid[1]} patches"


#: timm model classes (by name, the class or a base of it) whose every token-mixing step is an attention module
#: this adapter reads: one global (n x n) attention per block over the same tokens throughout.
GLOBAL_STACKS = ("VisionTransformer", "VisionTransformerRelPos", "Eva", "Beit", "NaFlexVit")

#: Why other timm architectures are refused: class name -> what their attention modules leave out.
_PARTIAL_STACKS = {
    "VOLO": "its first stage mixes tokens with outlook attention (each token's 3x3 neighbourhood weights folded back "
            "over overlapping windows, no attention module attnroll reads) and its last blocks are class attention "
            "over [CLS + tokens]: the attention modules alone would leave both out",
    "MaxxVit": "its blocks attend inside windows and inside dilated grid cells (each window or cell a row of the batch "
               "axis) between convolution blocks: there is no single token-to-token matrix per image",
    "VisionTransformerSAM": "its blocks attend inside local windows (each window a row of the batch axis)",
    "XCiT": "its attention is cross-covariance attention over feature channels (a d x d matrix, not tokens), mixed "
            "with local patch convolutions, and its last blocks are class attention",
}


def _refuse_partial_stack(model: nn.Module) -> None:
    """Refuse a timm model that is not one stack of global attention over a fixed token set (``GLOBAL_STACKS``,
    CaiT and Swin have their own adapters): reading only the attention modules it has would silently drop
    its other token mixing or read its windows as images."""
    bases = {c.__name__ for c in type(model).__mro__}
    if bases & set(GLOBAL_STACKS):
        return
    name = type(model).__name__
    why = _PARTIAL_STACKS.get(name) or ("it is not a stack of global attention over one fixed set of tokens (token "
                                        "mixing by pooling, convolution, windows or class attention in between)")
    raise _checks.UnsupportedModelError(
        f"timm model {name}: {why}; a rollout of its attention modules alone would be a wrong map, so attnroll "
        f"refuses it. attnroll reads timm {', '.join(GLOBAL_STACKS)} (and CaiT, Swin). Supported: "
        f"{supported_families()}"
    )


# ------------------------------------------------------------------------------------------- layer anatomy
def _timm(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """timm ``VisionTransformer`` blocks (fused ``attn.qkv``: q, k, v thirds of the rows; ``attn.proj``,
    ``ls1`` / ``ls2``, optional ``attn.q_norm`` / ``k_norm``): pre-norm."""
    att = m.attn
    q, k, v = fused(m, "attn.qkv", att.qkv.in_features)
    heads = int(att.num_heads)
    return LayerAnatomy(
        index=i, module=m, path=path, attention=att, q=q, k=k, v=v, o=proj(m, "attn.proj"), heads=heads,
        kv_heads=heads, pre_norm=True, norm1=m.norm1, norm2=m.norm2,
        norms=norms(m, ("norm1", "norm2", "attn.q_norm", "attn.k_norm", "attn.norm", "mlp.norm")),
        fc1=proj(m, "mlp.fc1"), act=m.mlp.act, fc2=proj(m, "mlp.fc2"), ls1=real_module(m.ls1),
        ls2=real_module(m.ls2),
    )


def _eva_qkv(m: nn.Module) -> tuple[Proj, Proj, Proj]:
    """q, k, v of a timm EVA / BEiT attention: separate ``attn.{q,k,v}_proj``, or a fused ``attn.qkv`` (row
    thirds) whose biases are ``attn.q_bias`` / ``attn.v_bias`` beside a zero key bias buffer."""
    att = m.attn
    if getattr(att, "qkv", None) is None:
        return tuple(proj(m, f"attn.{n}_proj") for n in "qkv")  # type: ignore
    d = att.proj.in_features
    if getattr(att, "q_bias", None) is None:
        return fused(m, "attn.qkv", d)
    if getattr(att, "k_bias", None) is not None and bool(att.k_bias.detach().ne(0).any()):
        raise ValueError("attn.k_bias is not zero")
    sep = dict(bias_module=att, bias_path="attn")
    return (proj(m, "attn.qkv", rows=slice(0, d), bias="q_bias", **sep),
            proj(m, "attn.qkv", rows=slice(d, 2 * d), bias=None),
            proj(m, "attn.qkv", rows=slice(2 * d, 3 * d), bias="v_bias", **sep))


def _eva_mlp(m: nn.Module) -> tuple[Proj, Proj | None]:
    """(fc1, gate or None) of a timm ``Mlp``, ``SwiGLU`` (``fc1_x``, ``fc1_g``) or ``GluMlp`` (one fused fc1,
    its halves the value and the gate; ``gate_last``: the gate is the second half)."""
    mlp = m.mlp
    if hasattr(mlp, "fc1_g"):
        return proj(m, "mlp.fc1_x"), proj(m, "mlp.fc1_g")
    if hasattr(mlp, "gate_last"):
        if getattr(mlp, "chunk_dim", -1) != -1:
            raise ValueError("a convolutional GluMlp")
        h = mlp.fc1.out_features // 2
        first, second = (proj(m, "mlp.fc1", rows=slice(j * h, (j + 1) * h)) for j in range(2))
        return (first, second) if mlp.gate_last else (second, first)
    return proj(m, "mlp.fc1"), None


def _timm_eva(i: int, path: str, m: nn.Module) -> LayerAnatomy:
    """timm EVA / EVA02 (``EvaBlock``) and timm BEiT blocks: pre-norm, rotary or relative-position attention (it
    shapes the attention probabilities only), fused or separate q / k / v, plain / SwiGLU / packed-GLU MLP,
    block-level ``gamma_1`` / ``gamma_2`` layer scales."""
    fc1, gate = _eva_mlp(m)
    q, k, v = _eva_qkv(m)
    heads = int(m.attn.num_heads)
    return LayerAnatomy(
        index=i, module=m, path=path, attention=m.attn, q=q, k=k, v=v, o=proj(m, "attn.proj"), heads=heads,
        kv_heads=heads, pre_norm=True, norm1=m.norm1, norm2=m.norm2,
        norms=norms(m, ("norm1", "norm2", "attn.q_norm", "attn.k_norm", "attn.norm", "mlp.norm")),
        fc1=fc1, act=m.mlp.act, fc2=proj(m, "mlp.fc2"), gate=gate, ls1=block_scale(m, "gamma_1"),
        ls2=block_scale(m, "gamma_2"),
    )


def _is_timm_eva(m: nn.Module) -> bool:
    return type(m).__module__.startswith("timm.") and hasattr(m, "gamma_1") and hasattr(m, "norm2") and hasattr(
        getattr(m, "attn", None), "proj") and hasattr(getattr(m, "mlp", None), "fc2")


def _is_timm_block(m: nn.Module) -> bool:
    return type(m).__module__.startswith("timm.") and hasattr(getattr(m, "attn", None), "qkv") and hasattr(
        m, "ls1") and hasattr(getattr(m, "mlp", None), "fc1")


def timm_head(model: nn.Module, layers: list[LayerAnatomy]) -> tuple[dict[str, Any], str]:
    """timm VisionTransformer heads: ``global_pool='token'`` (the CLS row) and ``'avg'`` (the mean of the rows
    after the prefix, or of all rows with ``pool_include_prefix``), with ``norm`` before and ``fc_norm`` after
    the pooling. Returns (fields, why decompx cannot read the head or "")."""
    out: dict[str, Any] = {"readout": "first"}
    head = getattr(model, "head", None)
    pool = getattr(model, "global_pool", "token")
    if getattr(model, "attn_pool", None) is not None or pool not in ("token", "avg"):
        return out, f"timm head with global_pool={pool!r}{' and an attention pool' if pool == 'map' else ''}"
    if not isinstance(head, nn.Linear):
        return out, ""
    norm, fc_norm = real_module(getattr(model, "norm", None)), real_module(getattr(model, "fc_norm", None))
    if pool == "token" and fc_norm is None:
        out.update(final_norm=norm, classifier=head)
        return out, ""
    start = 0 if getattr(model, "pool_include_prefix", False) else int(getattr(model, "num_prefix_tokens", 1))
    part = ("row", 0) if pool == "token" else ("mean", start)
    out.update(token_norm=norm, final_norm=fc_norm, classifier=head, pool=(part,))
    return out, ""


#: The timm block kinds in the order they are tried (EVA's ``gamma_1`` blocks before the plain ViT blocks).
BLOCKS = (
    BlockKind(name="timm-eva", matches=_is_timm_eva, build=_timm_eva, parts="gamma_1 + attn.proj + mlp.fc2 (timm EVA)",
              label="EVA / EVA02, BEiT", value_aware="EVA (pre-LN)",
              head_not_read="EVA / BEiT pooling and norms, not checked"),
    BlockKind(name="timm", matches=_is_timm_block, build=_timm, parts="attn.qkv + ls1 + mlp.fc1 (timm)",
              label="VisionTransformer", value_aware="VisionTransformer (pre-LN)", head=timm_head),
)
