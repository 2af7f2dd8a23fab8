"""The Captum baselines: summed to patches / tokens without losing attribution mass, against autograd, batched."""

from __future__ import annotations

import pytest
import torch

from attnroll.methods import explain

from ..zoo import sharp as M

pytest.importorskip("captum")


def test_integrated_gradients_completeness_in_patch_units():
    """Sum over patches of IG = f(x) − f(black) (up to the Riemann error): nothing lost in the patch sums."""
    m, x = M.model("vit"), M.inputs_for("vit")
    e = explain(m, x, "integrated_gradients", target=[0, 1, 2], n_steps=200)
    with torch.no_grad():
        f = m(**x).logits[torch.arange(3), torch.tensor([0, 1, 2])]
        f0 = m(pixel_values=torch.zeros_like(x["pixel_values"])).logits[:, :3].diagonal()
    torch.testing.assert_close(e.scores.sum(-1), f - f0, atol=2e-2, rtol=2e-2)
    assert e.scores.shape == (3, 16) and e.full_row.shape == (3, 17) and float(e.full_row[:, 0].abs().sum()) == 0


def test_saliency_and_input_x_gradient_equal_autograd_per_patch():
    m, x = M.model("vit"), M.inputs_for("vit")
    px = x["pixel_values"].clone().requires_grad_(True)
    y = m(pixel_values=px).logits[:, 3]
    (g,) = torch.autograd.grad(y.sum(), px)

    def per_patch(a):
        return a.reshape(3, 3, 4, 8, 4, 8).sum(dim=(1, 3, 5)).reshape(3, 16)

    torch.testing.assert_close(explain(m, x, "saliency", target=3).scores, per_patch(g.abs()), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        explain(m, x, "input_x_gradient", target=3).scores, per_patch(g * x["pixel_values"]), atol=1e-5, rtol=1e-4
    )


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_text_ig_batch_equals_per_example(name):
    m, x = M.model(name), M.inputs_for(name)
    target = [0, 2, 4] if name == "bert" else [5, 17, 42]
    batch = explain(m, x, "integrated_gradients", target=target, n_steps=8)
    for b in range(3):
        one = explain(m, M.example(x, b), "integrated_gradients", target=target[b], n_steps=8)
        n = one.scores.shape[-1]
        torch.testing.assert_close(batch.scores[b, :n], one.scores[0], atol=1e-5, rtol=1e-4)
    assert batch.scores.shape == (3, 7)


def test_text_input_x_gradient_equals_autograd_on_embeddings():
    m, x = M.model("bert"), M.inputs_for("bert", pad=False)
    emb = m.get_input_embeddings()(x["input_ids"]).detach().requires_grad_(True)
    y = m(inputs_embeds=emb, attention_mask=x["attention_mask"]).logits[:, 1]
    (g,) = torch.autograd.grad(y.sum(), emb)
    e = explain(m, x, "input_x_gradient", target=1)
    torch.testing.assert_close(e.scores, (g * emb).sum(-1).detach(), atol=1e-5, rtol=1e-4)
