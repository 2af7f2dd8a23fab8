"""attnroll.methods.explain_batches / iter_explanations: chunked explaining gives what one call over all the
inputs gives (maps, resolved targets, the random control's maps), whatever the batch size."""

import pytest
import torch

import attnroll
from attnroll.methods import batch_size_of, explain_batches, iter_explanations, take_rows

from ..zoo import sharp

inputs_for, model = sharp.inputs_for, sharp.model


@pytest.mark.parametrize("method", ["rollout", "gae", "random"])
def test_chunks_equal_one_call(method):
    m = model("vit")
    x = inputs_for("vit", batch=5)["pixel_values"]
    whole = attnroll.explain(m, x, method)
    seen = []
    r = explain_batches(m, x, method, batch_size=2, on_chunk=lambda done, total: seen.append((done, total)))
    assert torch.allclose(r.scores, whole.scores, atol=1e-6)
    assert r.grid == tuple(whole.grid) and seen == [(2, 5), (4, 5), (5, 5)]
    if method != "random":
        assert r.targets == whole.target


def test_a_target_per_example_is_sliced_and_dicts_keep_non_batch_entries():
    m = model("bert")
    enc = inputs_for("bert", batch=3)
    tgt = [4, 0, 2]
    whole = attnroll.explain(m, enc, "gae", tgt)
    with torch.no_grad():  # the helper enables autograd for gradient methods itself
        r = explain_batches(m, {**enc, "note": "kept"}, "gae", target=torch.tensor(tgt), batch_size=2)
    assert torch.allclose(r.scores, whole.scores, atol=1e-6) and r.targets == tgt
    parts = list(iter_explanations(m, enc, "raw", batch_size=2))
    assert [sl for sl, _ in parts] == [slice(0, 2), slice(2, 3)]
    assert take_rows({**enc, "note": "kept"}, slice(1, 2))["note"] == "kept"


def test_bad_batches():
    x = torch.zeros(0, 3, 32, 32)
    with pytest.raises(ValueError, match="no examples"):
        explain_batches(model("vit"), x, "rollout")
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, inf\], got 0"):
        explain_batches(model("vit"), torch.zeros(1, 3, 32, 32), "rollout", batch_size=0)
    with pytest.raises(TypeError, match="inputs must be a pixel tensor"):
        batch_size_of([1, 2])
