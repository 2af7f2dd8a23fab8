"""sentence-transformers Pooling configs: which token rows a sentence embedding is made of.

A sentence-transformers model folder holds ``modules.json`` naming its modules; the Pooling module's
``config.json`` says which rows the sentence embedding reads (mean of the real tokens, the first token, the
last real token). A transformers model loaded from such a folder reads the same config.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: Pooling config flag -> readout kind. ``mean_sqrt_len`` scales the mean by a constant per example, so its
#: rows have the same relative weights as the mean.
_MODES = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean"),
    ("pooling_mode_lasttoken", "last"),
)


def pooling_from_config(cfg: dict[str, Any], where: str) -> tuple[str, str] | None:
    """(readout kind, source) from a Pooling config dict; None when it uses none of the linear modes.

    Pooling that is not one weighted sum of rows (max pooling, several modes concatenated) gives
    (None, reason): no default readout would be honest."""
    kinds = [kind for flag, kind in _MODES if cfg.get(flag)]
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        kinds += [{"cls": "cls", "mean": "mean", "mean_sqrt_len_tokens": "mean", "lasttoken": "last"}.get(mode, "")]
    kinds = [k for k in kinds if k]
    if len(set(kinds)) == 1:
        return kinds[0], f"sentence-transformers pooling ({where})"
    if cfg.get("pooling_mode_max_tokens") or cfg.get("pooling_mode_weightedmean_tokens") or len(set(kinds)) > 1:
        return None, (
            f"the sentence-transformers pooling in {where} ({', '.join(k for k, v in cfg.items() if v is True)}) is "
            "not one weighted set of token rows: pass readout= ('cls', 'mean', 'last', a position or a weight vector)"
        )
    return None


def pooling_of_folder(folder: Any) -> tuple[str, str] | None:
    """The Pooling module's readout of a sentence-transformers model folder, or None when ``folder`` is not
    one (no ``modules.json`` naming a Pooling module)."""
    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        return None
    modules = os.path.join(folder, "modules.json")
    try:
        with open(modules, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith("Pooling"):
            path = os.path.join(folder, str(entry.get("path", "")), "config.json")
            try:
                with open(path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError):
                return None
            return pooling_from_config(cfg, os.path.relpath(path, folder))
    return None
