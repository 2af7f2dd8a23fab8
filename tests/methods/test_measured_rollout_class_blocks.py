"""``measured_rollout``'s ``class_blocks=k`` against an independent computation on tiny float64 BERT (post-LN),
ViT (pre-LN), GPT-2 (pre-LN, causal) and Llama (RMSNorm, grouped KV): the residual share from the naive block
split of ``value_aware_reference`` (weights by state_dict name, loops over tokens), the class-specific pattern
from autograd through the model's **own** eager attention probabilities (``output_attentions``), the
products written as numpy loops; plus the option's validation and the grad modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnroll
from attnroll.core.residual_share import class_pattern

from . import value_aware_reference as R

T = pytest.importorskip("transformers")
KINDS = ["bert", "vit", "gpt2", "llama"]


def _own_attention_grads(model, inputs, target, row):
    """The model's logits, its attention probabilities and ∂y/∂α of y = Σ_b logit_b[target_b] (read at the
    explained row for the decoders), by autograd on the tensors the model itself returns."""
    with torch.enable_grad():
        out = model(**inputs, output_attentions=True) if isinstance(inputs, dict) \
            else model(inputs, output_attentions=True)
        logits = out.logits if out.logits.ndim == 2 else out.logits[:, row]
        tgt = logits.argmax(-1) if target is None else torch.as_tensor(target)
        y = logits.gather(1, tgt[:, None]).sum()
        grads = torch.autograd.grad(y, out.attentions)
    return [a.detach().numpy() for a in out.attentions], [g.numpy() for g in grads]


def _naive_pattern(alpha, grad):
    """rows of mean_h max(0, g ⊙ α), divided by their sums, loops (H, n, n) -> (n, n)."""
    H, n, _ = alpha.shape
    P = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            P[i, j] = sum(max(0.0, grad[h, i, j] * alpha[h, i, j]) for h in range(H)) / H
        s = P[i].sum()
        P[i] = P[i] / s if s > 0 else 0.0
    return P


def _naive_row(S, xs, alphas, grads, b, row, k):
    n = xs[0].shape[1]
    L = len(S["layers"])
    P = np.eye(n)
    for l, lay in enumerate(S["layers"]):
        Tr, Tm, _ = R.measured_parts(lay, xs[l][b], alphas[l][b])
        pat = _naive_pattern(alphas[l][b], grads[l][b]) if l >= L - k else alphas[l][b].mean(0)
        M = np.zeros((n, n))
        for i in range(n):
            r = np.linalg.norm(Tr[i]) / (np.linalg.norm(Tr[i]) + np.linalg.norm(Tm[i]))
            M[i] = (1 - r) * pat[i]
            M[i, i] += r
            M[i] = M[i] / M[i].sum()  # a row whose pattern is all 0 keeps the token on itself
        P = M @ P
    return P[row]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2])
def test_class_blocks_equals_the_naive_computation(kind, k):
    m, x = R.build(kind, layers=3), R.inputs_for(kind)
    S = R.spec(m, kind)
    xs, alphas, _ = R.model_states(m, x)
    row = 0 if S["readout"] == "first" else xs[0].shape[1] - 1
    target = [1, 2] if kind in ("bert", "vit") else None  # decoders: the argmax next token
    _, grads = _own_attention_grads(m, x, target, row)
    e = attnroll.explain(m, x, "measured_rollout", class_blocks=k, target=target)
    for b in range(2):
        np.testing.assert_allclose(e.full_row[b].double().numpy(), _naive_row(S, xs, alphas, grads, b, row, k),
                                   atol=1e-6, rtol=1e-6)
    plain = attnroll.explain(m, x, "measured_rollout")
    assert not torch.allclose(e.full_row, plain.full_row, atol=1e-4)  # the option reaches the map


def test_the_map_follows_the_target():
    m, x = R.build("vit", layers=2), R.inputs_for("vit")
    S = R.spec(m, "vit")
    xs, alphas, _ = R.model_states(m, x)
    maps = {}
    for c in range(3):
        _, grads = _own_attention_grads(m, x, [c, c], 0)
        e = attnroll.explain(m, x, "measured_rollout", class_blocks=1, target=c)
        np.testing.assert_allclose(e.full_row[0].double().numpy(), _naive_row(S, xs, alphas, grads, 0, 0, 1),
                                   atol=1e-6, rtol=1e-6)
        maps[c] = e.full_row
    assert not torch.allclose(maps[0], maps[1], atol=1e-4) or not torch.allclose(maps[1], maps[2], atol=1e-4)


def test_class_pattern_rows_and_an_empty_row():
    alpha = torch.softmax(torch.randn(1, 2, 3, 3, dtype=torch.float64), -1)
    grad = torch.randn(1, 2, 3, 3, dtype=torch.float64)
    grad[0, :, 1] = -1.0  # no positive evidence in row 1
    P = class_pattern(alpha, grad)
    np.testing.assert_allclose(P[0].numpy(), _naive_pattern(alpha[0].numpy(), grad[0].numpy()), atol=1e-12)
    assert torch.all(P[0, 1] == 0) and torch.allclose(P[0, [0, 2]].sum(-1), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_class_blocks_under_no_grad_and_inference_mode(mode):
    m, x = R.build("bert", layers=2), R.inputs_for("bert")
    want = attnroll.explain(m, x, "measured_rollout", class_blocks=1).full_row
    with (torch.no_grad() if mode == "no_grad" else torch.inference_mode()):
        got = attnroll.explain(m, x, "measured_rollout", class_blocks=1).full_row
    torch.testing.assert_close(got, want)
    assert all(p.grad is None for p in m.parameters())


def test_padded_batch_equals_cropped():
    m = R.build("bert", layers=2)
    ids = torch.tensor([[5, 6, 7, 8, 9], [4, 3, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    e = attnroll.explain(m, {"input_ids": ids, "attention_mask": mask}, "measured_rollout", class_blocks=2)
    one = attnroll.explain(m, {"input_ids": ids[1:, :3]}, "measured_rollout", class_blocks=2)
    torch.testing.assert_close(e.full_row[1, :3], one.full_row[0], atol=1e-6, rtol=1e-6)
    assert torch.all(e.full_row[1, 3:] == 0) and torch.isfinite(e.full_row).all()


@pytest.mark.parametrize("value, err, match", [
    (-1, ValueError, r"class_blocks must be in \[0, inf\], got -1"),
    (3, ValueError, r"class_blocks must be in \[0, 2\] \(the number of blocks\), got 3"),
    (1.0, TypeError, "class_blocks must be an integer"),
    (True, TypeError, "class_blocks must be an integer"),
])
def test_class_blocks_validation(value, err, match):
    m, x = R.build("vit", layers=2), R.inputs_for("vit")
    with pytest.raises(err, match=match):
        attnroll.explain(m, x, "measured_rollout", class_blocks=value)
