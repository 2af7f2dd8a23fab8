"""The contract matrix: every registered method on every family of the tiny-model zoo.

Each cell either returns an Explanation that keeps the contract, or refuses with attnroll's own error:

- returned: every map is finite; where the input has padding, the padded positions of ``full_row`` are exactly
  zero; for methods with an ``attention=`` option, the default (matrix-free where it applies) equals
  ``attention="dense"`` to 1e-5;
- refused: ``UnsupportedModelError`` / ``CaptureError`` / ``ValueError`` / ``TypeError``, raised in attnroll's
  own code (not a torch / transformers traceback passing through), whose message names a method, the model, its
  family or the argument that decides it;
- either way the caller's model comes back as it was given: train/eval flags (the model is handed over in
  train mode), attention implementation of every config, hook counts, instance forwards, fused-attention
  flags, each parameter's ``requires_grad`` (half of them frozen) and its values.

Families from the zoo's ``sharp`` kit, batch 2, 6 tokens / 32x32 pixels. The fast lane runs three families
(an image classifier, a text classifier with padding, a decoder with padding); the rest are marked slow.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

import attnroll
from attnroll.capture import CaptureError, model_facts
from attnroll.methods import method_info, methods

from .capture.helpers import snapshot
from .zoo import FAMILIES, sharp

ATTNROLL = Path(attnroll.__file__).resolve().parent
FAST = ("vit", "bert", "gpt2")
REFUSALS = (attnroll.UnsupportedModelError, CaptureError, ValueError, TypeError)


def _cells() -> list:
    marks = {f: () if f in FAST else (pytest.mark.slow,) for f in FAMILIES}
    return [pytest.param(m, f, marks=marks[f], id=f"{m}-{f}") for f in FAMILIES for m in methods()]


def _state(model: torch.nn.Module) -> dict:
    """Everything a method may switch on the caller's model (``snapshot``: train flags, forward hooks, instance
    forwards, fused flags, attention implementations), backward and global module hooks, parameters."""
    g = torch.nn.modules.module
    hooks = [(len(m._backward_hooks), len(m._backward_pre_hooks)) for m in model.modules()]
    hooks.append((len(g._global_forward_hooks), len(g._global_forward_pre_hooks), len(g._global_backward_hooks)))
    return {**snapshot(model), "__hooks__": hooks,
            "__params__": [(k, p.requires_grad, p.detach().clone()) for k, p in model.named_parameters()]}


def _assert_same_state(before: dict, after: dict) -> None:
    b, a = before.pop("__params__"), after.pop("__params__")
    assert after == before
    assert [(k, g) for k, g, _ in a] == [(k, g) for k, g, _ in b], "requires_grad changed"
    for (k, _, x), (_, _, y) in zip(b, a):
        assert torch.equal(x, y), f"parameter {k} changed"


def _handed_over(family: str) -> torch.nn.Module:
    """The model as a caller might hold it: in train mode, the first half of its parameters frozen."""
    model = sharp.model(family).train()
    params = list(model.parameters())
    for p in params[: len(params) // 2]:
        p.requires_grad_(False)
    return model


def _check_refusal(err: BaseException, method: str, model: torch.nn.Module) -> None:
    """attnroll's own error, raised in attnroll's code, whose message says who refused and why."""
    where = Path(traceback.extract_tb(err.__traceback__)[-1].filename).resolve()
    assert ATTNROLL in where.parents, f"{type(err).__name__} raised outside attnroll ({where}): {err}"
    msg = str(err)
    family = model_facts(model).family  # "hf:vit": the adapter family, "vit" its architecture
    names = {*methods(), type(model).__name__, family, family.split(":")[-1], "target=", "stream="}
    assert msg.strip() and any(n in msg for n in names), f"the message names none of {sorted(names)}: {msg!r}"


def _check_maps(e: attnroll.Explanation, x) -> None:
    for name in ("scores", "full_row", "layers"):
        t = getattr(e, name)
        assert t is None or bool(torch.isfinite(t).all()), f"{name} is not finite"
    mask = x.get("attention_mask") if isinstance(x, dict) else None
    if mask is not None and not bool(mask.all()) and e.full_row.shape == mask.shape:
        assert e.attention_mask is not None, "a padded input gave an explanation without its mask"
    if e.attention_mask is not None:
        pad = e.attention_mask == 0
        assert bool(pad.any()) and float(e.full_row[pad].abs().max()) == 0.0, "padding got relevance"


def _check_routes(e: attnroll.Explanation, model: torch.nn.Module, x, method: str) -> None:
    """The default route against ``attention="dense"``: to 1e-5 of the map's scale."""
    if "attention" not in method_info(method).options:
        return
    before = _state(model)
    d = attnroll.explain(model, x, method, attention="dense")
    _assert_same_state(before, _state(model))
    assert d.options["attention"] == "dense"
    scale = max(1.0, float(d.full_row.abs().max()))
    torch.testing.assert_close(e.full_row, d.full_row, atol=1e-5 * scale, rtol=0)
    torch.testing.assert_close(e.scores, d.scores, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize(("method", "family"), _cells())
def test_cell_keeps_the_contract_or_refuses_in_attnroll(method, family):
    model, x = _handed_over(family), sharp.inputs_for(family, batch=2, n=6)
    before = _state(model)
    try:
        e = attnroll.explain(model, x, method)
    except REFUSALS as err:
        _assert_same_state(before, _state(model))
        _check_refusal(err, method, model)
        return
    _assert_same_state(before, _state(model))
    assert e.method == method and e.scores.shape[0] == 2
    _check_maps(e, x)
    _check_routes(e, model, x, method)

