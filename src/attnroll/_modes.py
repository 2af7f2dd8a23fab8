"""Temporary switches of a model's state, undone on exit (also when an exception is raised): nothing in
attnroll changes a caller's model for good. A leaf module: it imports nothing from the package."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from torch import nn

__all__ = ["eval_mode", "in_eval_mode", "params_require_grad", "submodules"]


def submodules(model: nn.Module) -> list[nn.Module]:
    """``model`` and each of its submodules once (the set ``model.modules()`` gives, breadth-first), without
    the qualified names that ``modules()`` builds on the way (about half of its time: every capture walks
    the model a few times)."""
    out, seen, i = [model], {id(model)}, 0
    while i < len(out):
        for child in out[i]._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                out.append(child)
        i += 1
    return out


@contextlib.contextmanager
def eval_mode(*modules: Any) -> Iterator[None]:
    """Put every ``nn.Module`` among ``modules`` in eval mode for the block; on exit restore each submodule's
    own ``training`` flag (a model kept partly in train mode comes back exactly so, which ``model.train()``
    would not do). Arguments that are not modules (None, a callable) are ignored."""
    mods = [m for m in modules if isinstance(m, nn.Module)]
    saved = [[(sub, sub.training) for sub in submodules(m)] for m in mods]
    try:
        for m, states in zip(mods, saved):
            # A model already in eval mode everywhere is left alone (nn.Module's attribute writes are slow).
            if any(was for _, was in states):
                m.eval()
        yield
    finally:
        for states in saved:
            for sub, was in states:
                if sub.training != was:
                    sub.training = was


@contextlib.contextmanager
def params_require_grad(model: nn.Module, *, partly: bool = False) -> Iterator[None]:
    """If no floating-point parameter of ``model`` requires grad (a frozen model), let them for the block so
    that its activations are part of an autograd graph; restored afterwards. With ``partly``, also a partly
    frozen model's frozen parameters (a linear probe: only the head requires grad, so the attention depends
    on no parameter that does), each restored to its own flag. Nothing writes ``.grad`` (callers take
    ``torch.autograd.grad`` of activations)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    frozen = [p for p in params if not p.requires_grad]
    if not partly and len(frozen) < len(params):
        frozen = []  # some parameter requires grad: left alone
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def in_eval_mode(fn: Callable) -> Callable:
    """Decorator for functions that run a model given as their first argument (``model``): the call runs
    under :func:`eval_mode` of that model (dropout off, so results do not change from call to call), and
    the caller's flags are restored afterwards."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        with eval_mode(model):
            return fn(*args, **kwargs)

    return wrapper
