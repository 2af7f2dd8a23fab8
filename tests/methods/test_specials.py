"""Special tokens out of a text encoder's scores (attnroll.explain.specials): ``specials="drop"`` (the default)
against a naive recomputation from ``specials="keep"``, on the zoo's tiny BERT; decoders left alone."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch

import attnroll

from ..zoo import plain

pytest.importorskip("transformers")

CLS, SEP = 5, 6


class Tok:
    """The two things explain reads from a tokenizer: the special ids and the token strings."""

    cls_token_id, sep_token_id, bos_token_id, eos_token_id = CLS, SEP, None, None

    def convert_ids_to_tokens(self, ids):
        return [{CLS: "[CLS]", SEP: "[SEP]"}.get(i, f"w{i}") for i in ids]


def _bert_inputs():
    x = plain.inputs_for("bert", n=8)
    ids = x["input_ids"].clone()
    ids[:, 0] = CLS
    ids[0, -1] = SEP  # example 0: all 8 real; example 1: last 2 padded, [SEP] at its last real token
    ids[1, 5] = SEP
    ids[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": x["attention_mask"]}


@pytest.mark.parametrize("method, mapping", [("rollout", dict), ("raw", dict), ("gae", UserDict)])
def test_drop_equals_keep_with_special_tokens_zeroed(method, mapping):
    model, x = plain.model("bert"), mapping(_bert_inputs())  # UserDict: what a tokenizer's BatchEncoding is
    kept = attnroll.explain(model, x, method=method, tokenizer=Tok(), specials="keep")
    got = attnroll.explain(model, x, method=method, tokenizer=Tok())
    assert got.options["specials"] == "drop"
    torch.testing.assert_close(got.full_row, kept.full_row)
    ids, mask = x["input_ids"], x["attention_mask"]
    for b in range(ids.shape[0]):  # naive: loop over the tokens
        special = [j for j in range(ids.shape[1]) if int(ids[b, j]) in (CLS, SEP) and int(mask[b, j]) == 1]
        want = kept.scores[b].clone()
        for j in special:
            want[j - kept.prefix] = 0.0
        torch.testing.assert_close(got.scores[b], want)
        assert got.extra["specials"][b] == special
        row = kept.full_row[b].abs()
        share = sum(float(row[j]) for j in special) / float(row[mask[b].bool()].sum())
        assert float(got.extra["special_share"][b]) == pytest.approx(share, rel=1e-5)
    assert set(kept.extra["specials"][0]) == {0, 7}  # recorded either way


def test_without_known_special_ids_scores_are_the_row():
    model, x = plain.model("bert"), _bert_inputs()
    e = attnroll.explain(model, x, method="rollout")  # no tokenizer, and the config records no [CLS] id
    torch.testing.assert_close(e.scores, e.full_row[:, e.prefix:])
    assert "special_share" not in e.extra


def test_decoders_are_left_to_the_sinks_option():
    model = plain.model("gpt2")
    x = plain.inputs_for("gpt2", n=8)
    x["input_ids"][:, 0], x["input_ids"][0, -1] = CLS, SEP  # ids an encoder's map would drop
    tok = Tok()
    a = attnroll.explain(model, x, method="rollout", tokenizer=tok)
    b = attnroll.explain(model, x, method="rollout", tokenizer=tok, specials="keep")
    torch.testing.assert_close(a.scores, b.scores)
    assert "special_share" not in a.extra


def test_bad_specials_value_names_the_option():
    with pytest.raises(ValueError, match="specials"):
        attnroll.explain(plain.model("bert"), _bert_inputs(), method="rollout", specials="remove")
