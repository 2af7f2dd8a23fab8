"""The trained state-space classifiers (attnroll.models.state_space): they load by name, reach the held-out accuracy
their cards record, read the last real token, and their full-stack rollout is the product of the captured layers."""

from __future__ import annotations

import re

import pytest
import torch

import attnroll
from attnroll.core.rollout import rollout

T = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from attnroll.models import evidence, load_model, state_space  # noqa: E402

NAMES = tuple(state_space.MODELS)


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
    return request.param, load_model(request.param)


def test_vocabulary_covers_every_generated_word():
    vocab = state_space.vocabulary()
    assert len(set(vocab)) == len(vocab) and vocab[:3] == list(state_space.SPECIALS)
    ex = evidence.make_examples(400, 7)
    tok = state_space.word_tokenizer(vocab)
    enc, mask = evidence.encode(tok, ex)
    assert not (enc["input_ids"] == 1).any()  # no [UNK]
    for b, words in enumerate(ex.words):  # one token per word, then [END], then padding
        n = len(words)
        assert tok.convert_ids_to_tokens(enc["input_ids"][b, :n].tolist()) == words
        assert int(enc["input_ids"][b, n]) == 2 and int(enc["attention_mask"][b].sum()) == n + 1
        assert mask[b, :n].tolist() == ex.evidence[b] and not mask[b, n:].any()


def test_loaded_by_name_as_text_classifiers(loaded):
    name, lm = loaded
    assert lm.kind == "text" and lm.labels == {0: "negative", 1: "positive"} and not lm.model.training
    saved = set(state_space.load_state_space_model(name)[0].state_dict())
    assert saved == set(lm.model.state_dict())


def test_logits_are_the_last_real_tokens(loaded):
    """Right padding changes nothing: each row's logits are those of the sentence run alone."""
    _, lm = loaded
    ex = evidence.make_examples(4, 3)
    enc, _ = evidence.encode(lm.tokenizer, ex)
    with torch.no_grad():
        batched = lm.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        for b in range(4):
            n = int(enc["attention_mask"][b].sum())
            alone = lm.model(input_ids=enc["input_ids"][b:b + 1, :n]).logits
            torch.testing.assert_close(batched[b:b + 1], alone, atol=1e-5, rtol=1e-4)
    assert batched.shape == (4, 2)


def test_rollout_is_the_product_of_the_captured_layers(loaded):
    """explain's full-stack rollout = core rollout over every captured layer (mixers and attention), and the
    hybrid's record holds its mixer layers where the config puts Mamba-2 and softmax attention where it puts it."""
    name, lm = loaded
    ex = evidence.make_examples(3, 11)
    enc, _ = evidence.encode(lm.tokenizer, ex)
    x = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    layers = attnroll.capture(lm.model, x).streams["self"]
    cfg = lm.model.config
    assert len(layers) == cfg.num_hidden_layers
    attn = set(getattr(cfg, "attn_layer_indices", None) or [])
    for i, a in enumerate(layers):  # a mixer's fused matrix is repeated over the heads; attention heads differ
        assert bool((a == a[:, :1]).all()) == (i not in attn)
    R = rollout([a.to(torch.float64) for a in layers], attention_mask=x["attention_mask"])
    last = x["attention_mask"].sum(1) - 1
    want = torch.stack([R[b, int(last[b])] for b in range(3)]).to(torch.float32)
    e = attnroll.explain(lm.model, x, method="rollout", sinks="keep")
    torch.testing.assert_close(e.full_row, want * x["attention_mask"], atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # the whole held-out set
@pytest.mark.parametrize("name", NAMES)
def test_held_out_accuracy_matches_the_card(name):
    card = (state_space.model_dir(name) / "MODEL_CARD.md").read_text(encoding="utf-8")
    n, seed = map(int, re.search(r"`make_examples\((\d+), seed=(\d+)\)`, the shipped", card).groups())
    m = re.search(r"\| all \| (\d+) \| (\d\.\d+) \|", card)
    assert m is not None and int(m.group(1)) == n and seed == evidence.TEST_SEED
    lm = load_model(name)
    ex = evidence.make_examples(n, seed)
    pred = []
    with torch.no_grad():
        for i in range(0, n, 250):
            enc = lm.tokenizer(ex.words[i:i + 250], is_split_into_words=True, padding=True, return_tensors="pt")
            pred.append(lm.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.argmax(1))
    acc = float((torch.cat(pred).numpy() == ex.labels).mean())
    assert abs(acc - float(m.group(2))) <= 1.5 / n


def test_missing_weights_name_the_recipe(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_state_space.py --model bamba-evidence"):
        state_space.load_state_space_model("bamba-evidence", tmp_path)
    with pytest.raises(ValueError, match="name must be one of"):
        state_space.load_state_space_model("mamba3")


@pytest.mark.slow  # trains twice (a few steps)
def test_training_is_reproducible(tmp_path):
    from tests.models._tools import load_tool

    train = load_tool("train/train_state_space.py")
    args = ["--model", "mamba2-evidence", "--steps", "2", "--train-size", "64", "--test-size", "16",
            "--batch-size", "4"]
    for d in ("a", "b"):
        assert train.main([*args, "--out", str(tmp_path / d)]) == 0
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    card = (tmp_path / "a/MODEL_CARD.md").read_text()
    assert "2 AdamW steps of 4 sentences" in card and "| all | 16 |" in card


@pytest.mark.slow  # the CLI end to end
def test_cli_evaluate_reads_the_evidence_sentences_by_default(tmp_path):
    """``attnroll evaluate --model bamba-evidence`` scores the generated sentences with their evidence masks, as the
    library does on the same sentences."""
    pytest.importorskip("click")
    import csv
    import io

    from attnroll.evaluate import evaluate_methods
    from tests.commands.test_cli import run

    res = run("evaluate", "--model", "bamba-evidence", "--n", 6, "--seed", 5, "--methods", "rollout,random",
              "-o", "rollout.sinks=keep", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    rows = {r["method"]: r for r in csv.DictReader(io.StringIO((tmp_path / "evaluation.csv").read_text()))}
    lm = load_model("bamba-evidence")
    ex = evidence.make_examples(6, 5)
    enc, masks = evidence.encode(lm.tokenizer, ex)
    want = evaluate_methods(lm.model, enc, ["rollout", "random"], masks=masks, labels=ex.labels,
                            method_options={"rollout": {"sinks": "keep"}})
    for m in ("rollout", "random"):
        for k in ("comprehensiveness", "evidence_pointing", "evidence_mass"):
            assert float(rows[m][k]) == pytest.approx(want.values[m][k], rel=1e-5, abs=1e-9), (m, k)


@pytest.mark.slow  # a Jacobian through transformers' scan, per layer
def test_mamba2_evidence_layers_are_the_fused_jacobians_of_its_scan(monkeypatch):
    """On the trained pure Mamba-2 model, each captured layer equals the fused Jacobian of transformers' own
    convolution and scan functions (the independent reading of tests/capture/test_mixers_capture.py)."""
    import copy

    from tests.capture.test_mixers_capture import _scan_jacobian_fused

    model = copy.deepcopy(load_model("mamba2-evidence").model).double()
    tok = state_space.word_tokenizer(state_space.vocabulary())
    enc = tok([evidence.make_examples(1, 4).words[0][:7]], is_split_into_words=True, return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    rec = attnroll.capture(model, inputs)
    want = _scan_jacobian_fused(model, inputs, monkeypatch)
    assert len(rec.streams["self"]) == len(want) == 3
    for got, ref in zip(rec.streams["self"], want):
        torch.testing.assert_close(got[:, 0], ref, atol=1e-8, rtol=0)
