"""``measured_rollout`` against an independent computation from the weights (state_dict names, the model's own
eager attention, loops over tokens; ``value_aware_reference``) on tiny float64 BERT (post-LN), ViT (pre-LN),
GPT-2 (pre-LN, causal) and Llama (RMSNorm, gated MLP, grouped KV); the block split adds up to the model's own
layer outputs; properties and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll
from attnroll._checks import UnsupportedModelError
from attnroll.core.residual_share import block_parts, residual_share, share_rollout_matrix

from . import value_aware_reference as R

T = pytest.importorskip("transformers")
KINDS = ["bert", "vit", "gpt2", "llama"]


def _naive_map(S, xs, alphas, b, row):
    P = np.eye(xs[0].shape[1])
    for l, L in enumerate(S["layers"]):
        P = R.measured_matrix(L, xs[l][b], alphas[l][b]) @ P
    return P[row]


def _setup(kind):
    m, x = R.build(kind), R.inputs_for(kind)
    S = R.spec(m, kind)
    xs, alphas, _ = R.model_states(m, x)
    return m, x, S, xs, alphas


@pytest.mark.parametrize("kind", KINDS)
def test_measured_rollout_equals_the_naive_computation(kind):
    m, x, S, xs, alphas = _setup(kind)
    e = attnroll.explain(m, x, "measured_rollout")
    row = 0 if S["readout"] == "first" else xs[0].shape[1] - 1
    for b in range(2):
        np.testing.assert_allclose(e.full_row[b].double().numpy(), _naive_map(S, xs, alphas, b, row),
                                   atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(e.full_row.sum(-1).double(), torch.ones(2, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_block_parts_add_up_to_the_layer_output_and_match_the_naive_split(kind):
    m, x, S, xs, alphas = _setup(kind)
    with torch.no_grad():
        out = m(**x, output_hidden_states=True) if isinstance(x, dict) else m(x, output_hidden_states=True)
    from attnroll.capture.value_path import anatomy

    blocks = anatomy(m).blocks(torch.float64)
    for l, (L, blk) in enumerate(zip(S["layers"], blocks)):
        naive = np.stack([R.measured_parts(L, xs[l][b], alphas[l][b]) for b in range(2)])  # (B, 3, n, d)
        attn = np.stack([R.attention_out(L, xs[l][b], alphas[l][b]) for b in range(2)])
        mixed = torch.from_numpy(attn - (0 if L["bo"] is None else L["bo"]))
        parts = block_parts(torch.from_numpy(xs[l]), mixed, blk.bo, blk)
        np.testing.assert_allclose(parts.permute(0, 2, 1, 3).numpy(), naive, atol=1e-6)
        if l + 1 < len(S["layers"]):  # the parts add up to the next layer's input, the model's own state
            np.testing.assert_allclose(parts.sum(2).numpy(), out.hidden_states[l + 1].numpy(), atol=1e-6)


def test_share_is_one_without_a_value_path_and_the_map_is_the_readout_itself():
    m, x = R.build("vit"), R.inputs_for("vit")
    with torch.no_grad():
        for layer in m.vit.layers:
            layer.attention.o_proj.weight.zero_()  # nothing is mixed in: every row keeps itself
    e = attnroll.explain(m, x, "measured_rollout")
    want = torch.zeros_like(e.full_row)
    want[:, 0] = 1
    torch.testing.assert_close(e.full_row, want)


def test_matrix_rows_and_share_edge_cases():
    alpha = torch.softmax(torch.randn(2, 3, 4, 4, dtype=torch.float64), -1)
    r = torch.tensor([[0.0, 0.5, 1.0, 0.25]] * 2, dtype=torch.float64)
    M = share_rollout_matrix(alpha, r)
    torch.testing.assert_close(M.sum(-1), torch.ones(2, 4, dtype=torch.float64))
    torch.testing.assert_close(M[:, 0], alpha.mean(1)[:, 0])  # r = 0: attention only
    torch.testing.assert_close(M[:, 2], torch.eye(4, dtype=torch.float64)[2].expand(2, 4))  # r = 1: itself
    parts = torch.zeros(1, 2, 3, 5)
    parts[0, 1, 0, 0], parts[0, 1, 1, 1] = 3.0, 1.0
    torch.testing.assert_close(residual_share(parts), torch.tensor([[1.0, 0.75]]))  # 0/0 -> keeps itself


def test_padded_batch_equals_cropped():
    m = R.build("bert")
    ids = torch.tensor([[5, 6, 7, 8, 9], [4, 3, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    e = attnroll.explain(m, {"input_ids": ids, "attention_mask": mask}, "measured_rollout")
    one = attnroll.explain(m, {"input_ids": ids[1:, :3]}, "measured_rollout")
    torch.testing.assert_close(e.full_row[1, :3], one.full_row[0], atol=1e-6, rtol=1e-6)
    assert torch.all(e.full_row[1, 3:] == 0) and torch.isfinite(e.full_row).all()


def test_refusals_say_why():
    m, x = R.build("vit"), R.inputs_for("vit")
    with pytest.raises(ValueError, match="measured"):
        attnroll.explain(m, x, "measured_rollout", alpha=0.5)
    with pytest.raises(ValueError, match="heads"):
        attnroll.explain(m, x, "measured_rollout", head_fusion="max")
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1)
    with pytest.raises(UnsupportedModelError, match="BERT family"):
        attnroll.explain(enc, torch.randn(1, 3, 8), "measured_rollout")
