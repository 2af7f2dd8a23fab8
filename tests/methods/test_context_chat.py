"""Context attribution through a chat template (the user's prompt inside the templated text, units still over
the prompt), readable token pieces, and the result's JSON / HTML forms."""

from __future__ import annotations

import json

import pytest
import torch

import attnroll

from .test_context import PROMPT, WORDS, llama

T = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(template: bool = True):
    words = WORDS[: len(WORDS) - 2] + ["user", "assistant"]  # the model's vocabulary has len(WORDS) + 2 ids
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="<s>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if template:
        tok.chat_template = TEMPLATE
    return tok


def test_the_template_goes_around_the_prompt_and_units_stay_on_it():
    m, tok = llama(), chat_tokenizer()
    m.resize_token_embeddings(len(tok), mean_resizing=False)
    # attn_grad: its token scores do not depend on which tokens form units (gate_grad gates the units' tokens)
    ca = attnroll.context_attribution(m, tok, PROMPT, answer="paris", unit="sentence", sinks="keep",
                                      method="attn_grad")
    assert ca.chat_template and ca.input_text.startswith("<|im_start|>user\n" + PROMPT)
    assert ca.tokens[:2] == ["<|im_start|>", "user"] and ca.tokens[-2:] == ["\n<|im_start|>", "assistant"]
    assert [u["text"] for u in ca.units] == ["the cat sat on the mat .", "a dog ran in the park .",
                                             "paris is the capital of france .", "(chat template)"]
    for u in ca.units[:-1]:
        assert PROMPT[u["span"][0]:u["span"][1]] == u["text"]  # spans are in the user's prompt
    # the same text read as it is gives the same token scores (an independent route to the same input)
    raw = attnroll.context_attribution(m, tok, ca.input_text, answer="paris", unit="token", chat_template=False,
                                       sinks="keep", method="attn_grad")
    assert not raw.chat_template
    torch.testing.assert_close(ca.token_scores, raw.token_scores, atol=1e-6, rtol=0)
    owner = torch.tensor(ca.token_units)
    for k, u in enumerate(ca.units):
        assert u["score"] == pytest.approx(float(ca.token_scores[owner == k].sum()), abs=1e-6)
    template = [i for i, t in enumerate(ca.tokens) if t.strip() in ("<|im_start|>", "<|im_end|>", "user",
                                                                   "assistant")]
    assert sorted(torch.nonzero(owner == 3).reshape(-1).tolist()) == template
    assert sum(u["share"] for u in ca.units) == pytest.approx(1.0, abs=1e-6)


def test_a_templated_prompt_is_read_as_it_is_and_true_needs_a_template():
    m, tok = llama(), chat_tokenizer()
    m.resize_token_embeddings(len(tok), mean_resizing=False)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ca = attnroll.context_attribution(m, tok, text, answer="paris")
    assert not ca.chat_template and ca.input_text == text
    plain = chat_tokenizer(template=False)
    assert not attnroll.context_attribution(m, plain, PROMPT, answer="paris").chat_template
    with pytest.raises(ValueError, match="has no chat template"):
        attnroll.context_attribution(m, plain, PROMPT, answer="paris", chat_template=True)
    with pytest.raises(TypeError, match="chat_template must be None, True or False"):
        attnroll.context_attribution(m, tok, PROMPT, answer="paris", chat_template="yes")


def byte_level_tokenizer():
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([PROMPT, "The Tower of London.\nA tower is tall."] * 20, vocab_size=300,
                            min_frequency=1, show_progress=False)
    return T.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, unk_token=None)


def test_tokens_are_readable_pieces_not_byte_level_symbols():
    tok = byte_level_tokenizer()
    from attnroll.explain.prompts import answer_pieces, encode_prompt

    text = "The Tower of London.\nA tower is tall."
    enc = encode_prompt(tok, text, chat_template=False)
    raw = tok.convert_ids_to_tokens(enc.ids[0].tolist())
    assert any("Ġ" in r or "Ċ" in r for r in raw)  # the tokenizer's own symbols are byte-level
    assert "".join(enc.pieces) == text and not any("Ġ" in p or "Ċ" in p for p in enc.pieces)
    ids = tok(" tower is tall.\nThe", add_special_tokens=False)["input_ids"]
    assert "".join(answer_pieces(tok, ids)) == " tower is tall.\nThe"


def test_json_and_html_forms(tmp_path):
    from attnroll.viz.viewer import decode_rows, read_payload

    m, tok = llama(), chat_tokenizer()
    m.resize_token_embeddings(len(tok), mean_resizing=False)
    ca = attnroll.context_attribution(m, tok, PROMPT, answer="paris is", unit="sentence")
    d = json.loads(ca.to_json(tmp_path / "c.json"))
    assert d == json.loads((tmp_path / "c.json").read_text()) == json.loads(json.dumps(ca.to_dict()))
    assert d["answer"] == ca.answer and d["tokens"] == ca.tokens and d["chat_template"] is True
    assert d["token_scores"] == pytest.approx(ca.token_scores.tolist())
    assert [u["share"] for u in d["units"]] == pytest.approx([u["share"] for u in ca.units])
    page = ca.to_html(tmp_path / "c.html")
    assert (tmp_path / "c.html").read_text() == page
    ex = read_payload(page)["examples"][0]
    assert ex["kind"] == "tokens" and len(ex["tokens"]) == len(ca.tokens)
    got = decode_rows(ex["maps"][ca.method]["final"])[0]
    assert abs(got - ca.token_scores.numpy()).max() <= 1e-3 * float(ca.token_scores.abs().max())
    labels = [s[0] for s in ex["segments"]]  # one segment per run of a unit's tokens, "(other)" for the template
    assert labels[0] == "(chat template)" and "the cat sat on the mat ." in labels and labels[-1] == "(chat template)"
    covered = sorted(i for s in ex["segments"] for i in range(s[1], s[2]))
    assert covered == list(range(len(ca.tokens)))
    compact = ca.to_html(interactive=False)
    assert "<script" not in compact and "paris is" in compact and "%" in compact
