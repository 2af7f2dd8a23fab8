"""SmolLM2-135M-Instruct, the real decoder (the ``real`` extra): it loads from the wheel's GGUF in float32 with
its chat template, reads a prompt as a language model does, and its attention sink (token 0 / <|im_start|>)
is found, kept out of the maps by default and kept on request. One load, shared by the module's tests."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnroll
from attnroll.explain.context_attribution import context_attribution

pytestmark = pytest.mark.slow

PROMPT = "Alice lives in Madrid. Bob lives in Oslo. Q: Where does Bob live? A:"
PASSAGES = ["Alice lives in Madrid.", " Bob lives in Oslo.", " Q: Where does Bob live? A:"]


@pytest.fixture(scope="module")
def smol():
    from attnroll.models import load_model, smollm2

    try:
        smollm2.package_dir()
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the 'real' extra is not installed: {e}")
    return load_model("smollm2-135m-instruct")


def test_loads_in_float32_with_its_tokenizer_and_chat_template(smol):
    m, tok = smol.model, smol.tokenizer
    assert smol.kind == "text" and not m.training
    assert sum(p.numel() for p in m.parameters()) == 134_515_008
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert m.config.num_hidden_layers == 30 and m.config.hidden_size == 576
    assert tok("Hello world")["input_ids"] == [19556, 905]  # the GGUF vocabulary's ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system") and chat.endswith("<|im_start|>assistant\n")


def test_it_reads_the_prompt(smol):
    m, tok = smol.model, smol.tokenizer
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logp = m(input_ids=ids).logits[0, -1].log_softmax(-1)
    oslo, madrid = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (" Oslo", " Madrid"))
    assert logp[oslo] > logp[madrid]


def test_rollout_sink_is_dropped_by_default_and_kept_on_request(smol):
    enc = dict(smol.tokenizer(PROMPT, return_tensors="pt"))
    with pytest.warns(UserWarning, match=r"on 'Alice' at position 0.*sinks='keep'"):
        kept = attnroll.explain(smol.model, enc, "rollout", sinks="keep", tokenizer=smol.tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = attnroll.explain(smol.model, enc, "rollout", tokenizer=smol.tokenizer)
    assert e.extra["sinks"] == [[0]] and kept.extra["sinks"] == [[0]]
    share = float(kept.full_row[0, 0] / kept.full_row[0].sum())
    assert share > 0.999  # the collapse the option exists for
    assert abs(float(e.extra["sink_share"][0]) - share) < 1e-5
    assert float(e.full_row[0, 0]) == 0.0 and abs(float(e.full_row[0].sum()) - 1.0) < 1e-4
    rest = kept.full_row[0, 1:] / kept.full_row[0, 1:].sum()
    torch.testing.assert_close(e.full_row[0, 1:], rest, atol=1e-5, rtol=1e-3)
    assert float(e.full_row[0].max()) < 0.9


def test_the_chat_template_sink_is_its_first_special_token(smol):
    tok = smol.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    e = attnroll.explain(smol.model, dict(tok(chat, return_tensors="pt")), "rollout", tokenizer=tok)
    assert 0 in e.extra["sinks"][0] and e.tokens[0][0] == "<|im_start|>"
    assert float(e.extra["sink_share"][0]) > 0.99


@pytest.mark.parametrize("method", ["rollout", "gae", "grad_rollout"])
def test_context_attribution_gives_the_first_passage_no_credit_for_token_0(smol, method):
    # the plain prompt (token 0 "Alice"), as these shares were measured; the chat template is tested elsewhere
    kw = dict(answer=" Oslo", segments=PASSAGES, method=method, chat_template=False)
    keep = context_attribution(smol.model, smol.tokenizer, PROMPT, sinks="keep", **kw)
    drop = context_attribution(smol.model, smol.tokenizer, PROMPT, **kw)
    assert keep.sinks == [0] and drop.sinks == [0]
    t0 = float(keep.token_scores[0])
    assert abs(drop.sink_share - t0 / keep.total) < 1e-4
    assert float(drop.token_scores[0]) == 0.0 and torch.equal(drop.token_scores[1:], keep.token_scores[1:])
    assert abs(sum(u["share"] for u in drop.units) - 1.0) < 1e-5
    if method == "rollout":
        assert keep.units[0]["share"] > 0.999 and drop.units[0]["share"] < 0.9
    assert drop.units[1]["share"] > keep.units[1]["share"]  # Bob's passage gains what token 0 held
