"""A gradient that never reaches the captured attention raises, naming the model and the reason (instead of
a map of zeros): WavLM (its returned weights are not the tensor its output uses) and BigBird's block-sparse
attention (the dense matrix it returns is rebuilt from the blocks)."""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.capture import CaptureError

T = pytest.importorskip("transformers")
C = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37)


def wavlm():
    cfg = T.WavLMConfig(**C, conv_dim=(32, 32), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                        num_conv_pos_embedding_groups=4, num_labels=3)
    return T.WavLMForSequenceClassification(cfg).eval(), {"input_values": torch.randn(2, 800)}


def bigbird():
    cfg = T.BigBirdConfig(**C, vocab_size=99, max_position_embeddings=512, attention_type="block_sparse",
                          block_size=4, num_random_blocks=1, num_labels=3)
    return T.BigBirdForSequenceClassification(cfg).eval(), {"input_ids": torch.randint(3, 99, (1, 64))}


@pytest.mark.parametrize("build", [wavlm])
@pytest.mark.parametrize("method", ["gae", "grad_rollout", "attn_gradcam"])
def test_unreached_gradient_raises_naming_the_model(build, method):
    torch.manual_seed(0)
    model, x = build()
    # The message names the model and the reason ...
    with pytest.raises(CaptureError, match=f"never reaches the captured attention of {type(model).__name__}"):
        attnroll.explain(model, x, method)
    # ... and the gradient-free methods still work on the same capture.
    assert attnroll.explain(model, x, "rollout").full_row.shape[0] == x[next(iter(x))].shape[0]


@pytest.mark.parametrize("method", ["rollout", "gae"])
def test_block_sparse_bigbird_is_refused_with_the_reason(method):
    torch.manual_seed(0)
    model, x = bigbird()
    with pytest.raises(attnroll.UnsupportedModelError, match="block-sparse.*original_full"):
        attnroll.explain(model, x, method)
    model.config.attention_type = "original_full"
    model.bert.set_attention_type("original_full")
    assert attnroll.explain(model, x, method).full_row.shape == (1, 64)
