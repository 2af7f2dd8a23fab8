"""A model whose attention modules return no weights (transformers' SDPA default): the error names the fix,
attn_implementation="eager", or the capture without modules=, which reads the attention under any kernel."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll._checks import CaptureError

T = pytest.importorskip("transformers")


def bert(impl):
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=20, attn_implementation=impl)
    return T.BertModel(cfg).eval()


def test_modules_that_return_no_weights_name_the_fix():
    enc = {"input_ids": torch.tensor([[2, 5, 6, 7, 3]])}
    sdpa = bert("sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    with pytest.raises(CaptureError, match=r'returned no weights.*attn_implementation="eager".*leave out modules='):
        attnroll.capture(sdpa, enc, modules=r".*attention\.self$", to_probs=lambda m, a, o: o[1])
    eager = bert("eager")
    eager.load_state_dict(sdpa.state_dict())
    rec = attnroll.capture(eager, enc, modules=r".*attention\.self$", to_probs=lambda m, a, o: o[1])
    free = attnroll.capture(sdpa, enc)  # no modules=: read under the SDPA kernel
    with torch.no_grad():
        want = eager(**enc, output_attentions=True).attentions
    for got, plain, w in zip(rec.attentions, free.attentions, want):
        torch.testing.assert_close(got, w)
        torch.testing.assert_close(plain, w, atol=1e-6, rtol=1e-5)
