"""The rows-only (matrix-free) form of the layers that join softmax attention and a token mixer in one matrix
(core/joined.py ``JoinedRows``, capture/hybrids.py ``RowsWiring``): Falcon-H1's parallel branches
L = diag(w_a)·Ā + diag(w_m)·F and Zamba's / Zamba2's shared attention block before the mixer
L = F·(diag(w_h) + diag(w_T)·Ā).

Each joined layer applied to relevance rows equals the join computed here naively, as (n, n) matrices, from its
per-path pieces (the attention's per-head probabilities, the mixer's rows, the path weights measured here from the
model's own branch outputs); ``rollout`` on the rows-only route equals the dense route; its memory grows linearly
with n; max / min head fusion over a shared-attention layer is refused rows-only and falls back to dense in auto mode.
"""

from __future__ import annotations

import pytest
import torch

import attnroll
from attnroll.capture.recompute import capture_kernels
from attnroll.core import mixers as ops
from attnroll.core import operators
from attnroll.core.joined import JoinedRows

from ..core.test_mixer_rows import _Largest
from .test_hybrids_grad import balance_paths
from ..zoo import decoder

f64 = torch.float64
#: Tiny hybrid decoders with joined layers (zoo model types) -> the mixer class.
WIRED = {"falcon_h1": "FalconH1Mixer", "zamba2": "Zamba2MambaMixer", "zamba": "ZambaMambaMixer"}
FAST = ("falcon_h1", "zamba2")


def _params() -> list:
    return [pytest.param(t, marks=() if t in FAST else (pytest.mark.slow,)) for t in WIRED]


def _inputs(n: int = 9, pad: int = 3) -> dict:
    ids = torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if pad:
        mask[1, n - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _balanced(model_type: str) -> torch.nn.Module:
    """The tiny decoder with both paths of every joined layer of comparable size (the random weights leave the
    SSD branch ~1e-3 of Falcon-H1's attention branch, the projected shared block ~1e-2 of Zamba's hidden state)."""
    return balance_paths(decoder(model_type), model_type)


def _share(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a's share ‖a_t‖ / (‖a_t‖ + ‖b_t‖) per token, (b, n)."""
    na, nb = a.double().norm(dim=-1), b.double().norm(dim=-1)
    return na / (na + nb)


def _record_with_shares(model_type: str, model, inputs) -> tuple:
    """The rows-only record and, from this test's own hooks on the same pass, each joined layer's first path
    weight (w_a: Falcon-H1's attention branch; w_h: Zamba's hidden state) (b, n), in layer order."""
    seen, handles = [], []
    for layer in model.model.layers:
        if model_type == "falcon_h1":
            handles.append(layer.mamba.register_forward_hook(
                lambda m, a, o, layer=layer: seen.append(("m", o * layer.ssm_out_multiplier))))
            handles.append(layer.self_attn.register_forward_hook(
                lambda m, a, o, layer=layer: seen.append(("a", o[0] * layer.attn_out_multiplier))))
        elif hasattr(layer, "mamba_decoder"):
            handles.append(layer.mamba_decoder.register_forward_pre_hook(lambda m, a, k: seen.append(
                ("paths", a[0] if a else k["hidden_states"], k["transformer_hidden_states"])), with_kwargs=True))
    try:
        rec = capture_kernels(model, inputs)
    finally:
        for h in handles:
            h.remove()
    if model_type == "falcon_h1":
        return rec, [_share(a[1], m[1]) for m, a in zip(seen[0::2], seen[1::2])]
    return rec, [_share(h, T) for _, h, T in seen]


def _naive_layer(lay: JoinedRows, w1: torch.Tensor, how, n: int) -> torch.Tensor:
    """The joined layer's fused (b, n, n) matrix from its pieces as (n, n) matrices: per head
    L_h = w_a·A_h + w_m·F (parallel) or F·(w_h·I + w_T·A_h) (shared), then fused over the heads."""
    A = operators.attention_rows(lay.attention, list(range(n))).to(f64)  # (b, H, n, n)
    eye = torch.eye(n, dtype=f64).expand(A.shape[0], n, n).contiguous()
    F = lay.mixer.apply_rows(eye, a=1.0, c=0.0)[:, None]  # (b, 1, n, n): the mixer's rows
    w1, w2 = w1[:, None, :, None], (1 - w1)[:, None, :, None]
    L = w1 * A + w2 * F if lay.kind == "parallel" else F @ (w1 * torch.eye(n, dtype=f64) + w2 * A)
    if how == "mean":
        return L.mean(1)
    if how == "max":
        return L.amax(1)
    w = torch.as_tensor(how, dtype=f64)
    return torch.einsum("bhij,h->bij", L, w / w.sum())


def _naive_blend(P: torch.Tensor, a: float, c: float, renorm: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """diag(1/s)·(a·P' + c·I'), P' = P with padding dropped (padded rows / columns 0, real rows rescaled to their
    full sum), I' the identity on real tokens, s the row sums with ``renorm`` (1 otherwise)."""
    b, n, _ = P.shape
    real = torch.ones(b, n, dtype=f64) if mask is None else mask.to(f64)
    kept = P * real[:, :, None] * real[:, None, :]
    before, after = P.sum(-1, keepdim=True) * real[..., None], kept.sum(-1, keepdim=True)
    P = torch.where(after > 0, kept * before / torch.where(after > 0, after, torch.ones_like(after)), 0 * kept)
    out = a * P + c * torch.diag_embed(real)
    if renorm:
        s = out.sum(-1, keepdim=True)
        out = torch.where(s > 0, out / torch.where(s > 0, s, torch.ones_like(s)), 0 * out)
    return out


@pytest.mark.slow  # every blend and padding on each family; the fast lane keeps the rollout against the dense route
@pytest.mark.parametrize("model_type", WIRED)
def test_each_joined_layer_is_the_naive_join_of_its_paths(model_type):
    model, inputs = _balanced(model_type).double(), _inputs()
    rec, shares = _record_with_shares(model_type, model, inputs)
    layers = rec.operators["self"]
    joined = [lay for lay in layers if isinstance(lay, JoinedRows)]
    hybrid = [hasattr(layer, "mamba_decoder") or model_type == "falcon_h1" for layer in model.model.layers]
    assert [isinstance(lay, JoinedRows) for lay in layers] == hybrid and len(joined) == len(shares) > 0
    assert all(isinstance(lay, ops.MixerRows) for lay, h in zip(layers, hybrid) if not h)  # a mixer alone
    mask = inputs["attention_mask"].bool()
    n = mask.shape[1]
    r = torch.rand(2, 3, n, dtype=f64, generator=torch.Generator().manual_seed(5)) * mask[:, None]
    fusions = ["mean", [1.0, 3.0, 0.5, 2.0]] + (["max"] if model_type == "falcon_h1" else [])
    for lay, w1 in zip(joined, shares):
        torch.testing.assert_close(lay.first.to(f64), w1, atol=1e-9, rtol=0)  # the weights measured here
        assert bool(((w1 > 0.02) & (w1 < 0.98))[mask].all()), w1  # both paths really enter (real tokens)
        for how in fusions:
            P = _naive_layer(lay, w1, how, n)
            for a, c, renorm, m in ((0.5, 0.5, False, None), (0.8, 0.2, False, mask), (1.0, 1.0, True, mask),
                                    (1.0, 1.0, True, None)):
                got = operators.apply_layer(r, lay, operators.fused_probs(how), a=a, c=c, renorm=renorm, mask=m)
                want = r @ _naive_blend(P, a, c, renorm, m)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


OPTIONS = [{}, {"residual_mode": "renorm"}, {"alpha": 0.8, "head_fusion": [1, 3, 0.5, 2]}, {"head_fusion": "max"}]


@pytest.mark.parametrize("model_type,opts", [  # max over the heads of a shared layer: refused (test below)
    pytest.param(p.values[0], o, marks=p.marks) for p in _params() for o in OPTIONS
    if o.get("head_fusion") != "max" or p.values[0] == "falcon_h1"])
def test_rollout_rows_only_equals_dense(model_type, opts):
    model, inputs = _balanced(model_type), _inputs()
    assert attnroll.capture.model_facts(model).dense_only == ""
    dense = attnroll.explain(model, inputs, method="rollout", attention="dense", sinks="keep", **opts)
    rows = attnroll.explain(model, inputs, method="rollout", sinks="keep", **opts)
    assert rows.options["attention"] == "recompute" and dense.options["attention"] == "dense"
    torch.testing.assert_close(rows.full_row, dense.full_row, atol=1e-6, rtol=0)
    assert rows.full_row[1, -3:].abs().max() == 0  # padding gets nothing
    layers = attnroll.explain(model, inputs, method="rollout", sinks="keep", return_layers=True, **opts)
    want = attnroll.explain(model, inputs, method="rollout", attention="dense", sinks="keep", return_layers=True,
                            **opts)
    torch.testing.assert_close(layers.layers, want.layers, atol=1e-6, rtol=0)
    # a padded example equals the same example cropped
    alone = attnroll.explain(model, {k: v[1:, :6] for k, v in inputs.items()}, method="rollout", sinks="keep", **opts)
    torch.testing.assert_close(alone.full_row[0], rows.full_row[1, :6], atol=1e-5, rtol=1e-5)


def test_max_over_a_shared_layer_is_refused_rows_only():
    model, inputs = _balanced("zamba2"), _inputs()
    with pytest.raises(ValueError, match=r"head_fusion='max'.*Zamba2HybridLayer.*attention='dense'"):
        attnroll.explain(model, inputs, method="rollout", attention="recompute", head_fusion="max")
    auto = attnroll.explain(model, inputs, method="rollout", head_fusion="min", sinks="keep")
    assert auto.options["attention"] == "dense"
    rec = capture_kernels(model, inputs)  # and the layer itself refuses, naming the fusion
    lay = next(lay for lay in rec.operators["self"] if isinstance(lay, JoinedRows))
    with pytest.raises(ValueError, match="head_fusion='max'"):
        operators.apply_layer(torch.ones(2, 1, 9), lay, operators.fused_probs("max"), a=0.5, c=0.5)
    with pytest.raises(ValueError, match="head-fused probabilities"):
        operators.apply_layer(torch.ones(2, 1, 9), lay, operators.weighted_probs(), a=0.5, c=0.5)


# ------------------------------------------------------------------------------- the layer alone
class _DenseMixer:
    """A stand-in mixer layer holding its fused matrix F (b, n, n): r·(a·F + c·I), what JoinedRows asks of one."""

    rows = 4

    def __init__(self, F: torch.Tensor):
        self.F = F

    def apply_rows(self, r, *, a, c, renorm=False, mask=None):
        assert mask is None and not renorm
        return a * (r @ self.F) + c * r


def _pieces(g: torch.Generator, b: int = 2, H: int = 3, n: int = 11, d: int = 4):
    """An attention layer (random q, k, a left-padding mask) and a mixer F whose real rows put mass on padded
    columns (so that dropping the padding rescales the joined rows), with a per-token weight in (0, 1)."""
    q, k = torch.randn(b, H, n, d, generator=g), torch.randn(b, H, n, d, generator=g)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :3] = False
    lay = operators.KernelInputs(q=q, k=k, scaling=0.5, causal=True, mask=mask[:, None, None, :], is_causal_model=True)
    F = torch.rand(b, n, n, dtype=f64, generator=g).tril()
    F = F / F.sum(-1, keepdim=True)
    return lay, F, torch.rand(b, n, dtype=f64, generator=g), mask


@pytest.mark.parametrize("kind,how", [  # max / min over the heads of a shared layer: refused (test below)
    (k, h) for k in ("parallel", "shared") for h in ("mean", "max", "min", [2.0, 1.0, 1.0])
    if k == "parallel" or h not in ("max", "min")])
def test_joined_layer_equals_the_dense_pipeline_on_its_matrix(kind, how):
    lay, F, w1, mask = _pieces(torch.Generator().manual_seed(6))
    joined = JoinedRows(lay, _DenseMixer(F), w1, 1 - w1, kind=kind)
    b, H, n, _ = lay.shape
    A = operators.attention_rows(lay, list(range(n))).to(f64)
    W1, W2 = w1[:, None, :, None], (1 - w1)[:, None, :, None]
    L = W1 * A + W2 * F[:, None] if kind == "parallel" else F[:, None] @ (W1 * torch.eye(n, dtype=f64) + W2 * A)
    r = torch.rand(b, 2, n, dtype=f64, generator=torch.Generator().manual_seed(7)) * mask[:, None]
    for mode, alpha in (("blend", 0.5), ("renorm", 0.3), ("add", 0.5)):
        pipe_mask = attnroll.core.rollout.LayerPipeline(n, head_fusion=how, alpha=alpha, residual_mode=mode, mask=mask)
        pipe = attnroll.core.rollout.LayerPipeline(n, head_fusion=how, alpha=alpha, residual_mode=mode)
        for p, m in ((pipe_mask, mask), (pipe, None)):
            want = r @ p.augmented(L)
            got = operators.apply_layer(r, joined, operators.fused_probs(how), a=p.a, c=p.c, renorm=p.renorm, mask=m)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def _largest(kind: str, n: int, rows: int = 8) -> int:
    """The largest tensor of one joined layer applied to a relevance row at length n (padding and renorm: the
    column products too), blocks of ``rows`` rows for both the attention and the mixer (an SSD mixer)."""
    g = torch.Generator().manual_seed(8)
    b, H, h, N, P, K = 2, 2, 2, 3, 2, 4
    q, k = torch.randn(b, H, n, 4, generator=g), torch.randn(b, H, n, 4, generator=g)
    att = operators.KernelInputs(q=q, k=k, scaling=0.5, causal=True, is_causal_model=True)
    C, B = (torch.randn(b, n, h, N, dtype=f64, generator=g) for _ in range(2))
    dt = torch.nn.functional.softplus(torch.randn(b, n, h, dtype=f64, generator=g))
    mixer = ops.SSDRows(C, B, dt, -torch.rand(h, dtype=f64, generator=g), torch.randn(h, dtype=f64, generator=g),
                        torch.rand(b, n, h * P, dtype=f64, generator=g), torch.randn(h * P, K, dtype=f64, generator=g),
                        rows=rows)
    w = torch.rand(b, n, dtype=f64, generator=g)
    joined = JoinedRows(att, mixer, w, 1 - w, kind=kind)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, -3:] = False
    r = torch.rand(b, 1, n, dtype=f64, generator=g)
    with _Largest() as seen:
        operators.apply_layer(r, joined, operators.fused_probs("mean"), a=1.0, c=1.0, renorm=True, mask=mask)
    return seen.largest


@pytest.mark.parametrize("kind", ["parallel", "shared"])
def test_joined_layer_memory_is_linear_in_the_length(kind, monkeypatch):
    """Doubling n at most doubles the largest tensor (an (n, n) one would quadruple it); blocks of n rows do
    grow as n², so the check sees quadratic growth where there is some."""
    monkeypatch.setattr(operators.KernelInputs, "block_rows", lambda self, budget=0: 8)
    small, big = _largest(kind, 96), _largest(kind, 192)
    assert big <= 2.1 * small and big < 2 * 2 * 192 * 192 / 4, (small, big)  # dense: (b, H, n, n)
    monkeypatch.setattr(operators.KernelInputs, "block_rows", lambda self, budget=0: self.shape[2])
    whole_small, whole_big = _largest(kind, 96, rows=96), _largest(kind, 192, rows=192)
    assert whole_big >= 3.5 * whole_small
