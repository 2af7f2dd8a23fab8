"""No public name shadows a module: every submodule is what its package's attribute of that name is, and
the modules that share their name with their main function are callable as it (attnroll._callable)."""

import importlib
import pkgutil

import numpy as np
import pytest
import torch

import attnroll


def shadowed(pkg) -> list[str]:
    out = []
    for m in pkgutil.iter_modules(pkg.__path__):
        if m.name == "__main__":  # running it is the command line
            continue
        sub = importlib.import_module(f"{pkg.__name__}.{m.name}")
        if getattr(pkg, m.name, None) is not sub:
            out.append(f"{pkg.__name__}.{m.name} is {type(getattr(pkg, m.name, None)).__name__}")
        if m.ispkg:
            out += shadowed(sub)
    return out


def test_no_public_name_shadows_a_module():
    assert shadowed(attnroll) == []


def test_callable_modules_are_their_functions():
    from attnroll.capture import record
    from attnroll.explain.registry import methods as methods_fn

    assert attnroll.methods() == methods_fn() and "rollout" in attnroll.methods()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(1, 5, 8)
    rec = attnroll.capture(model, x)
    want = attnroll.capture.capture(model, x)
    assert isinstance(rec, record.AttentionRecord)
    assert all(torch.equal(a, b) for a, b in zip(rec.attentions, want.attentions))
    s, m = np.array([[0.1, 0.9, 0.0, 0.2]]), np.array([[False, True, False, False]])
    assert attnroll.evaluate.localisation(s, m).pointing.tolist() == [True]
    with pytest.raises(TypeError):
        attnroll.viz.overlay()  # the call reaches the function (missing arguments), not "module not callable"


def test_make_callable_refuses_a_non_function():
    import sys
    import types

    from attnroll._callable import make_callable

    mod = types.ModuleType("attnroll_test_mod")
    mod.attnroll_test_mod = 3
    sys.modules["attnroll_test_mod"] = mod
    try:
        with pytest.raises(TypeError, match="is not callable"):
            make_callable("attnroll_test_mod")
    finally:
        del sys.modules["attnroll_test_mod"]
