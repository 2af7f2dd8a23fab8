"""The capture session kept open for a run (``capture.recompute.KeptCapture``, ``explain.explainer.Prepared.keep``,
``batch.work.Worker.kept_sessions``): results equal to fresh sessions batch after batch (batches of different
sizes, padded text), equal to a float64 rollout of the model's own eager attention; between calls the model
runs untouched and other captures of it (gae, raw, a nested explain) work as without it; on exit, also after an
exception mid-run, the model is exactly as before (hooks, train flags, the attention interface, its forward)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll.capture import CaptureError  # noqa: E402
from attnroll.capture.recompute import KeptCapture, capture_kernels  # noqa: E402
from attnroll.explain.explainer import Prepared  # noqa: E402

from ..zoo import plain as models  # noqa: E402
from ..capture.helpers import snapshot  # noqa: E402


@pytest.fixture(scope="module")
def shapes():
    from attnroll.models import load_model

    return load_model(None, None, want="image").model


def _interface() -> tuple:
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface.__dict__.get("get_interface"), AttentionInterface.__dict__.get("__getitem__")


def _pixels(B: int, seed: int) -> torch.Tensor:
    return torch.rand(B, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def _eager(model: torch.nn.Module) -> torch.nn.Module:
    """An eager-attention copy (made before any session hooks the model: a hooked model does not deepcopy)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


def _eager_rollout(ref: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Row 0 (CLS) of prod_l (0.5·mean_h A_l + 0.5·I), top layer first, in float64, from the eager copy's own
    ``output_attentions``: (B, n)."""
    with torch.no_grad():
        att = ref.eval()(pixel_values=x, output_attentions=True).attentions
    n = att[0].shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    row = eye[0].expand(x.shape[0], n)[:, None, :]
    for a in reversed(att):
        row = row @ (0.5 * a.double().mean(dim=1) + 0.5 * eye)
    return row[:, 0]


def _same_explanation(a, b) -> None:
    assert torch.equal(a.full_row, b.full_row) and torch.equal(a.scores, b.scores)
    assert (a.target, a.options, a.positions, a.grid, a.prefix, a.method) == (
        b.target, b.options, b.positions, b.grid, b.prefix, b.method)


def test_kept_session_equals_fresh_sessions_for_batches_of_different_sizes(shapes):
    before, iface, ref = snapshot(shapes), _interface(), _eager(shapes)
    prepared = Prepared(shapes, "rollout")
    with prepared.keep():
        for k, B in enumerate([32, 5, 1, 17, 5]):
            x = _pixels(B, k)
            got = prepared(x)
            _same_explanation(got, attnroll.explain(shapes, x, "rollout"))  # a fresh session, nested
            torch.testing.assert_close(got.full_row.double(), _eager_rollout(ref, x), atol=2e-6, rtol=0)
            assert got.options["attention"] == "recompute"
        assert len(prepared.memo["kept"]) == 1  # one session for every batch
    assert snapshot(shapes) == before and _interface() == iface
    assert "keep" not in prepared.memo and "kept" not in prepared.memo


def test_kept_records_equal_capture_kernels_layer_by_layer(shapes):
    with KeptCapture(shapes, fuse_mean=True) as kept:
        records = []
        for k, B in enumerate([3, 8, 2]):
            x = _pixels(B, 10 + k)
            rec = kept.capture(x)
            fresh = capture_kernels(shapes, x, fuse_mean=True)
            assert rec is not (records[-1] if records else None)  # a new record per pass
            records.append(rec)
            assert [type(a).__name__ for a in rec.operators["self"]] == [type(a).__name__ for a in fresh.operators["self"]]
            for a, b in zip(rec.operators["self"], fresh.operators["self"]):
                if hasattr(a, "probs"):
                    assert torch.equal(a.probs, b.probs)
                else:
                    assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k)
            assert (rec.prefix, rec.grid) == (fresh.prefix, fresh.grid)
            assert torch.equal(rec.outputs.logits, fresh.outputs.logits)
    assert records[0].operators["self"][0].shape[0] == 3  # earlier records are not overwritten


def test_between_calls_the_model_and_other_captures_run_as_without_the_session(shapes):
    untouched = copy.deepcopy(shapes)
    x = _pixels(4, 20)
    with torch.no_grad():
        want_logits = untouched(pixel_values=x).logits
    outside = {m: attnroll.explain(shapes, x, m) for m in ("raw", "rollout")}
    outside_gae = attnroll.explain(shapes, x, "gae")
    prepared = Prepared(shapes, "rollout")
    with prepared.keep():
        prepared(_pixels(2, 21))
        with torch.no_grad():
            assert torch.equal(shapes(pixel_values=x).logits, want_logits)
        for m, e in outside.items():
            _same_explanation(attnroll.explain(shapes, x, m), e)
        _same_explanation(attnroll.explain(shapes, x, "gae"), outside_gae)  # dense capture, gradients
        _same_explanation(prepared(x), outside["rollout"])


def _train_partly(m: torch.nn.Module) -> torch.nn.Module:
    m.train()
    next(m.children()).eval()  # one submodule in eval mode
    return m


def test_an_exception_mid_run_leaves_the_model_exactly_as_before(shapes):
    model = _train_partly(copy.deepcopy(shapes))
    untouched = copy.deepcopy(model)
    before, iface = snapshot(model), _interface()
    prepared = Prepared(model, "rollout")
    with pytest.raises(RuntimeError, match="stop mid-run"):
        with prepared.keep():
            prepared(_pixels(3, 30))
            with pytest.raises(Exception):
                prepared(torch.rand(2, 3, 48, 64))  # the forward itself fails on this input
            _same_explanation(prepared(_pixels(2, 31)), attnroll.explain(model, _pixels(2, 31), "rollout"))
            raise RuntimeError("stop mid-run")
    assert snapshot(model) == before and _interface() == iface
    x = _pixels(4, 32)
    torch.manual_seed(0)
    a = model(pixel_values=x).logits  # train mode as before: dropout is 0 here, so equal
    torch.manual_seed(0)
    assert torch.equal(a, untouched(pixel_values=x).logits)


def test_kept_session_for_a_padded_text_model_equals_fresh_sessions():
    m = models.model("bert").eval()
    before = snapshot(m)
    prepared = Prepared(m, "rollout")
    with prepared.keep():
        for k, B in enumerate([3, 1, 2]):
            x = models.inputs_for("bert", batch=B, seed=k)
            _same_explanation(prepared(x), attnroll.explain(m, x, "rollout"))
    assert snapshot(m) == before


def test_keep_refuses_nesting_and_capture_outside_its_block(shapes):
    prepared = Prepared(shapes, "rollout")
    with prepared.keep():
        with pytest.raises(RuntimeError, match="already inside a keep"):
            with prepared.keep():
                pass
    kept = KeptCapture(shapes, fuse_mean=True)
    with pytest.raises(RuntimeError, match="not open"):
        kept.capture(_pixels(1, 0))


def test_a_changed_attention_implementation_is_refused_not_misread(shapes):
    model = copy.deepcopy(shapes)
    with KeptCapture(model, fuse_mean=True) as kept:
        kept.capture(_pixels(1, 0))
        model.set_attn_implementation("eager")
        with pytest.raises(CaptureError, match="changed while a kept capture"):
            kept.capture(_pixels(1, 0))
        model.set_attn_implementation("sdpa")
        kept.capture(_pixels(1, 0))


def test_a_local_run_keeps_one_session_and_leaves_the_model_as_before(tmp_path, monkeypatch):
    """run_batch's rows equal explain per input (rollout, then raw and gae beside it on the same model), one
    KeptCapture entered for the run's rollout batches; a run that fails at its second batch leaves the model,
    its hooks and the attention interface as they were."""
    pytest.importorskip("pyarrow")
    from attnroll.batch import read_batch, run_batch
    from attnroll.capture import recompute
    from attnroll.models import load_model

    from .helpers import pixel_input, write_shapes

    lm = load_model(None, None, want="image")
    paths = write_shapes(tmp_path / "src", 7, seed=8)
    before, iface = snapshot(lm.model), _interface()
    opened = []
    enter = recompute.KeptCapture.__enter__
    monkeypatch.setattr(recompute.KeptCapture, "__enter__", lambda self: opened.append(self) or enter(self))
    run_batch(tmp_path / "src", tmp_path / "out", methods=["rollout", "raw", "gae"], batch_size=3, loaded=lm)
    assert len(opened) == 2 and sorted(k.fuse_mean for k in opened) == [False, True]  # rollout's, raw's
    assert snapshot(lm.model) == before and _interface() == iface
    df = read_batch(tmp_path / "out")
    assert len(df) == 21
    by_id = {p.relative_to(tmp_path / "src").as_posix(): p for p in paths}
    for _, row in df.iterrows():
        x = pixel_input(by_id[row["id"]])
        e = attnroll.explain(lm.model, x, row["method"])
        # (a batch of 3 against one input: float32 rounding apart)
        torch.testing.assert_close(torch.as_tensor(row["scores"]), e.scores[0], atol=2e-6, rtol=0)

    calls = []

    def stop(done, total):
        calls.append(done)
        if done >= 3:
            raise KeyboardInterrupt("stop at the second batch")

    with pytest.raises(KeyboardInterrupt):
        run_batch(tmp_path / "src", tmp_path / "out2", methods=["rollout"], batch_size=3, loaded=lm, progress=stop)
    assert snapshot(lm.model) == before and _interface() == iface
    x = torch.cat([pixel_input(p) for p in paths[:2]])
    _same_explanation(attnroll.explain(lm.model, x, "rollout"), attnroll.explain(copy.deepcopy(lm.model), x, "rollout"))


def test_nothing_of_a_pass_stays_with_the_kept_session(shapes):
    """After each pass the session holds no layer, input or record of it (the fused layers may alias the
    thread's reused buffers, which only the call may read)."""
    with KeptCapture(shapes, fuse_mean=True) as kept:
        x = _pixels(3, 40)
        rec = kept.capture(x)
        s = kept.session
        assert s.record is not rec and not s.record.operators
        assert s.recorder.taken == {} and s.recorder.outputs == {} and s._inputs == {}
        assert rec.operators["self"][0].shape[0] == 3
