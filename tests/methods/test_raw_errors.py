"""Errors that used to leak from torch or a wrong check, each now refused with its cause and its fix: a dense
capture too large for memory (estimated before the forward pass), a bfloat16 model with a value-aware
method, and a positional ``None`` in a tuple of inputs (accepted, as the model's forward accepts it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll import UnsupportedModelError  # noqa: E402
from attnroll.explain import memory  # noqa: E402

HEADS, LAYERS = 2, 3


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        num_key_value_heads=HEADS, intermediate_size=37, max_position_embeddings=512)
    return T.LlamaForCausalLM(cfg).eval()


def _no_forward(model):
    calls = []
    return calls, model.register_forward_pre_hook(lambda *a: calls.append(1))


# ------------------------------------------------------------------------------------- dense memory
@pytest.mark.parametrize("method, kw, fix", [
    ("rollout", {"attention": "dense"}, "attention='recompute'"),
    ("rollout", {"discard_ratio": 0.5}, "attention='recompute'"),
    ("flow", {}, "a method with a matrix-free route"),
    ("gae", {"attention": "dense"}, "attention='recompute'"),
])
def test_a_dense_capture_too_large_is_refused_with_the_estimate_and_the_fix(llama, monkeypatch, method, kw, fix):
    n = 200
    monkeypatch.setattr(memory, "available_memory", lambda: 2**20)  # 1 MiB free
    calls, handle = _no_forward(llama)
    try:
        with pytest.raises(MemoryError) as err:
            attnroll.explain(llama, {"input_ids": torch.randint(5, 90, (2, n))}, method, **kw)
    finally:
        handle.remove()
    msg = str(err.value)
    assert calls == []  # refused before the forward pass allocated anything
    assert "allocate" not in msg and f"2 example(s) x {n} tokens, {HEADS} heads, {LAYERS} layers" in msg
    assert "GiB, but only about 0.00 GiB is available" in msg
    assert fix in msg and "shorter input" in msg


def test_the_estimate_covers_what_the_capture_keeps(llama):
    """Independent check: the record's matrices (kept per layer) and one layer's scores + probabilities are
    no more than the estimate; the fused estimate is smaller than the unfused one."""
    B, n = 2, 40
    rec = attnroll.capture(llama, {"input_ids": torch.randint(5, 90, (B, n))})
    kept = sum(t.numel() * t.element_size() for layers in rec.streams.values() for t in layers)
    one_layer = 2 * B * HEADS * n * n * 4
    est = memory.dense_bytes(B, n, HEADS, LAYERS)
    assert kept + one_layer <= est
    assert memory.dense_bytes(B, n, HEADS, LAYERS, fused=True) < est < memory.dense_bytes(B, n, HEADS, LAYERS,
                                                                                           keep_grad=True)


def test_an_input_that_fits_is_explained_as_before(llama, monkeypatch):
    x = {"input_ids": torch.randint(5, 90, (1, 16))}
    want = attnroll.explain(llama, x, "rollout", attention="dense")
    need = memory.dense_bytes(1, 16, HEADS, LAYERS, fused=True)
    monkeypatch.setattr(memory, "available_memory", lambda: need)  # exactly enough
    torch.testing.assert_close(attnroll.explain(llama, x, "rollout", attention="dense").scores, want.scores)


def test_a_torch_encoder_s_dense_capture_is_checked_too(monkeypatch):
    """A model without a transformers config: heads and layers from its nn.MultiheadAttention modules."""
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                enable_nested_tensor=False).eval()
    monkeypatch.setattr(memory, "available_memory", lambda: 1024)
    assert memory._heads_layers(enc) == (2, 2)
    # (B, n, d) floats carry no token count the check can read: it stays out of the way
    attnroll.explain(enc, torch.randn(1, 6, 16), "rollout")


# ------------------------------------------------------------------------------------------ bfloat16
VALUE_AWARE = ("alti", "alti_logit", "decompx", "globenc", "norm", "norm_rollout", "value_zeroing", "measured_rollout")


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=37, max_position_embeddings=64, num_labels=3)
    return T.BertForSequenceClassification(cfg).eval()


@pytest.mark.parametrize("method", VALUE_AWARE)
def test_value_aware_methods_name_bfloat16_and_the_cast(bert, method):
    import copy

    x = {"input_ids": torch.randint(5, 90, (1, 7))}
    low = copy.deepcopy(bert).to(torch.bfloat16)
    with pytest.raises(UnsupportedModelError) as err:
        attnroll.explain(low, x, method)
    msg = str(err.value)
    assert f"method {method!r} does not support bfloat16" in msg and "model.float()" in msg
    assert "does not compute a LayerNorm" not in msg
    e = attnroll.explain(low.float(), x, method)  # the fix the message gives works
    assert e.scores.shape == (1, 7) and torch.isfinite(e.scores).all()


def test_bfloat16_attention_methods_still_run(bert):
    import copy

    low = copy.deepcopy(bert).to(torch.bfloat16)
    e = attnroll.explain(low, {"input_ids": torch.randint(5, 90, (1, 7))}, "rollout")
    assert torch.isfinite(e.scores).all()


# ---------------------------------------------------------------------------------- positional None
def test_a_positional_none_is_passed_to_the_forward_as_torch_does():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0), 2,
                                enable_nested_tensor=False).eval()
    src = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    got = attnroll.explain(enc, (src, None, pad), "rollout")
    want = attnroll.explain(enc, {"src": src, "src_key_padding_mask": pad}, "rollout")
    torch.testing.assert_close(got.scores, want.scores)
    assert torch.all(got.scores[1, 3:] == 0)  # the mask after the None reached the forward


@pytest.mark.parametrize("inputs, item", [((None, torch.zeros(1, 2, 16)), 0), ((torch.zeros(1, 2, 16), "mask"), 1)])
def test_a_tuple_still_refuses_what_is_not_a_tensor(inputs, item):
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1,
                                enable_nested_tensor=False).eval()
    with pytest.raises(TypeError, match=f"whose item {item} is"):
        attnroll.explain(enc, inputs, "rollout")
