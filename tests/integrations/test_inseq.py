"""attnroll methods registered as inseq attribution methods: each generation step's target attributions are
attnroll's own scores for that step's prefix and generated token."""

from __future__ import annotations

import pytest
import torch

inseq = pytest.importorskip("inseq")
T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
import attnroll.integrations.inseq as ai  # noqa: E402

pytestmark = pytest.mark.slow  # importing inseq takes several seconds
VOCAB = 64


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "<bos>": VOCAB - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path_factory.mktemp("tok")
    T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<bos>", eos_token="<bos>",
                              pad_token="<unk>").save_pretrained(d)
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=VOCAB - 1,
                       eos_token_id=VOCAB - 1, initializer_range=0.3)
    return T.GPT2LMHeadModel(cfg).eval(), T.AutoTokenizer.from_pretrained(d)


def test_registered_through_inseq():
    names = set(inseq.list_feature_attribution_methods())
    assert {ai.PREFIX + m for m in ai.METHODS} <= names and "" not in names
    with pytest.raises(ValueError, match="registered already"):
        ai.register("rollout")


@pytest.mark.parametrize("method", ["rollout", "gae"])
def test_every_generation_step_is_attnroll_s_own_result(lm, method):
    hf, tok = lm
    model = inseq.load_model(hf, ai.PREFIX + method, tokenizer=tok)
    out = model.attribute("w1 w2 w3 w4 w5", generation_args={"max_new_tokens": 3}, show_progress=False)
    seq = out.sequence_attributions[0]
    ids = [t.id for t in seq.target]
    n_prompt = len(seq.source)
    assert seq.target_attributions.shape == (len(ids), 3)
    for step in range(3):
        prefix = torch.tensor([ids[:n_prompt + step]])
        want = attnroll.explain(hf, {"input_ids": prefix, "attention_mask": torch.ones_like(prefix)}, method,
                                target=[ids[n_prompt + step]]).scores[0]
        got = seq.target_attributions[:n_prompt + step, step]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert torch.isnan(seq.target_attributions[n_prompt + step:, step]).all()  # nothing after the prefix


def test_options_and_encoder_decoders(lm):
    hf, tok = lm
    name = ai.register("rollout", name="attnroll_rollout_last_layer", start_layer=1)
    out = inseq.load_model(hf, name, tokenizer=tok).attribute("w1 w2 w3", generation_args={"max_new_tokens": 1},
                                                              show_progress=False)
    ids = torch.tensor([[t.id for t in out.sequence_attributions[0].target][:3]])
    want = attnroll.explain(hf, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "rollout",
                            start_layer=1).scores[0]
    torch.testing.assert_close(out.sequence_attributions[0].target_attributions[:3, 0], want, atol=1e-5, rtol=0)
    t5 = T.T5ForConditionalGeneration(T.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                 num_heads=2, decoder_start_token_id=0))
    with pytest.raises(ValueError, match="decoder-only"):
        inseq.load_model(t5, ai.PREFIX + "rollout", tokenizer=tok)
