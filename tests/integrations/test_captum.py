"""``AttnrollAttribution``: an attnroll method as a Captum attribution, equal to ``explain`` and measurable
with Captum's own metrics."""

from __future__ import annotations

import math

import pytest
import torch

from tests import zoo

captum = pytest.importorskip("captum")
from captum.attr import Attribution  # noqa: E402
from captum.metrics import infidelity, sensitivity_max  # noqa: E402

import attnroll  # noqa: E402
from attnroll.integrations.captum import AttnrollAttribution  # noqa: E402


@pytest.mark.parametrize("method", ["rollout", "gae"])
def test_pixels_hold_their_patch_score(method):
    model = zoo.sharp.model("vit")
    x = zoo.sharp.inputs_for("vit")["pixel_values"]  # (3, 3, 32, 32), patches 8x8 -> 4x4 grid
    attr = AttnrollAttribution(model, method)
    assert isinstance(attr, Attribution) and not attr.has_convergence_delta()
    rel = attr.attribute(x, target=1)
    assert rel.shape == x.shape
    want = attnroll.explain(model, {"pixel_values": x}, method, target=1).as_grid()  # (B, 4, 4)
    for i in range(4):
        for j in range(4):
            patch = rel[:, :, 8 * i:8 * i + 8, 8 * j:8 * j + 8]
            torch.testing.assert_close(patch, want[:, i, j, None, None, None].expand_as(patch), atol=1e-5, rtol=0)
    (again,) = attr.attribute((x,), target=torch.tensor([1, 1, 1]))  # Captum's tuple form, tensor targets
    torch.testing.assert_close(again, rel, atol=1e-5, rtol=0)


def test_token_ids_and_embeddings_per_token():
    model = zoo.sharp.model("bert")
    enc = zoo.sharp.inputs_for("bert", pad=False)
    ids = enc["input_ids"]
    want = attnroll.explain(model, enc, "grad_rollout", target=[0, 2, 1]).scores
    rel = AttnrollAttribution(model, "grad_rollout").attribute(ids, target=[0, 2, 1],
                                                               additional_forward_args={"attention_mask": enc["attention_mask"]})
    assert rel.shape == ids.shape
    torch.testing.assert_close(rel, want, atol=1e-5, rtol=0)
    emb = model.get_input_embeddings()(ids).detach()
    rel_e = AttnrollAttribution(model, "grad_rollout").attribute(emb, target=[0, 2, 1])
    assert rel_e.shape == emb.shape
    torch.testing.assert_close(rel_e, want[..., None].expand_as(emb), atol=1e-5, rtol=0)


def test_positional_models_and_bad_inputs():
    model = zoo.sharp.model("timm_vit")
    x = zoo.sharp.inputs_for("timm_vit")
    rel = AttnrollAttribution(model, "rollout").attribute(x)
    want = attnroll.explain(model, x, "rollout").as_grid()
    torch.testing.assert_close(rel[:, 0, ::8, ::8], want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="pixels .* token ids .* input embeddings"):
        AttnrollAttribution(model, "rollout").attribute(torch.randn(2, 5))
    with pytest.raises(ValueError, match="unknown|not a registered|nope"):
        AttnrollAttribution(model, "nope")


def test_captum_metrics_run_on_it():
    model = zoo.sharp.model("vit")
    x = zoo.sharp.inputs_for("vit")["pixel_values"]
    attr = AttnrollAttribution(model, "rollout")
    rel = attr.attribute(x, target=0)

    def forward(px):
        return model(pixel_values=px).logits

    def perturb(inputs):
        noise = torch.randn_like(inputs) * 0.05
        return noise, inputs - noise

    torch.manual_seed(0)
    inf = infidelity(forward, perturb, x, rel, target=0, n_perturb_samples=4)
    sens = sensitivity_max(attr.attribute, x, target=0, n_perturb_samples=3, perturb_radius=0.01)
    assert inf.shape == (3,) and sens.shape == (3,)
    assert all(math.isfinite(v) for v in [*inf.tolist(), *sens.tolist()])
    assert float(sens.max()) > 0  # the maps really move with the input
    grad_attr = AttnrollAttribution(model, "gae")  # Captum calls it under torch.no_grad(): gradients still flow
    sens_gae = sensitivity_max(grad_attr.attribute, x, target=0, n_perturb_samples=2, perturb_radius=0.01)
    assert torch.isfinite(sens_gae).all()
