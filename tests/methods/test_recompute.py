"""The matrix-free route (attention="recompute") against the dense one (eager n×n capture), family by family.

The dense route switches the model to eager attention and rolls out the captured probabilities; the
recompute route leaves the model's own kernel (SDPA here, eager for Gemma 2) in place and recomputes the
probabilities blockwise from the queries and keys the kernel received. They must agree to 1e-5."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnroll
from attnroll.core import operators

from ..zoo import T, sharp

# Left out of `make test-fast` (its 90 s budget on 2 cores); `make test` and CI run it.
pytestmark = pytest.mark.slow

inputs_for, model = sharp.inputs_for, sharp.model

GEMMA2 = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=64,
              initializer_range=0.3, sliding_window=4, bos_token_id=0, eos_token_id=0, pad_token_id=0)
FAMILIES = {
    "vit": lambda: model("vit"),
    "bert": lambda: model("bert"),
    "gpt2": lambda: model("gpt2"),
    "llama": lambda: model("llama"),  # 4 query heads sharing 2 key/value heads
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, initializer_range=0.3,
        bos_token_id=0, eos_token_id=0)),
    # Gemma 2: softcapping at 1.0 (so that tanh bends the logits) and alternating sliding / global layers.
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**GEMMA2, attn_logit_softcapping=1.0)),
}
TEXT_INPUTS = {"mistral": "llama", "gemma2": "llama"}
METHODS = ("raw", "rollout", "grad_rollout", "gae")


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILIES[name]().eval()


def inputs(name: str, n: int, pad: bool = True) -> dict:
    out = inputs_for(TEXT_INPUTS.get(name, name), batch=3, n=n, pad=pad)
    if pad and name not in ("vit", "bert"):
        # Decoders get left padding as well (example 0), the usual layout for generation.
        out["attention_mask"][0, :3] = 0
    return out


def assert_same(d: attnroll.Explanation, r: attnroll.Explanation) -> None:
    scale = max(1.0, float(d.full_row.abs().max()))
    assert d.positions == r.positions
    torch.testing.assert_close(r.full_row, d.full_row, atol=1e-5 * scale, rtol=0)
    torch.testing.assert_close(r.scores, d.scores, atol=1e-5 * scale, rtol=0)
    if d.layers is not None:
        torch.testing.assert_close(r.layers, d.layers, atol=1e-5 * scale, rtol=0)
    assert d.options["attention"] == "dense" and r.options["attention"] == "recompute"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", METHODS)
def test_recompute_equals_dense(family, method):
    m = build(family)
    n = {"gpt2": 9, "llama": 13, "mistral": 11, "gemma2": 10}.get(family, 8)
    x = inputs(family, n)
    d = attnroll.explain(m, x, method, attention="dense")
    r = attnroll.explain(m, x, method, attention="recompute")
    assert_same(d, r)
    # Auto mode takes the recompute route for transformers models.
    assert attnroll.explain(m, x, method).options["attention"] == "recompute"


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
@pytest.mark.parametrize("n", [5, 17, 40])
def test_recompute_several_lengths_with_and_without_padding(family, n):
    """Without padding the fused kernel gets no mask at all (is_causal): the causal structure is rebuilt."""
    m = build(family)
    for pad in (False, True):
        x = inputs(family, n, pad=pad)
        for method in ("rollout", "gae"):
            assert_same(attnroll.explain(m, x, method, attention="dense"),
                        attnroll.explain(m, x, method, attention="recompute"))


@pytest.mark.parametrize("opts", [
    dict(method="rollout", head_fusion="max"),
    dict(method="rollout", head_fusion=[0.1, 0.2, 0.3, 0.4], residual_mode="renorm", alpha=0.3),
    dict(method="rollout", start_layer=1, return_layers=True),
    dict(method="rollout", end_layer=1, position=4, residual_mode="add"),
    dict(method="grad_rollout", clamp="after_mean", return_layers=True),
    dict(method="grad_rollout", residual_mode="blend", alpha=0.7),
    dict(method="gae", start_layer=1),
    dict(method="raw", layer=0, head_fusion="min", return_layers=True),
])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_recompute_options_match_dense(opts, family):
    m = build(family)
    x = inputs(family, 9)
    opts = dict(opts)
    method = opts.pop("method")
    assert_same(attnroll.explain(m, x, method, attention="dense", **opts),
                attnroll.explain(m, x, method, attention="recompute", **opts))


@pytest.mark.parametrize("family", ["llama", "gemma2", "bert"])
def test_attention_implementation_never_changes(family):
    """Asserted during the forward, inside every attention module: the recompute route runs the model's own
    kernel. The dense route, for contrast, does switch it (so the check can fail)."""
    m = build(family)
    own = m.config._attn_implementation
    seen = []
    handles = [mod.register_forward_pre_hook(lambda mod, args: seen.append(mod.config._attn_implementation))
               for mod in m.modules() if type(mod).__name__.endswith(("Attention", "SelfAttention"))
               and hasattr(mod, "config")]
    x = inputs(family, 8)
    for method in ("rollout", "gae"):
        seen.clear()
        attnroll.explain(m, x, method, attention="recompute")
        assert seen and set(seen) == {own}
    seen.clear()
    attnroll.explain(m, x, "rollout", attention="dense")
    assert set(seen) == {"eager"}
    for h in handles:
        h.remove()
    assert m.config._attn_implementation == own


def test_kernel_wrapper_restored_on_exceptions():
    from transformers.modeling_utils import AttentionInterface

    before = AttentionInterface.__dict__["get_interface"]
    m = build("llama")
    with pytest.raises(Exception):
        attnroll.explain(m, {"input_ids": torch.full((1, 5), 10_000)}, "rollout", attention="recompute")
    assert AttentionInterface.__dict__["get_interface"] is before


def test_recompute_record_keeps_no_matrix():
    """The record holds per-layer queries and keys of O(n·d) size, post-RoPE (not the raw projections)."""
    m = build("llama")
    x = inputs("llama", 12)
    from attnroll.capture.recompute import capture_kernels

    rec = capture_kernels(m, x)
    assert rec.streams == {} and len(rec.operators["self"]) == 2
    lay = rec.operators["self"][0]
    assert lay.q.shape == (3, 4, 12, 8) and lay.k.shape == (3, 2, 12, 8)
    hidden = m.model.embed_tokens(x["input_ids"])
    attn = m.model.layers[0].self_attn
    raw_q = attn.q_proj(m.model.layers[0].input_layernorm(hidden)).view(3, 12, 4, 8).transpose(1, 2)
    assert not torch.allclose(raw_q, lay.q, atol=1e-3)  # RoPE was applied before the kernel saw it
    assert torch.allclose(raw_q[:, :, 0], lay.q[:, :, 0], atol=1e-5)  # position 0: rotation by angle 0


def test_recompute_refusals():
    m = build("bert")
    x = inputs("bert", 7)
    with pytest.raises(ValueError, match="discard_ratio"):
        attnroll.explain(m, x, "rollout", attention="recompute", discard_ratio=0.5)
    with pytest.raises(ValueError, match="attention must be one of"):
        attnroll.explain(m, x, "rollout", attention="fast")
    # Auto mode falls back to the dense route for sparsification.
    e = attnroll.explain(m, x, "rollout", discard_ratio=0.5)
    assert e.options["attention"] == "dense"
    mha = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
    with pytest.raises(ValueError, match="transformers model"):
        attnroll.explain(mha.eval(), torch.randn(1, 4, 16), "rollout", attention="recompute",
                         target=lambda o: o.sum(dim=(1, 2)))


def test_blocks_smaller_than_the_sequence(monkeypatch):
    """Many query blocks (and skipped blocks of the last layer) give the same rows as one block."""
    m = build("llama")
    x = inputs("llama", 40)
    one = attnroll.explain(m, x, "gae", attention="recompute")
    monkeypatch.setattr(operators, "BLOCK_ELEMENTS", 1)  # 16-row blocks
    monkeypatch.setattr(operators.KernelInputs.block_rows, "__defaults__", (1,))
    many = attnroll.explain(m, x, "gae", attention="recompute")
    torch.testing.assert_close(many.full_row, one.full_row, atol=1e-6, rtol=0)
    assert_same(attnroll.explain(m, x, "gae", attention="dense"), many)


def test_same_model_copy_is_untouched():
    m = build("gpt2")
    ref = copy.deepcopy(m)
    attnroll.explain(m, inputs("gpt2", 6), "gae", attention="recompute")
    assert all(p.grad is None for p in m.parameters())
    for a, b in zip(m.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


@pytest.fixture
def flashlike():
    """A kernel registered the way flash attention is: it gets no 4-D mask (None, or the (B, n) padding
    mask) and builds causality and the sliding window from its flags, as flash does (keys i−w+1..i)."""
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from transformers.modeling_utils import AttentionInterface

    def kernel(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw):
        assert attention_mask is None or attention_mask.ndim == 2
        n = query.shape[-2]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        ok = j <= i
        if sliding_window is not None:
            ok = ok & (j > i - sliding_window)
        ok = ok[None, None]
        if attention_mask is not None:
            ok = ok & attention_mask.bool()[:, None, None, :] | (i == j)  # padded rows keep themselves
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=ok, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("attnroll_windowed", kernel)
    AttentionMaskInterface.register("attnroll_windowed", flash_attention_mask)
    yield "attnroll_windowed"
    AttentionInterface._global_mapping.pop("attnroll_windowed")
    AttentionMaskInterface._global_mapping.pop("attnroll_windowed")


@pytest.mark.parametrize("pad", [False, True])
def test_flash_convention_window_and_padding(flashlike, pad):
    m = build("mistral")
    m.set_attn_implementation(flashlike)
    x = inputs("mistral", 13, pad=pad)
    for method in ("rollout", "gae"):
        assert_same(attnroll.explain(m, x, method, attention="dense"),
                    attnroll.explain(m, x, method, attention="recompute"))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's convention")
def test_recompute_memory_grows_linearly():
    """Peak memory of explain(rollout) at n = 1024 and 4096 in a fresh process: the growth must stay below one
    n×n float32 matrix at n = 4096 (64 MiB), where keeping the attention (2 layers x 4 heads) would need 8 of
    them (512 MiB). Loose on purpose: allocator noise is a few MiB."""
    script = Path(__file__).with_name("_peak_memory.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(attnroll.__file__).parents[1])}
    res = subprocess.run([sys.executable, str(script), "rollout", "1024", "4096"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    small, large = (int(v) for v in res.stdout.split())
    assert large - small < 4096 * 4096 * 4, (small, large)


@pytest.mark.parametrize("method", ["raw", "grad_rollout", "gae"])
def test_attention_sinks_gpt_oss(method):
    """gpt-oss: per-head sink logits join the softmax's denominator (rows sum to less than 1), alternating
    sliding-window and full layers; eager is its default kernel and stays so. (Dense ``rollout`` refuses such
    rows as non-stochastic, hence the three methods here.)"""
    m = _gpt_oss()
    x = inputs("llama", 11)
    assert_same(attnroll.explain(m, x, method, attention="dense"), attnroll.explain(m, x, method, attention="recompute"))


@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
def test_kernel_log_sum_exp_is_captured(family, monkeypatch):
    """SDPA's fused kernel computes each row's log-sum-exp and drops it; the capture keeps it (observed below
    autograd, the kernel untouched) for layers too large to be recomputed whole (here: every layer). It must
    equal log Σ_j exp(q_i·k_j·scaling) over the keys the row sees, computed here in full from the recorded
    queries and keys; the eager kernel has none to give. Small layers keep none (the small-n path needs none)."""
    from attnroll.capture.recompute import capture_kernels

    m = build(family)
    x = inputs(family, 10, pad=False)
    small = capture_kernels(m, x)
    assert all(lay.lse is None for lay in small.operators[small.stream_names()[0]])
    monkeypatch.setattr(operators, "WHOLE_ELEMENTS", 0)
    rec = capture_kernels(m, x)
    for lay in rec.operators[rec.stream_names()[0]]:
        k = lay.k.repeat_interleave(lay.q.shape[1] // lay.k.shape[1], dim=1)
        s = lay.q @ k.transpose(-1, -2) * lay.scaling
        if lay.causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        assert lay.lse is not None
        torch.testing.assert_close(lay.lse, torch.logsumexp(s, dim=-1), atol=1e-5, rtol=0)
    eager = build("gemma2")
    assert all(lay.lse is None for lay in capture_kernels(eager, inputs("gemma2", 8)).operators["self"])


@pytest.mark.parametrize("head_fusion", ["mean", "max"])
def test_rollout_refuses_sink_rows_on_both_routes(head_fusion):
    """Rows with attention sinks sum to less than 1: rollout refuses them on both routes, with the same check
    (the same layer and the same range of row sums); without sinks the same model is accepted."""
    m = _gpt_oss()
    x = inputs("llama", 9)
    errors = []
    for route in ("dense", "recompute"):
        with pytest.raises(ValueError, match="rows must sum to 1") as e:
            attnroll.explain(m, x, "rollout", attention=route, head_fusion=head_fusion)
        errors.append(str(e.value).split(". ")[0])
    assert errors[0].split(", but")[0] == errors[1].split(", but")[0]  # the same layer and tolerance
    (lo_d, hi_d), (lo_r, hi_r) = (re.findall(r"range from (\S+) to (\S+)", err)[0] for err in errors)
    assert abs(float(lo_d) - float(lo_r)) < 1e-4 and abs(float(hi_d) - float(hi_r)) < 1e-4
    with pytest.raises(ValueError, match="Attention sinks"):
        attnroll.explain(m, x, "rollout", attention="recompute")
    for mod in m.modules():
        if isinstance(getattr(mod, "sinks", None), torch.nn.Parameter):
            mod.sinks.data.fill_(-1e4)  # no mass left to the sinks: stochastic rows again
    assert_same(attnroll.explain(m, x, "rollout", attention="dense", head_fusion=head_fusion),
                attnroll.explain(m, x, "rollout", attention="recompute", head_fusion=head_fusion))


def _gpt_oss():
    torch.manual_seed(0)
    cfg = T.GptOssConfig(vocab_size=99, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                         num_experts_per_tok=1, sliding_window=4, max_position_embeddings=64, initializer_range=0.3,
                         layer_types=["sliding_attention", "full_attention"])
    return T.GptOssForCausalLM(cfg).eval()


@pytest.mark.parametrize("method", METHODS)
def test_additive_position_bias_through_the_interface_beit(method):
    """No installed ALiBi family (BLOOM, MPT, Falcon) calls its kernel through transformers' attention
    interface; BEiT does, with its relative position bias added to the logits as a float (1, H, n, n) mask —
    the additive-bias path an ALiBi model would take. The bias table is made non-zero (it starts at 0), and
    switching the bias off must change the answer (so the check can fail)."""
    torch.manual_seed(0)
    cfg = T.BeitConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                       image_size=32, patch_size=8, num_labels=3, use_relative_position_bias=True)
    m = T.BeitForImageClassification(cfg).eval()
    for mod in m.modules():
        if hasattr(mod, "relative_position_bias_table"):
            torch.nn.init.normal_(mod.relative_position_bias_table, std=2.0)
    x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    d = attnroll.explain(m, x, method, attention="dense")
    assert_same(d, attnroll.explain(m, x, method, attention="recompute"))
    if method not in ("raw", "rollout"):  # the gradient rules' rows are near uniform on this tiny model
        return
    for mod in m.modules():
        if hasattr(mod, "relative_position_bias_table"):
            torch.nn.init.zeros_(mod.relative_position_bias_table)
    assert not torch.allclose(d.full_row, attnroll.explain(m, x, method, attention="dense").full_row, atol=1e-4)


def test_direct_indexing_of_the_interface_is_recorded(monkeypatch):
    """A module that indexes ``ALL_ATTENTION_FUNCTIONS[impl]`` directly (as Qwen2.5-Omni's DiT does, and
    SAM 2/3 and EdgeTAM when they fall back from flash to SDPA) is recorded too, once per call: simulated here
    by routing Llama's get_interface lookups through indexing. The implementation is left as it is, and
    both class attributes are restored afterwards."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    m = build("llama")
    x = inputs("llama", 11)
    dense = {method: attnroll.explain(m, x, method, attention="dense") for method in ("rollout", "gae")}
    monkeypatch.setattr(ALL_ATTENTION_FUNCTIONS, "get_interface", lambda impl, default: ALL_ATTENTION_FUNCTIONS[impl],
                        raising=False)
    before = (AttentionInterface.__dict__["get_interface"], AttentionInterface.__dict__.get("__getitem__"))
    for method in ("rollout", "gae"):
        r = attnroll.explain(m, x, method)
        assert r.options["attention"] == "recompute"
        assert_same(dense[method], r)
    assert (AttentionInterface.__dict__["get_interface"], AttentionInterface.__dict__.get("__getitem__")) == before
    assert m.config._attn_implementation == "sdpa"


def test_record_does_not_keep_the_fused_projection_alive():
    """GPT-2 computes q, k and v in one projection; the rollout record keeps q and k only, so they must not
    stay views into that (B, n, 3·d) buffer (which would keep v alive too); gae needs v and keeps views."""
    from attnroll.capture.recompute import capture_kernels

    m = build("gpt2")
    x = inputs("gpt2", 9, pad=False)
    for lay in capture_kernels(m, x).operators["self"]:
        for t in (lay.q, lay.k):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    lay = capture_kernels(m, x, keep_grad=True).operators["self"][0]
    assert lay.q.untyped_storage().nbytes() == 3 * lay.q.numel() * lay.q.element_size()  # the fused buffer


@pytest.mark.parametrize("family", ["vit", "llama", "gpt2", "mistral"])
def test_recompute_equals_dense_on_the_tiled_path(family, monkeypatch):
    """Tiny configs take the small-n path (each layer recomputed whole); with its budget at 0 the same inputs
    go through the tiled path with the kernel's log-sum-exp, which must agree with the dense route too."""
    m = build(family)
    x = inputs(family, 12, pad=False)
    d = attnroll.explain(m, x, "rollout", attention="dense")
    whole = attnroll.explain(m, x, "rollout", attention="recompute")
    monkeypatch.setattr(operators, "WHOLE_ELEMENTS", 0)
    assert_same(d, whole)
    assert_same(d, attnroll.explain(m, x, "rollout", attention="recompute"))


def test_cached_adapter_follows_the_model_and_keeps_it_not_alive():
    """The kernel adapter is built once per model structure: after a layer's attention module is replaced
    (other weights), the recompute route still equals the dense route of the changed model; the cache holds
    no reference that keeps a dropped model alive."""
    import gc
    import weakref

    from attnroll.capture import recompute

    m = build("vit")
    x = inputs("vit", 8)
    first = attnroll.explain(m, x, "rollout", attention="recompute")
    torch.manual_seed(5)
    layer = m.vit.layers[1]
    layer.attention = type(layer.attention)(m.config).eval()
    changed = attnroll.explain(m, x, "rollout", attention="recompute")
    assert not torch.allclose(first.full_row, changed.full_row)
    assert_same(attnroll.explain(m, x, "rollout", attention="dense"), changed)
    ref = weakref.ref(m)
    assert m in recompute._ADAPTERS
    del m, layer
    gc.collect()
    assert ref() is None


def _small_model(family: str, kernel: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    if family == "vit3":
        m = T.ViTForImageClassification(T.ViTConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                                                     intermediate_size=37, image_size=32, patch_size=8,
                                                     num_labels=3, initializer_range=0.3)).eval()
        x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    else:
        m, x = build("llama"), inputs("llama", 12, pad=False)
    m.set_attn_implementation(kernel)
    return m, x


@pytest.mark.parametrize("family, kernel", [("vit3", "sdpa"), ("llama", "sdpa"), ("vit3", "eager")])
def test_small_layers_are_fused_during_the_forward(family, kernel):
    """With ``fuse_mean`` (explain's rollout with the head mean) every small layer below the top one is kept
    as its head-mean probabilities, computed while the forward runs; they equal the head mean of the
    model's own eager attention (a copy switched to eager, ``output_attentions``). Under transformers' SDPA
    kernel on CPU the capture computes those layers' attention itself (``attend_mean``), the top layer's too;
    under another kernel (eager: llama's then gets a mask tensor, not fused) the top layer keeps its queries
    and keys. Without ``fuse_mean`` (other rules, gradients) every layer does."""
    from attnroll.capture.recompute import capture_kernels

    m, x = _small_model(family, kernel)
    rec = capture_kernels(m, x, fuse_mean=True)
    kinds = [type(lay).__name__ for lay in rec.operators["self"]]
    assert kinds == ["FusedLayer"] * (len(kinds) - 1) + ["FusedLayer" if kernel == "sdpa" else "KernelInputs"]
    eager = copy.deepcopy(m)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        ref = eager(**x, output_attentions=True).attentions
    for lay, att in zip(rec.operators["self"][: len(kinds) - 1], ref):
        torch.testing.assert_close(lay.probs, att.mean(dim=1), atol=1e-5, rtol=0)
    assert lay.is_causal_model == (family == "llama") and rec.info["self"].causal == (family == "llama")
    assert all(type(lay).__name__ == "KernelInputs" for lay in capture_kernels(m, x).operators["self"])
    with torch.enable_grad():
        grad = capture_kernels(m, x, keep_grad=True, fuse_mean=True)
    assert all(type(lay).__name__ == "KernelInputs" for lay in grad.operators["self"])
    d = attnroll.explain(m, x, "rollout", attention="dense", return_layers=True)
    assert_same(d, attnroll.explain(m, x, "rollout", attention="recompute", return_layers=True))


@pytest.mark.parametrize("family", ["vit3", "llama"])
def test_the_attention_the_capture_computes_gives_the_model_its_outputs(family):
    """Where the capture computes a layer's attention itself (SDPA on CPU, fused layers), the model's forward
    under the capture gives what it gives without (its own SDPA kernel) and what eager attention gives, to
    float32 rounding: logits and every layer's hidden states; and explain's prediction is the model's."""
    from attnroll.capture.recompute import capture_kernels

    m, x = _small_model(family, "sdpa")
    got = {}
    handle = m.register_forward_hook(lambda mod, a, out: got.setdefault("out", out))
    try:
        capture_kernels(m, x, fuse_mean=True)
    finally:
        handle.remove()
    eager = copy.deepcopy(m)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        for ref in (m(**x, output_hidden_states=True), eager(**x, output_hidden_states=True)):
            torch.testing.assert_close(got["out"].logits, ref.logits, atol=1e-5, rtol=0)
    with torch.no_grad():
        captured = m(**x, output_hidden_states=True)
    assert len(captured.hidden_states) > 2
    e = attnroll.explain(m, x, "rollout")
    assert e.options["attention"] == "recompute"
    if family == "vit3":
        assert e.target == captured.logits.argmax(dim=-1).tolist()


def test_the_capture_computes_only_what_sdpa_computes_exactly(monkeypatch):
    """``own_attention_applies`` admits transformers' stock SDPA kernel on CPU, float32, no dropout, no
    gradients, no window; anything else keeps the model's kernel (and the layer is fused after it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnroll.capture.recompute import own_attention_applies

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    lay = operators.KernelInputs(q=q, k=k, scaling=8 ** -0.5)
    args = {"query": q, "key": k, "value": v, "dropout": 0.0}
    assert own_attention_applies(sdpa_attention_forward, lay, args)
    assert not own_attention_applies(lambda *a, **kw: None, lay, args)  # another kernel, even if named sdpa
    assert not own_attention_applies(sdpa_attention_forward, lay, {**args, "dropout": 0.1})
    assert not own_attention_applies(sdpa_attention_forward, operators.KernelInputs(q=q, k=k, scaling=1.0, window=3),
                                     args)
    assert not own_attention_applies(sdpa_attention_forward, lay, {**args, "value": v.double()})
    assert not own_attention_applies(sdpa_attention_forward, lay, {**args, "query": q.clone().requires_grad_()})
    assert not own_attention_applies(sdpa_attention_forward, lay, {**args, "output_attentions": True})
