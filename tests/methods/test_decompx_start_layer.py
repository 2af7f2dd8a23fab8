"""``decompx``'s ``start_layer`` (our variant): the logit's shares at block l's input, carried down to the input
tokens by measured_rollout's matrices of the blocks below l. Against an independent computation from the
weights (``value_aware_reference``: state_dict names, the model's own eager attention and hidden states,
loops): the separate-bias DecompX loops started at the layer-l states over blocks l.. and the head, then the
naive measured matrices M_{l−1}, …, M_0, on tiny float64 BERT (post-LN), ViT (pre-LN), GPT-2 and Llama (RMSNorm,
grouped KV) models of three blocks; padded batches, pooling heads, inference mode; bad values refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll
from attnroll.capture.value_path import record_states
from attnroll.core.residual_share import measured_matrix

from ..capture.test_layer_anatomy import _carried_pooled, _pooled
from . import value_aware_reference as R

T = pytest.importorskip("transformers")
KINDS = ["bert", "vit", "gpt2", "llama"]
F64 = torch.float64


def _naive(S, xs, alphas, b, row, cls, start):
    """(token shares (n,) at the input, bias share, shares (n + 1,) at block ``start``) of example b, by loops."""
    up = dict(S, layers=S["layers"][start:])
    at_l = R.decompx(up, xs[start], alphas[start:], b, row, cls, bias="separate")
    tok = at_l[:-1]
    for l in reversed(range(start)):  # s ← s · M_l, from block start − 1 down to block 0
        tok = tok @ R.measured_matrix(S["layers"][l], xs[l][b], alphas[l][b])
    return tok, at_l[-1], at_l


def _logit(logits, b, row, cls):
    return (logits[b] if logits.ndim == 2 else logits[b, row])[cls]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("start", [1, 2])
def test_start_layer_equals_the_naive_computation_and_adds_up_to_the_logit(kind, start):
    m, x = R.build(kind, layers=3), R.inputs_for(kind)
    S = R.spec(m, kind)
    xs, alphas, logits = R.model_states(m, x)
    e = attnroll.explain(m, x, "decompx", start_layer=start)
    assert e.options["start_layer"] == start
    row = 0 if S["readout"] == "first" else xs[0].shape[1] - 1
    for b in range(2):
        cls = e.target[b]
        tok, bias_share, at_l = _naive(S, xs, alphas, b, row, cls, start)
        logit = _logit(logits, b, row, cls)
        scale = max(1.0, abs(logit))
        np.testing.assert_allclose(at_l.sum(), logit, atol=1e-9)  # block l's shares + bias share = the logit
        np.testing.assert_allclose(tok.sum() + bias_share, logit, atol=1e-9)  # and still after carrying down
        np.testing.assert_allclose(e.full_row[b].double().numpy(), tok, atol=1e-5 * scale)
        np.testing.assert_allclose(float(e.extra["bias_share"][b]), bias_share, atol=1e-5 * scale)
    # the variant is a different map: otherwise this test could not tell start_layer from the default
    assert (e.full_row - attnroll.explain(m, x, "decompx").full_row).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_start_layer_0_is_the_default_exactly(kind):
    m, x = R.build(kind), R.inputs_for(kind)
    default, zero = attnroll.explain(m, x, "decompx"), attnroll.explain(m, x, "decompx", start_layer=0)
    assert default.options["start_layer"] == 0
    assert torch.equal(default.full_row, zero.full_row)
    assert torch.equal(default.extra["bias_share"], zero.extra["bias_share"])


@pytest.mark.parametrize("kind,side", [("bert", "right"), ("gpt2", "left")])
def test_start_layer_on_a_padded_batch_equals_the_naive_computation(kind, side):
    m = R.build(kind, layers=3)
    ids = torch.randint(1, 30, (3, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(3, 6, dtype=torch.long)
    for b, k in enumerate([6, 4, 3]):
        mask[b, slice(0, k) if side == "right" else slice(6 - k, 6)] = 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    e = attnroll.explain(m, inputs, "decompx", start_layer=2)
    S = R.spec(m, kind)
    xs, alphas, logits = R.model_states(m, inputs)
    row = 0 if side == "right" else 5
    for b in range(3):
        tok, bias_share, _ = _naive(S, xs, alphas, b, row, e.target[b], 2)
        scale = max(1.0, abs(_logit(logits, b, row, e.target[b])))
        np.testing.assert_allclose(e.full_row[b].double().numpy(), tok, atol=1e-5 * scale)
        np.testing.assert_allclose(float(e.extra["bias_share"][b]), bias_share, atol=1e-5 * scale)
        assert torch.all(e.full_row[b][mask[b] == 0] == 0)


@pytest.mark.parametrize("kind", ["dinov2", "timm_avg_fc_norm"])
def test_start_layer_with_a_pooling_head(kind):
    # block 1's shares by a second algorithm (every token's shares carried forward by the core kernels, no
    # backward pass), then block 0's measured matrix; and the total is the model's own logit
    m, x = _pooled(kind)
    e = attnroll.explain(m, x, "decompx", target=2, start_layer=1)
    at_l = _carried_pooled(m, x, 2, "separate", start=1)
    rec, st, anat = record_states(m, x)
    blk = anat.blocks(F64)[0]
    attn = (st.norm2_in[0] if blk.pre_norm else st.norm1_in[0]) - st.inputs[0]
    want = torch.einsum("bi,bij->bj", at_l[:, :-1], measured_matrix(st.inputs[0], attn, rec.attentions[0], blk))
    torch.testing.assert_close(e.full_row.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e.extra["bias_share"].double(), at_l[:, -1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        out = m(x)
    logits = out.logits if hasattr(out, "logits") else out
    torch.testing.assert_close(e.full_row.double().sum(-1) + e.extra["bias_share"].double(), logits[:, 2],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_start_layer_under_no_grad_and_inference_mode(mode):
    m, x = R.build("vit", layers=3), R.inputs_for("vit")
    want = attnroll.explain(m, x, "decompx", start_layer=2)
    with getattr(torch, mode)():
        got = attnroll.explain(m, x, "decompx", start_layer=2)
    torch.testing.assert_close(got.full_row, want.full_row, atol=1e-12, rtol=0)


def test_bad_start_layers_are_refused_quoting_the_value():
    m, x = R.build("vit"), R.inputs_for("vit")  # 2 blocks: start_layer in [0, 1]
    for bad in (2, -1, 7):
        with pytest.raises(ValueError, match=rf"start_layer must be in \[0, 1\], got {bad}"):
            attnroll.explain(m, x, "decompx", start_layer=bad)
    for bad, shown in ((1.0, "float 1.0"), (True, "bool True"), ("1", "str '1'")):
        with pytest.raises(TypeError, match=f"start_layer must be an integer, got {shown}"):
            attnroll.explain(m, x, "decompx", start_layer=bad)
    with pytest.raises(ValueError, match="start_layer=1.*only with bias='separate'.*got bias='absdot'"):
        attnroll.explain(m, x, "decompx", start_layer=1, bias="absdot")
    ab = attnroll.explain(m, x, "decompx", start_layer=0, bias="absdot")  # 0 is the paper's DecompX: allowed
    assert ab.options["bias"] == "absdot"
