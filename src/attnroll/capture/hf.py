"""Hugging Face transformers adapter.

Where the attention is: transformers (5.x) declares, per model class, which module's output holds the
attention probabilities (``_can_record_outputs``: ``"attentions"`` and ``"cross_attentions"``, a module
class plus the index into its output tuple). We read that declaration the way transformers itself does
(each nested ``PreTrainedModel`` uses its own) and hook those modules directly, instead of asking for
``output_attentions=True``: the hook can fuse heads before anything is kept, and nothing is stored twice.

How it is materialised: SDPA and flash attention never form the probability matrix, so for the duration of
the capture every config in the model (sub-configs included) is switched to ``"eager"`` and put back
exactly afterwards.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .. import _checks
from .hooks import SUPPORTED_FAMILIES, Adapter, Recorder, Site, make_sites, stream_names
from .record import AttentionRecord

#: The transformers major versions the adapter works with: [5, 6). It reads ``_can_record_outputs`` /
#: ``OutputRecorder`` declarations, which every model class has only from 5.0 on, and switches the attention
#: implementation through 5.x's config API. pyproject.toml's ``hf`` / ``text`` extras declare the same range.
TRANSFORMERS_RANGE = ((5, 0), (6, 0))


def check_transformers_version(version: str) -> None:
    """UnsupportedModelError for a transformers version below the range (the adapter cannot find the
    attention there); a RuntimeWarning above it (not tested: it may work)."""
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit()) if p[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    v = tuple((parts + [0, 0])[:2])
    lo, hi = TRANSFORMERS_RANGE
    want = f"transformers>={lo[0]}.{lo[1]},<{hi[0]}"
    if v < lo:
        raise _checks.UnsupportedModelError(
            f"attnroll's transformers adapter needs {want}; transformers {version} is installed "
            "(its model classes do not declare their attention outputs): pip install 'attnroll[hf]'"
        )
    if v >= hi:
        warnings.warn(f"attnroll's transformers adapter is tested with {want}; transformers {version} is newer "
                      "and may have moved where attention lives", RuntimeWarning, stacklevel=3)


#: Prefix tokens of the image stream by ``config.model_type`` (CLS, distillation token, registers).
_VISION_PREFIX = {
    "vit": 1,
    "deit": 2,  # CLS + distillation token, in every DeiT head class (the embeddings always add both)
    "dinov2": 1,
    "beit": 1,
    "data2vec-vision": 1,
    "clip": 1,
    "clip_vision_model": 1,
    "vit_msn": 1,
    "vit_mae": 1,
}

#: Windowed models: attention is computed inside local (shifted) windows, so no (n x n) token matrix exists.
_WINDOWED = ("swin", "swinv2", "donut-swin", "maskformer-swin", "swin2sr")


def is_hf_model(model: nn.Module) -> bool:
    """True for a transformers ``PreTrainedModel`` (checked without importing transformers)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _specs(pm: nn.Module) -> list[tuple[str, type | None, str | None, int, str | None]]:
    """(key, target class, class-name suffix, output index, layer name) for the attention outputs a
    transformers model class declares."""
    raw = getattr(pm, "_can_record_outputs", None) or {}
    out = []
    for key in ("attentions", "cross_attentions"):
        if key not in raw:
            continue
        val = raw[key]
        for spec in val if isinstance(val, list) else [val]:
            if hasattr(spec, "target_class"):  # transformers' OutputRecorder
                out.append((key, spec.target_class, spec.class_name, spec.index, spec.layer_name))
            elif isinstance(spec, str):
                out.append((key, None, spec, 1, None))
            else:
                out.append((key, spec, None, 1, None))
    return out


class HFAdapter(Adapter):
    family = "hf"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        import transformers
        from transformers import PreTrainedModel

        check_transformers_version(transformers.__version__)

        config = model.config
        self.model_type = getattr(config, "model_type", "")
        self.family = f"hf:{self.model_type}"
        windowed = self.model_type in _WINDOWED or any("Swin" in type(m).__name__ for m in model.modules())
        if windowed:
            raise _checks.UnsupportedModelError(
                f"{type(model).__name__} ({self.model_type}) computes attention inside local, shifted windows of "
                "patches that merge between stages, so there is no global token-to-token attention matrix to "
                "roll out; attnroll refuses rather than invent one. Use a global-attention model or "
                f"modules=/to_probs= if you have your own composition. Supported: {SUPPORTED_FAMILIES}"
            )
        found: list[tuple[str, nn.Module, str, int]] = []

        def walk(mod: nn.Module, name: str, specs: list) -> None:
            for cname, child in mod.named_children():
                full = f"{name}.{cname}" if name else cname
                walk(child, full, _specs(child) if isinstance(child, PreTrainedModel) else specs)
            for key, cls, class_name, index, layer_name in specs:
                hit = (cls is not None and isinstance(mod, cls)) or (
                    class_name is not None and name.endswith(class_name)
                )
                if hit and layer_name is not None:
                    hit = "." + layer_name.strip(".") + "." in "." + name + "."
                if hit:
                    found.append((name, mod, key, index))
                    break

        walk(model, "", _specs(model))
        order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
        found.sort(key=lambda f: order.get(id(f[1]), -1))
        self.index = {id(m): idx for _, m, _, idx in found}
        selfs = [f for f in found if f[2] == "attentions"]
        names = stream_names([f[0] for f in selfs])
        stream_of = {id(f[1]): s for f, s in zip(selfs, names)}
        entries = [(n, m, stream_of.get(id(m), "cross")) for n, m, key, _ in found]
        self._sites = make_sites(entries)
        if not self._sites:
            raise _checks.UnsupportedModelError(
                f"{type(model).__name__} does not declare which of its modules output attention weights "
                f"(transformers' _can_record_outputs), so attnroll cannot find them. Supported: {SUPPORTED_FAMILIES}"
            )

    def sites(self) -> list[Site]:
        return self._sites

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        for config in _all_configs(self.model):
            _force_eager(stack, config)
        super().install(stack, recorder, sites)

    def extract(self, site: Site, args: tuple, output: Any) -> Any:
        if isinstance(output, (tuple, list)):
            idx = self.index[id(site.module)]
            return output[idx] if -len(output) <= idx < len(output) else None
        return output

    def input_hint(self, inputs: Any) -> str:
        keys = set(inputs) if isinstance(inputs, dict) or hasattr(inputs, "keys") else set()
        if getattr(self.model.config, "is_encoder_decoder", False) and not keys & {
            "decoder_input_ids",
            "decoder_inputs_embeds",
            "labels",
        }:
            return (
                f"{type(self.model).__name__} is an encoder-decoder: pass decoder_input_ids (the target tokens "
                "so far) so that its decoder runs."
            )
        return ""

    # ------------------------------------------------------------------------------------- metadata
    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        mask = inputs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            record.attention_mask = mask.detach()
        dmask = inputs.get("decoder_attention_mask")
        if isinstance(dmask, torch.Tensor):
            record.extra["decoder_attention_mask"] = dmask.detach()
        pixels = inputs.get("pixel_values")
        image_stream = "vision" if "vision" in record.streams else "self"
        if not isinstance(pixels, torch.Tensor) or image_stream not in record.streams:
            record.prefix = 0 if inputs.get("input_ids") is not None else None
            return
        patch = _patch_size(self.model.config)
        n_keys = record.streams[image_stream][0].shape[-1]
        prefix = self._vision_prefix()
        if patch is None or pixels.ndim != 4:
            record.prefix = prefix
            return
        grid = (pixels.shape[-2] // patch[0], pixels.shape[-1] // patch[1])
        if prefix is None and n_keys >= grid[0] * grid[1]:
            prefix = n_keys - grid[0] * grid[1]  # unknown family: whatever precedes the patches
        if prefix is not None and prefix + grid[0] * grid[1] != n_keys:
            warnings.warn(
                f"attnroll.capture: {self.model_type} attention has {n_keys} tokens, but {prefix} prefix tokens + a "
                f"{grid[0]}x{grid[1]} patch grid make {prefix + grid[0] * grid[1]}; grid left unset",
                stacklevel=2,
            )
            record.prefix = prefix
            return
        record.prefix, record.grid = prefix, grid

    def _vision_prefix(self) -> int | None:
        cfg = self.model.config
        if self.model_type == "dinov2_with_registers":
            return 1 + int(cfg.num_register_tokens)
        return _VISION_PREFIX.get(self.model_type)


def _patch_size(config: Any) -> tuple[int, int] | None:
    for cfg in (config, getattr(config, "vision_config", None)):
        p = getattr(cfg, "patch_size", None) if cfg is not None else None
        if isinstance(p, int):
            return (p, p)
        if isinstance(p, (tuple, list)) and len(p) == 2:
            return (int(p[0]), int(p[1]))
    return None


def _all_configs(model: nn.Module) -> list[Any]:
    """Every distinct config object reachable from the model's submodules and their sub-configs."""
    from transformers import PretrainedConfig

    seen: dict[int, Any] = {}
    todo = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen[id(c)] = c
        for key in getattr(c, "sub_configs", None) or {}:
            sub = getattr(c, key, None)
            if isinstance(sub, PretrainedConfig):
                todo.append(sub)
    return list(seen.values())


def _force_eager(stack: ExitStack, config: Any) -> None:
    """Set one config's attention implementation to "eager" and register restoring its exact value.

    The internal attribute is written, not the ``_attn_implementation`` setter, because the setter
    recurses into sub-configs; each sub-config is handled (and restored) on its own."""
    attr = "_attn_implementation_internal" if "_attn_implementation_internal" in config.__dict__ else "_attn_implementation"
    missing = object()
    old = config.__dict__.get(attr, missing)

    def restore() -> None:
        if old is missing:
            config.__dict__.pop(attr, None)
        else:
            config.__dict__[attr] = old

    stack.callback(restore)
    config.__dict__[attr] = "eager"
