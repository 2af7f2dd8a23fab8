"""Text AOPC (ERASER comprehensiveness / sufficiency): a hand-built classifier where one token decides the
class, hand-built re-packing, and a tiny random BERT against a naive one-sequence-at-a-time loop."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from attnroll.evaluate import text as T


CLS, SEP, PAD, KEY = 1, 2, 0, 7
VOCAB = 20


class BagModel(nn.Module):
    """Sum of per-token class-1 evidence over real tokens: token KEY adds 6, the others small amounts in
    [-0.3, 0.3], special tokens 0; class 0 has a constant logit 1. Records every batch it is called with."""

    def __init__(self, config=None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        ev = (torch.rand(VOCAB, generator=g) - 0.5) * 0.6
        ev[[PAD, CLS, SEP]] = 0.0
        ev[KEY] = 6.0
        self.evidence = ev.double()
        self.config = config or SimpleNamespace(cls_token_id=CLS, sep_token_id=SEP, pad_token_id=PAD)
        self.calls: list[dict[str, torch.Tensor]] = []

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        self.calls.append({"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids})
        e = (self.evidence[input_ids] * attention_mask).sum(dim=1)
        return SimpleNamespace(logits=torch.stack([torch.ones_like(e), e], dim=1))


def p1(evidence: float) -> float:
    return float(1 / (1 + np.exp(1.0 - evidence)))


#      CLS  tokens ..........................  SEP  pad
SEQ = [CLS, 5, KEY, 3, 9, 4, 6, 8, 10, 11, SEP, PAD, PAD]
REAL = 11
POS = list(range(1, 10))  # the 9 removable positions; KEY sits at position 2


def inputs(b: int = 1, seq=SEQ, real=REAL) -> dict[str, torch.Tensor]:
    ids = torch.tensor([seq] * b)
    mask = torch.zeros_like(ids)
    mask[:, :real] = 1
    return {"input_ids": ids, "attention_mask": mask}


def maps_with_rank(ranks, seed: int = 0) -> torch.Tensor:
    """(len(ranks), n): the KEY token at rank r among the removable positions, the others in one fixed
    random order; special tokens and padding score 0 (and would be kept anyway)."""
    others = [p for p in np.random.default_rng(seed).permutation(POS) if p != 2]
    out = torch.zeros(len(ranks), len(SEQ), dtype=torch.float64)
    for b, r in enumerate(ranks):
        order = others[:r] + [2] + others[r:]
        out[b, order] = torch.arange(len(POS), 0, -1, dtype=torch.float64)
    return out


# ------------------------------------------------------------------------------------- one decisive token
def test_ranking_the_key_token_first_is_best_for_both():
    ranks = list(range(len(POS)))
    m = BagModel()
    s = maps_with_rank(ranks)
    comp = T.comprehensiveness(m, inputs(len(ranks)), s)
    suff = T.sufficiency(m, inputs(len(ranks)), s)
    assert (comp.target == 1).all() and comp.higher_is_better and not suff.higher_is_better
    # bins of 9 removable tokens: k = max(1, round(q * 9)) = 1, 1, 1, 2, 4
    # the map ranking KEY first removes it in every bin: the largest drop in every bin, so maximal AOPC
    assert comp.per_example.argmax() == 0 and suff.per_example.argmin() == 0
    assert np.all(comp.curves[0] >= comp.curves[1:] - 1e-12)
    assert np.all(suff.curves[0] <= suff.curves[1:] + 1e-12)
    # by hand: all evidence of example 0's sequence, minus what goes
    ev = m.evidence
    full = float(ev[torch.tensor(SEQ[:REAL])].sum())
    others = [p for p in np.random.default_rng(0).permutation(POS) if p != 2]
    for t, k in enumerate([1, 1, 1, 2, 4]):
        top = [2] + others[: k - 1]
        gone = float(sum(ev[SEQ[p]] for p in top))
        assert comp.curves[0, t] == pytest.approx(p1(full) - p1(full - gone))
        assert suff.curves[0, t] == pytest.approx(p1(full) - p1(gone))
    np.testing.assert_allclose(comp.fractions, T.ERASER_BINS)
    assert comp.value == pytest.approx(comp.per_example.mean())


def test_repack_hand_built():
    ids = torch.tensor([[1, 5, 7, 3, 2, 0], [1, 4, 2, 6, 2, 0]])
    tt = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 0]])
    retain = torch.tensor([[1, 0, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    out = T.repack(ids, retain, tt, pad_token_id=9)
    assert out["input_ids"].tolist() == [[1, 7, 2, 9, 9, 9], [1, 4, 2, 6, 2, 9]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert out["token_type_ids"].tolist() == [[0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0]]
    assert set(T.repack(ids, retain).keys()) == {"input_ids", "attention_mask"}


def test_the_model_sees_the_hand_built_deleted_inputs_and_specials_stay():
    # a pair: [CLS] a b [SEP] c d [SEP] pad, token types 0 0 0 0 1 1 1 0; position 5 (token 6) ranks first
    ids = torch.tensor([[CLS, 5, KEY, SEP, 3, 6, SEP, PAD]])
    enc = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 7 + [0]]),
           "token_type_ids": torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0]])}
    s = torch.tensor([[9.0, 0.1, 0.2, 9.0, 0.3, 0.9, 9.0, 0.0]])  # specials score high: still never removed
    m = BagModel()
    T.comprehensiveness(m, enc, s, bins=(0.01,))
    assert len(m.calls) == 2  # reference, then one batch of perturbed copies
    ref, cut = m.calls
    assert torch.equal(ref["input_ids"], ids) and torch.equal(ref["token_type_ids"], enc["token_type_ids"])
    assert cut["input_ids"].tolist() == [[CLS, 5, KEY, SEP, 3, SEP, PAD, PAD]]
    assert cut["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    assert cut["token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 0, 0]]
    m = BagModel()
    T.sufficiency(m, enc, s, bins=(0.01, 0.5))  # k = 1 and round(0.5 * 4) = 2
    only = m.calls[1]
    assert only["input_ids"].tolist() == [[CLS, SEP, 6, SEP, PAD, PAD, PAD, PAD], [CLS, SEP, 3, 6, SEP, PAD, PAD, PAD]]
    assert only["token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]]


def test_special_tokens_are_never_removed():
    m = BagModel()
    n = 6
    s = torch.from_numpy(np.random.default_rng(1).normal(size=(n, len(SEQ))))
    for fn in (T.comprehensiveness, T.sufficiency):
        fn(m, inputs(n), s, bins=(0.1, 0.5, 1.0), batch_size=4)
    for call in m.calls:
        for row, mask in zip(call["input_ids"], call["attention_mask"]):
            toks = row[mask.bool()].tolist()
            assert toks[0] == CLS and toks[-1] == SEP and toks.count(CLS) == 1 and toks.count(SEP) == 1
            assert (row[~mask.bool()] == PAD).all()


def test_keep_and_special_tokens_mask():
    # a config that knows no special ids: the tokenizer's special_tokens_mask marks them instead
    bare = SimpleNamespace(pad_token_id=PAD)
    enc = inputs(1)
    enc["special_tokens_mask"] = torch.tensor([[1] + [0] * 9 + [1, 1, 1]])
    s = torch.zeros(1, len(SEQ))
    s[0, 0] = s[0, 10] = 5.0  # CLS and SEP score highest: they would go first if they were units
    m = BagModel(bare)
    T.comprehensiveness(m, enc, s, bins=(0.01,))
    assert m.calls[1]["input_ids"][0, :10].tolist() == [CLS, KEY, 3, 9, 4, 6, 8, 10, 11, SEP]
    # keep= overrides: KEY is protected, so the first removable position (5, tie by position) goes
    keep = torch.zeros(1, len(SEQ), dtype=torch.bool)
    keep[0, [0, 2, 10]] = True
    m = BagModel(bare)
    r = T.comprehensiveness(m, inputs(1), torch.zeros(1, len(SEQ)), bins=(0.01,), keep=keep)
    assert m.calls[1]["input_ids"][0, :10].tolist() == [CLS, KEY, 3, 9, 4, 6, 8, 10, 11, SEP]
    assert r.value == pytest.approx(0.0, abs=0.2)


def test_batch_size_and_target():
    m = BagModel()
    s = torch.from_numpy(np.random.default_rng(2).normal(size=(5, len(SEQ))))
    a = T.sufficiency(m, inputs(5), s, batch_size=1)
    b = T.sufficiency(m, inputs(5), s, batch_size=64)
    np.testing.assert_allclose(a.curves, b.curves, atol=1e-12)
    c = T.comprehensiveness(m, inputs(5), s, target=0)
    d = T.comprehensiveness(m, inputs(5), s, target=1)
    np.testing.assert_allclose(c.curves, -d.curves, atol=1e-12)  # two classes: p0 drops = -(p1 drops)
    assert c.target.tolist() == [0] * 5
    assert a.summary().startswith("sufficiency AOPC") and "lower is better, B=5" in a.summary()


# -------------------------------------------------------------------------------- tiny random BERT
def test_bert_matches_a_naive_loop():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=32, num_labels=3,
                                  initializer_range=0.3)
    model = transformers.BertForSequenceClassification(cfg).eval()
    cls, sep = 3, 4  # BertConfig records no [CLS]/[SEP] ids: they come from special_tokens_mask
    g = torch.Generator().manual_seed(1)
    rows = [
        ([cls] + torch.randint(5, 50, (7,), generator=g).tolist() + [sep], None),
        ([cls] + torch.randint(5, 50, (3,), generator=g).tolist() + [sep]
         + torch.randint(5, 50, (4,), generator=g).tolist() + [sep], 5),
        ([cls] + torch.randint(5, 50, (11,), generator=g).tolist() + [sep], None),
    ]
    n = max(len(r) for r, _ in rows)
    ids = torch.zeros(3, n, dtype=torch.long)
    mask, tt, special = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (r, second) in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
        if second is not None:
            tt[b, second : len(r)] = 1
        special[b] = torch.tensor([int(t in (cls, sep)) for t in ids[b]]) | (1 - mask[b])
    enc = {"input_ids": ids, "attention_mask": mask, "token_type_ids": tt, "special_tokens_mask": special}
    s = torch.rand(3, n, generator=g) * mask
    bins = (0.1, 0.3, 0.5)
    comp = T.comprehensiveness(model, enc, s, bins=bins, batch_size=4)
    suff = T.sufficiency(model, enc, s, bins=bins, batch_size=4)

    def prob(seq, types, y):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq]), token_type_ids=torch.tensor([types]),
                        attention_mask=torch.ones(1, len(seq), dtype=torch.long))
        return torch.softmax(out.logits[0].double(), 0)[y].item()

    for b in range(3):
        length = int(mask[b].sum())
        seq, types = ids[b, :length].tolist(), tt[b, :length].tolist()
        units = [j for j in range(length) if seq[j] not in (cls, sep)]
        order = sorted(units, key=lambda j: (-float(s[b, j]), j))
        with torch.no_grad():
            y = int(model(input_ids=ids[b : b + 1, :length], token_type_ids=tt[b : b + 1, :length]).logits.argmax())
        assert comp.target[b] == y
        full = prob(seq, types, y)
        for t, q in enumerate(bins):
            top = set(order[: max(1, round(q * len(units)))])
            rest = [j for j in range(length) if j not in top]
            only = [j for j in range(length) if j in top or seq[j] in (cls, sep)]
            without = prob([seq[j] for j in rest], [types[j] for j in rest], y)
            alone = prob([seq[j] for j in only], [types[j] for j in only], y)
            assert comp.curves[b, t] == pytest.approx(full - without, abs=2e-5)
            assert suff.curves[b, t] == pytest.approx(full - alone, abs=2e-5)


# ------------------------------------------------------------------------------------------ every error
def test_errors():
    m, enc, s = BagModel(), inputs(2), torch.rand(2, len(SEQ))
    with pytest.raises(TypeError, match=r"inputs must be a dict / BatchEncoding.*got torch.Tensor"):
        T.comprehensiveness(m, enc["input_ids"], s)
    with pytest.raises(ValueError, match=r"inputs must hold 'input_ids' \(B, n\); got keys \['attention_mask'\]"):
        T.comprehensiveness(m, {"attention_mask": enc["attention_mask"]}, s)
    with pytest.raises(ValueError, match=r"inputs\['input_ids'\] must be \(B, n\) integer token ids"):
        T.sufficiency(m, {"input_ids": enc["input_ids"][0]}, s)
    with pytest.raises(ValueError, match=r"inputs\['attention_mask'\] must be integers of the shape of input_ids"):
        T.sufficiency(m, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"][:, :5]}, s)
    with pytest.raises(ValueError, match=r"inputs\['attention_mask'\] must hold only 0 \(padding\) and 1"):
        T.sufficiency(m, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"] * 2}, s)
    with pytest.raises(ValueError, match=r"keep must be a \(B, n\) = \(2, 13\) mask over input_ids"):
        T.comprehensiveness(m, enc, s, keep=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep must hold only 0/1 or bool values"):
        T.comprehensiveness(m, enc, s, keep=torch.full((2, 13), 3))
    with pytest.raises(ValueError, match=r"examples \[0, 1\] have no removable token"):
        T.comprehensiveness(m, enc, s, keep=torch.ones(2, 13, dtype=torch.bool))
    with pytest.raises(ValueError, match="scores has 4 units per example but the inputs have 13"):
        T.comprehensiveness(m, enc, torch.rand(2, 4))
    with pytest.raises(ValueError, match="bins must be strictly increasing fractions"):
        T.sufficiency(m, enc, s, bins=(0.5, 0.1))
    with pytest.raises(ValueError, match=r"target=2 is out of range for 2 classes"):
        T.sufficiency(m, enc, s, target=2)
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, inf\], got 0"):
        T.sufficiency(m, enc, s, batch_size=0)
    with pytest.raises(TypeError, match="cannot find class logits in the model's output"):
        T.comprehensiveness(lambda **kw: {"scores": 1}, enc, s)
