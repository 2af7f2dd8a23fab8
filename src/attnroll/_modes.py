"""Temporary switches of a model's state, undone on exit (also when an exception is raised): nothing in
attnroll changes a caller's model for good. A leaf module: it imports nothing from the package."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

__all__ = ["eval_mode", "params_require_grad"]


@contextlib.contextmanager
def eval_mode(*modules: Any) -> Iterator[None]:
    """Put every ``nn.Module`` among ``modules`` in eval mode for the block; on exit restore each submodule's
    own ``training`` flag (a model kept partly in train mode comes back exactly so, which ``model.train()``
    would not do). Arguments that are not modules (None, a callable) are ignored."""
    saved = [[(sub, sub.training) for sub in m.modules()] for m in modules if isinstance(m, nn.Module)]
    try:
        for m in modules:
            if isinstance(m, nn.Module):
                m.eval()
        yield
    finally:
        for states in saved:
            for sub, was in states:
                sub.training = was


@contextlib.contextmanager
def params_require_grad(model: nn.Module) -> Iterator[None]:
    """If no floating-point parameter of ``model`` requires grad (a frozen model), let them for the block so
    that its activations are part of an autograd graph; restored afterwards. Nothing writes ``.grad``."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    frozen = bool(params) and not any(p.requires_grad for p in params)
    if frozen:
        for p in params:
            p.requires_grad_(True)
    try:
        yield
    finally:
        if frozen:
            for p in params:
                p.requires_grad_(False)
