"""attnroll._modes: eval_mode and params_require_grad undo exactly what they changed, also on errors."""

import pytest
import torch
from torch import nn

from attnroll._modes import eval_mode, params_require_grad


def _mixed():
    m = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Sequential(nn.Dropout(0.1), nn.Linear(2, 2)))
    m.train()
    m[2][0].eval()  # a submodule the caller keeps in eval mode: model.train() on exit would flip it
    return m


def _flags(m):
    return [sub.training for sub in m.modules()]


def test_eval_mode_sets_eval_and_restores_each_flag():
    a, b = _mixed(), nn.Linear(1, 1).eval()
    before_a, before_b = _flags(a), _flags(b)
    assert before_a != [True] * len(before_a)
    with eval_mode(a, None, b, "not a module"):
        assert not any(_flags(a)) and not any(_flags(b))
        x = torch.ones(4, 2)
        assert torch.equal(a(x), a(x))  # dropout off
    assert _flags(a) == before_a and _flags(b) == before_b


def test_eval_mode_restores_on_exception():
    a = _mixed()
    before = _flags(a)
    with pytest.raises(RuntimeError, match="boom"):
        with eval_mode(a):
            raise RuntimeError("boom")
    assert _flags(a) == before


def test_params_require_grad_only_for_frozen_models():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(KeyError):
        with params_require_grad(frozen):
            assert all(p.requires_grad for p in frozen.parameters())
            raise KeyError("x")
    assert not any(p.requires_grad for p in frozen.parameters())
    partly = nn.Linear(2, 2)
    partly.bias.requires_grad_(False)
    with params_require_grad(partly):
        assert [p.requires_grad for p in partly.parameters()] == [True, False]  # not frozen: left alone
    assert [p.requires_grad for p in partly.parameters()] == [True, False]


def test_eval_mode_calls_the_models_own_train_only_when_needed():
    """A model in train mode is switched through its own train() (overrides honoured); one already in eval
    mode everywhere is not touched at all; either way the flags come back."""

    class Counting(nn.Sequential):
        calls = 0

        def train(self, mode=True):
            Counting.calls += 1
            return super().train(mode)

    m = Counting(nn.Linear(2, 2), nn.Dropout(0.5))
    with eval_mode(m):
        assert not any(_flags(m))
    assert Counting.calls == 1 and all(_flags(m))  # eval() on enter, the flags restored on exit
    m.eval()
    Counting.calls = 0
    with eval_mode(m):
        assert not any(_flags(m))
    assert Counting.calls == 0 and not any(_flags(m))


def test_submodules_are_modules_each_once():
    """``submodules`` (the captures' cheaper walk) gives the set ``model.modules()`` gives, each module once,
    a module registered under two names (tied) and a None child included."""
    from torch import nn

    from attnroll._modes import submodules

    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), shared, nn.ModuleList([nn.Linear(2, 3), shared]))
    model.register_module("empty", None)
    got = submodules(model)
    assert got[0] is model and len(got) == len({id(m) for m in got})
    assert {id(m) for m in got} == {id(m) for m in model.modules()}
