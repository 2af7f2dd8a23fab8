"""Generation-time attribution: every generated token over the prompt and the earlier generated tokens, each
row against an independent computation (explain on that token's prefix alone, dense route), on the zoo's tiny
random-weight decoders."""

from __future__ import annotations

import json

import pytest
import torch

import attnroll

from ..zoo import sharp

T = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = "the cat sat on mat . a dog ran in park paris is capital of france what where".split()
PROMPT = "the cat sat on the mat . a dog ran in the park . paris is the capital of france ."


def word_tokenizer(vocab_size: int = 99):
    """A whitespace word-level fast tokenizer whose ids fit the zoo's vocabulary of 99."""
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    assert len(vocab) <= vocab_size
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="<s>")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["rollout", "gae", "grad_rollout"])
def test_each_row_is_the_method_on_that_prefix_alone(family, method):
    m, tok = sharp.model(family), word_tokenizer()
    answer = "paris is the capital"
    ga = attnroll.generation_attribution(m, tok, PROMPT, answer=answer, method=method, sinks="keep", batch_size=3)
    p = tok(PROMPT, return_tensors="pt")["input_ids"]
    a = tok(answer, add_special_tokens=False)["input_ids"]
    full = torch.cat([p, torch.tensor([a])], dim=1)
    n_in, n_src = p.shape[1], p.shape[1] + len(a) - 1
    assert ga.matrix.shape == (len(a), n_src) and ga.answer_ids == a and ga.n_input == n_in
    for t, tok_id in enumerate(a):
        prefix = full[:, : n_in + t]

        def logp(out, tok_id=tok_id):
            return out.logits[:, -1].float().log_softmax(dim=-1)[:, tok_id]

        ref = attnroll.explain(m, {"input_ids": prefix}, method, target=None if method == "rollout" else logp,
                               attention="dense", sinks="keep").full_row[0]
        torch.testing.assert_close(ga.matrix[t, : n_in + t], ref, atol=1e-5 * max(1.0, float(ref.abs().max())), rtol=0)
        assert float(ga.matrix[t, n_in + t:].abs().sum()) == 0.0  # nothing from the future


def test_rollout_rows_sum_to_the_context_attribution():
    """rollout: the column sums over the prompt are context_attribution's token scores (same sweep, summed)."""
    m, tok = sharp.model("llama"), word_tokenizer()
    ga = attnroll.generation_attribution(m, tok, PROMPT, answer="a dog ran in", sinks="keep", method="rollout")
    ca = attnroll.context_attribution(m, tok, PROMPT, answer="a dog ran in", unit="token", sinks="keep",
                                      method="rollout")
    torch.testing.assert_close(ga.matrix[:, : ga.n_input].sum(dim=0), ca.token_scores, atol=1e-5, rtol=0)
    rows = ga.matrix.sum(dim=1)
    torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=0)  # rollout rows are stochastic
    gen = attnroll.generation_attribution(m, tok, PROMPT, generate=3, method="rollout")
    assert gen.matrix.shape == (3, gen.n_input + 2) and len(gen.answer_tokens) == 3


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_attn_grad_rows_are_context_attribution_of_each_token_on_its_prefix(family):
    """attn_grad: row t equals context_attribution's attn_grad scores of token t alone on the
    prompt + earlier tokens (itself checked against an eager-attention computation in test_context_attn_grad)."""
    m, tok = sharp.model(family), word_tokenizer()
    words = "paris is the capital".split()
    ga = attnroll.generation_attribution(m, tok, PROMPT, answer=" ".join(words), sinks="keep", batch_size=3,
                                         method="attn_grad")
    for t, w in enumerate(words):
        prefix = " ".join([PROMPT, *words[:t]])
        ca = attnroll.context_attribution(m, tok, prefix, answer=w, unit="token", sinks="keep", method="attn_grad")
        n = ga.n_input + t
        assert ca.token_scores.shape == (n,)
        torch.testing.assert_close(ga.matrix[t, :n], ca.token_scores, atol=1e-5, rtol=1e-4)
        assert float(ga.matrix[t, n:].abs().sum()) == 0.0


def test_the_default_is_gate_grad_at_gate_points_one_and_a_quarter():
    m, tok = sharp.model("llama"), word_tokenizer()
    ga = attnroll.generation_attribution(m, tok, PROMPT, answer="a dog", sinks="keep")
    assert ga.method == "gate_grad"
    pinned = attnroll.generation_attribution(m, tok, PROMPT, answer="a dog", sinks="keep", method="gate_grad",
                                             scales=(1.0, 0.25))
    other = attnroll.generation_attribution(m, tok, PROMPT, answer="a dog", sinks="keep", method="gate_grad",
                                            scales=(1.0, 0.5))
    torch.testing.assert_close(ga.matrix, pinned.matrix, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(ga.matrix, other.matrix, atol=1e-6, rtol=1e-5)


def test_batch_size_does_not_change_the_rows():
    m, tok = sharp.model("llama"), word_tokenizer()
    one = attnroll.generation_attribution(m, tok, PROMPT, answer="a dog ran", method="gae", batch_size=1)
    all_ = attnroll.generation_attribution(m, tok, PROMPT, answer="a dog ran", method="gae", batch_size=8)
    torch.testing.assert_close(one.matrix, all_.matrix, atol=1e-6, rtol=1e-5)


def test_sinks_drop_zeroes_their_columns_and_records_their_share():
    m, tok = sharp.model("llama"), word_tokenizer()
    keep = attnroll.generation_attribution(m, tok, PROMPT, answer="a dog ran", sinks="keep")
    drop = attnroll.generation_attribution(m, tok, PROMPT, answer="a dog ran", sinks="drop")
    assert keep.sinks == drop.sinks
    expected = keep.matrix.clone()
    expected[:, drop.sinks] = 0
    torch.testing.assert_close(drop.matrix, expected)
    held = keep.matrix[:, drop.sinks].sum(dim=1) / keep.matrix.sum(dim=1)
    torch.testing.assert_close(drop.sink_share, held, atol=1e-6, rtol=0)


def test_json_and_viewer_carry_the_matrix(tmp_path):
    from attnroll.viz.viewer import decode_rows, read_payload

    m, tok = sharp.model("gpt2"), word_tokenizer()
    ga = attnroll.generation_attribution(m, tok, PROMPT, answer="paris is", method="gae")
    d = json.loads(ga.to_json(tmp_path / "g.json"))
    assert d == json.loads((tmp_path / "g.json").read_text())
    torch.testing.assert_close(torch.tensor(d["matrix"]), ga.matrix)
    assert d["answer_tokens"] == ["paris", " is"] and len(d["source_tokens"]) == ga.matrix.shape[1]
    payload = read_payload(ga.to_html())
    ex = payload["examples"][0]
    assert ex["kind"] == "matrix" and ex["target_tokens"] == ["paris", " is"] and ex["positions"] == [0, 1]
    assert ex["tokens"] == d["source_tokens"]
    rows = decode_rows(ex["maps"]["gae"]["rows"])
    assert rows.shape == tuple(ga.matrix.shape)
    assert abs(rows - ga.matrix.numpy()).max() <= 1e-3 * float(ga.matrix.abs().max())


def test_bad_arguments_name_what_was_wrong():
    m, tok = sharp.model("llama"), word_tokenizer()
    with pytest.raises(ValueError, match="exactly one of generate"):
        attnroll.generation_attribution(m, tok, PROMPT)
    with pytest.raises(ValueError, match="no option 'clamp'"):
        attnroll.generation_attribution(m, tok, PROMPT, generate=1, method="rollout", clamp="none")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        attnroll.generation_attribution(m, tok, PROMPT, generate=1, method="gae", batch_size=0)
    with pytest.raises(TypeError, match=r"decoder-only language model .*got BertForSequenceClassification \(bert\)$"):
        attnroll.generation_attribution(sharp.model("bert"), tok, PROMPT, generate=1)
