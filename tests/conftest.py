import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Deterministic, bounded property tests: the suite must stay fast on 2 cores and reproducible in CI.
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _one_thread():
    """Every model in the suite is tiny: one intra-op thread is much faster than several fighting over the
    2 shared cores of the CI machine (measured 10-40x). Restored after each test."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    """A tiny random BERT sequence classifier (2 labels) with its tokenizer, saved as a transformers folder."""
    T = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
    (d / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = T.BertTokenizer(str(d / "vocab.txt"))
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=37, max_position_embeddings=64, num_labels=2, initializer_range=0.3)
    T.BertForSequenceClassification(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    return d
