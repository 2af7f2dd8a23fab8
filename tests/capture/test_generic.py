"""The generic modules= / to_probs= path, argument validation, unsupported models, AttentionRecord."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnroll
from attnroll import AttentionRecord
from attnroll.capture import CaptureError

from .helpers import snapshot


class ToyAttention(nn.Module):
    """A hand-written single-stream attention: returns (output, scores) — the *logits*, so that a
    to_probs function is needed to turn them into probabilities."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        B, n, D = x.shape
        q, k, v = self.qkv(x).view(B, n, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads)
        probs = self.drop(scores.softmax(-1))
        return (probs @ v).transpose(1, 2).reshape(B, n, D), scores


class Toy(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.blocks = nn.ModuleList(ToyAttention() for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)[0]
        return x


def to_probs(module, args, output):
    return output[1].softmax(-1)


def expected(model, x):
    """Probabilities per block from the blocks' own scores, computed without attnroll (eval mode)."""
    model.eval()
    out = []
    with torch.no_grad():
        for b in model.blocks:
            y, scores = b(x)
            out.append(scores.softmax(-1))
            x = x + y
    return out


@pytest.mark.parametrize("modules", ["blocks\\.\\d+", ["blocks.2", "blocks.0", "blocks.1"], "list"])
def test_modules_and_to_probs(modules):
    torch.manual_seed(0)
    model, x = Toy(), torch.randn(2, 5, 8)
    if modules == "list":
        modules = [model.blocks[1], model.blocks[0], model.blocks[2]]  # any order: layers follow the model
    before = snapshot(model)
    rec = attnroll.capture(model, x, modules=modules, to_probs=to_probs)
    assert snapshot(model) == before  # train mode (dropout 0.5) restored; capture itself ran in eval
    assert rec.family == "modules"
    assert rec.layer_names["self"] == ["blocks.0", "blocks.1", "blocks.2"]
    for a, e in zip(rec.attentions, expected(model, x)):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=0)


def test_module_output_used_directly_when_it_is_a_tensor():
    torch.manual_seed(0)
    model, x = Toy(layers=2), torch.randn(1, 4, 8)
    rec = attnroll.capture(model, x, modules=r"blocks\.\d\.drop")  # the dropout after the softmax
    for a, e in zip(rec.attentions, expected(model, x)):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=0)


def test_generic_errors():
    model, x = Toy(), torch.randn(1, 4, 8)
    with pytest.raises(TypeError, match="to_probs"):
        attnroll.capture(model, x, modules=r"blocks\.\d")  # tuple output without to_probs
    with pytest.raises(ValueError, match="matches no module name.*blocks"):
        attnroll.capture(model, x, modules="attention")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        attnroll.capture(model, x, modules="blocks[")
    with pytest.raises(ValueError, match="modules\\[0\\]='nope' is not the name"):
        attnroll.capture(model, x, modules=["nope"])
    with pytest.raises(ValueError, match="not a submodule"):
        attnroll.capture(model, x, modules=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="to_probs needs modules="):
        attnroll.capture(model, x, to_probs=to_probs)
    with pytest.raises(TypeError, match="to_probs must be a callable"):
        attnroll.capture(model, x, modules=r"blocks\.\d", to_probs="softmax")


def test_unsupported_model_lists_the_families():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(attnroll.UnsupportedModelError) as info:
        attnroll.capture(model, torch.randn(1, 4))
    msg = str(info.value)
    for family in ("ViT", "DINOv2", "T5", "timm VisionTransformer", "MultiheadAttention", "modules=", "to_probs="):
        assert family in msg


def test_argument_validation_names_the_argument():
    model, x = Toy(), torch.randn(1, 4, 8)
    kw = dict(modules=r"blocks\.\d", to_probs=to_probs)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        attnroll.capture("bert", x)
    with pytest.raises(ValueError, match="fuse_heads must be one of 'mean', 'max', 'min'; got 'median'"):
        attnroll.capture(model, x, fuse_heads="median", **kw)
    with pytest.raises(ValueError, match="fuse_heads weights must be finite, non-negative"):
        attnroll.capture(model, x, fuse_heads=[1.0, -1.0], **kw)
    with pytest.raises(TypeError, match="keep_grad must be True or False, got int"):
        attnroll.capture(model, x, keep_grad=1, **kw)
    with pytest.raises(ValueError, match="dtype must be float32 or float64"):
        attnroll.capture(model, x, dtype="int8", **kw)
    with pytest.raises(ValueError, match="keep_grad=True .* cannot be combined with fuse_heads='mean'"):
        attnroll.capture(model, x, keep_grad=True, fuse_heads="mean", **kw)
    with pytest.raises(ValueError, match="dtype='float64' would store copies"):
        attnroll.capture(model, x, keep_grad=True, dtype="float64", **kw)
    with pytest.raises(TypeError, match="inputs must be a dict .* got int"):
        attnroll.capture(model, 3, **kw)


def test_keep_grad_needs_a_graph():
    torch.manual_seed(0)
    model, x = Toy(), torch.randn(1, 4, 8)
    with pytest.raises(CaptureError, match="not part of an autograd graph"):
        with attnroll.capture(model, keep_grad=True, modules=r"blocks\.\d", to_probs=lambda m, a, o: o[1].softmax(-1).detach()):
            model(x)


def test_record_access():
    a = [torch.rand(1, 2, 3, 3) for _ in range(2)]
    rec = AttentionRecord(streams={"vision": a, "text": a[:1]})
    with pytest.raises(ValueError, match="several attention streams \\('vision', 'text'\\)"):
        rec.attentions
    with pytest.raises(ValueError, match="stream must be one of 'vision', 'text'; got 'self'"):
        rec.stream("self")
    assert rec.stream("vision") is a and rec.stacked("vision").shape == (2, 1, 2, 3, 3)
    only = AttentionRecord(streams={"encoder": a})
    assert only.attentions is a and only.num_layers == 2
    assert "encoder: 2 x (1, 2, 3, 3)" in repr(only)
    with pytest.raises(ValueError, match="holds no attention"):
        AttentionRecord().attentions


def test_forward_signature_is_the_bound_forwards_own():
    """The cached signature equals inspect.signature(model.forward) for class forwards, decorated ones and a
    forward set on the instance (not cached: it may differ per instance)."""
    import functools
    import inspect

    from torch import nn

    from attnroll.capture.hooks import forward_signature

    class Decorated(nn.Module):
        @functools.wraps(nn.Linear.forward)
        def forward(self, *args, **kwargs):
            return args

    patched = nn.Linear(2, 2)
    patched.forward = lambda x, scale=2.0: x * scale
    for m in (nn.Linear(2, 2), nn.MultiheadAttention(4, 2), Decorated(), patched):
        assert forward_signature(m) == inspect.signature(m.forward)
