"""The private transformers surface attnroll reads (capture/transformers_private.py) is still where its
accessors look in the installed transformers, and the accessors leave a model as they found it."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from attnroll.capture import transformers_private as P

T = pytest.importorskip("transformers")


def test_the_installed_transformers_has_the_private_surface():
    assert P.surface_problems() == []


def test_the_surface_check_can_fail(monkeypatch):
    """A transformers without the recorder declaration or the kernel lookup is reported, naming each."""
    monkeypatch.setattr(P, "declared_outputs", lambda pm: {})
    monkeypatch.setattr(P, "sdpa_kernel", lambda: (_ for _ in ()).throw(ImportError("no sdpa kernel")))
    problems = P.surface_problems()
    assert any("no 'attentions' output recorder" in p for p in problems), problems
    assert any("no sdpa kernel" in p for p in problems), problems


def test_the_recorder_declaration_names_bert_s_attention_modules():
    model = T.BertModel(T.BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                                     vocab_size=10))
    specs = P.recorder_specs(P.declared_outputs(model))
    hits = [n for n, m in model.named_modules() for key, cls, suffix, _, _ in specs
            if key == "attentions" and ((cls is not None and isinstance(m, cls)) or (suffix and n.endswith(suffix)))]
    assert hits and all("attention" in n for n in hits), hits


def test_an_unknown_recorder_entry_is_a_private_change():
    with pytest.raises(P.PrivateChanged, match="unknown recorder entry int"):
        P.recorder_specs({"attentions": [3]})


def test_force_eager_and_the_interface_wrapper_are_undone():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    config = T.BertConfig(attn_implementation="sdpa")
    before = (dict(config.__dict__), AttentionInterface.__dict__["get_interface"],
              AttentionInterface.__dict__.get("__getitem__"))
    seen = []
    with ExitStack() as stack:
        P.force_eager(stack, config)
        P.wrap_attention_interface(stack, lambda kernel, impl: seen.append(impl) or kernel)
        assert P.attn_implementation(config) == "eager"
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is P.sdpa_kernel() and seen == ["sdpa"]
    after = (dict(config.__dict__), AttentionInterface.__dict__["get_interface"],
             AttentionInterface.__dict__.get("__getitem__"))
    assert after == before and P.attn_implementation(config) == "sdpa"
