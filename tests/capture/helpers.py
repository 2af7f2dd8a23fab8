"""Test helpers that need nothing beyond torch."""

from __future__ import annotations

import torch


def snapshot(m: torch.nn.Module) -> dict:
    """Everything capture may touch: train flags, hook counts, instance-level forwards, fused flags and
    every config's attention implementation."""
    state = {}
    for name, mod in m.named_modules():
        state[name] = (
            mod.training,
            len(mod._forward_hooks),
            len(mod._forward_pre_hooks),
            "forward" in mod.__dict__,
            mod.__dict__.get("fused_attn"),
        )
    cfg = getattr(m, "config", None)
    seen = []
    todo = [cfg] if cfg is not None else []
    while todo:
        c = todo.pop()
        seen.append((type(c).__name__, c._attn_implementation))
        todo.extend(getattr(c, k) for k in getattr(c, "sub_configs", {}) if getattr(c, k, None) is not None)
    state["__configs__"] = tuple(seen)
    state["__fastpath__"] = torch.backends.mha.get_fastpath_enabled()
    return state
