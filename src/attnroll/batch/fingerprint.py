"""A fingerprint of a model: a hash of its weights and its configuration, so that a batch output records
which model made it and a rerun with another model is refused."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ..capture.transformers_private import LOAD_ONLY_CONFIG_KEYS


def model_fingerprint(model: torch.nn.Module) -> str:
    """``"sha256:<16 hex>"`` over the class name, the configuration (a transformers ``config`` as JSON, a
    timm ``pretrained_cfg``) and every parameter and buffer: name, dtype, shape and bytes, in name order.
    Equal weights and config give equal fingerprints whatever the device or the load path."""
    h = hashlib.sha256()
    h.update(type(model).__name__.encode())
    h.update(_config_json(model).encode())
    state = model.state_dict()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(_tensor_bytes(t))
    return "sha256:" + h.hexdigest()[:16]


def _config_json(model: Any) -> str:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
        for k in LOAD_ONLY_CONFIG_KEYS:  # how the model was loaded, not what it computes
            d.pop(k, None)
        return json.dumps(d, sort_keys=True, default=str)
    cfg = getattr(model, "pretrained_cfg", None)
    return json.dumps(cfg or {}, sort_keys=True, default=str)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()
