"""Context attribution for decoders: the answer's relevance over the prompt, against explain's dense route row by
row, and its aggregation to words, sentences and given segments (shares add up to the total)."""

from __future__ import annotations

import json

import pytest
import torch

import attnroll
from attnroll.core import segments as seg

T = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = "the cat sat on mat . a dog ran in park paris is capital of france what where".split()
PROMPT = "the cat sat on the mat . a dog ran in the park . paris is the capital of france ."


def word_tokenizer():
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="<s>")


def llama():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=len(WORDS) + 2, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, bos_token_id=1,
                        eos_token_id=1, max_position_embeddings=64)
    return T.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("method", ["rollout", "gae", "grad_rollout"])
def test_token_scores_are_the_answer_rows_of_the_dense_route(method):
    """Row t of the span = explain's row at the position predicting answer token t (dense, eager capture);
    gradient methods share one target, the span's total log-probability."""
    m, tok = llama(), word_tokenizer()
    answer = "paris is capital"
    ca = attnroll.context_attribution(m, tok, PROMPT, answer=answer, unit="token", method=method)
    p = tok(PROMPT, return_tensors="pt")["input_ids"]
    a = tok(answer, add_special_tokens=False)["input_ids"]
    ids = torch.cat([p, torch.tensor([a])], dim=1)
    rows = [p.shape[1] - 1 + t for t in range(len(a))]

    def span_logprob(out):
        logp = out.logits[:, rows].log_softmax(dim=-1)
        return logp[:, torch.arange(len(a)), torch.tensor(a)].sum(dim=-1)

    target = None if method == "rollout" else span_logprob
    ref = sum(attnroll.explain(m, {"input_ids": ids}, method, target=target, position=r, attention="dense")
              .full_row[0, : p.shape[1]] for r in rows)
    torch.testing.assert_close(ca.token_scores, ref, atol=1e-5 * max(1.0, float(ref.abs().max())), rtol=0)
    assert ca.answer_ids == a


@pytest.mark.parametrize("unit", ["token", "word", "sentence"])
def test_shares_add_up_to_the_total(unit):
    # attn_grad: non-negative scores (gate_grad's signed ones are checked in test_context_gate_grad)
    ca = attnroll.context_attribution(llama(), word_tokenizer(), PROMPT, generate=3, unit=unit, method="attn_grad")
    assert sum(u["share"] for u in ca.units) == pytest.approx(1.0, abs=1e-6)
    assert sum(u["score"] for u in ca.units) == pytest.approx(ca.total, rel=1e-6)
    assert ca.total == pytest.approx(float(ca.token_scores.sum()), rel=1e-6)
    assert len(ca.answer_ids) == 3


def test_sentences_and_segments_sum_their_tokens():
    # attn_grad: its token scores do not depend on the units (gate_grad's gates at m < 1 cover the units' tokens)
    m, tok = llama(), word_tokenizer()
    by_token = attnroll.context_attribution(m, tok, PROMPT, answer="france", unit="token", method="attn_grad")
    s = by_token.token_scores  # one token per word in this tokenizer
    sent = attnroll.context_attribution(m, tok, PROMPT, answer="france", unit="sentence", method="attn_grad")
    assert [u["text"] for u in sent.units] == ["the cat sat on the mat .", "a dog ran in the park .",
                                               "paris is the capital of france ."]
    torch.testing.assert_close(torch.tensor([u["score"] for u in sent.units]),
                               torch.stack([s[:7].sum(), s[7:14].sum(), s[14:].sum()]), atol=1e-6, rtol=0)
    rag = attnroll.context_attribution(m, tok, PROMPT, answer="france", method="attn_grad",
                                       segments=["a dog ran in the park .", "paris is the capital"])
    assert [u["text"] for u in rag.units] == ["a dog ran in the park .", "paris is the capital", "(other)"]
    other = s[:7].sum() + s[18:].sum()
    torch.testing.assert_close(torch.tensor([u["score"] for u in rag.units]),
                               torch.stack([s[7:14].sum(), s[14:18].sum(), other]), atol=1e-6, rtol=0)
    assert rag.ranked()[0]["share"] == max(u["share"] for u in rag.units)


def test_span_helpers():
    text = "One two.  Three? Four\n\nFive"
    assert [text[a:b] for a, b in seg.sentence_spans(text)] == ["One two.", "Three?", "Four", "Five"]
    assert [text[a:b] for a, b in seg.word_spans(text)] == ["One", "two.", "Three?", "Four", "Five"]
    assert seg.assign([(0, 0), (0, 3), (3, 7), (9, 14)], text, seg.word_spans(text)) == [-1, 0, 1, 2]
    units, other = seg.aggregate(torch.tensor([1.0, 2.0, 3.0, 4.0]), [-1, 0, 0, 1], 3)
    assert units.tolist() == [5.0, 4.0, 0.0] and float(other) == 1.0


def test_bad_arguments():
    m, tok = llama(), word_tokenizer()
    with pytest.raises(ValueError, match="does not occur in the prompt"):
        attnroll.context_attribution(m, tok, PROMPT, answer="paris", segments=["paris", "the cat"])
    with pytest.raises(ValueError, match="exactly one of generate"):
        attnroll.context_attribution(m, tok, PROMPT)
    with pytest.raises(ValueError, match="unit must be one of"):
        attnroll.context_attribution(m, tok, PROMPT, generate=1, unit="paragraph")
    with pytest.raises(ValueError, match="no option 'discard_ratio'"):
        attnroll.context_attribution(m, tok, PROMPT, generate=1, discard_ratio=0.5)
    bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37))
    with pytest.raises(TypeError, match="decoder-only language model"):
        attnroll.context_attribution(bert, tok, PROMPT, generate=1)


def test_cli_generate(tmp_path):
    pytest.importorskip("click")
    from click.testing import CliRunner

    from attnroll.commands import cli

    d = tmp_path / "lm"
    llama().save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT, encoding="utf-8")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["explain", "--model", str(d), "--text", str(prompt), "--generate", "2",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("answer (2 tokens): ")
    written = json.loads(next(out.glob("*.context.checked.json")).read_text())  # context attribution's default
    shares = [u["share"] for u in written["units"]]
    assert sum(shares) == pytest.approx(1.0, abs=1e-5) and len(shares) == 3  # gate_grad's signed float32 scores
    top = max(written["units"], key=lambda u: u["share"])
    assert f"{100 * top['share']:6.2f}%  {top['text']}" in res.output  # the ranking printed first
    bad = CliRunner().invoke(cli, ["explain", "--model", str(d), "--text", str(prompt), "--generate", "2",
                                   "--segment", "not in the prompt", "--out", str(out)])
    assert bad.exit_code == 1 and bad.stderr.strip().startswith("error: segments[0]")
    usage = CliRunner().invoke(cli, ["explain", "--model", str(d), "--text", "x", "--generate", "2", "--pair", "y"])
    assert usage.exit_code == 2 and "--generate needs --text" in usage.stderr
