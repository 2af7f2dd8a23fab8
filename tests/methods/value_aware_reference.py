"""Independent references for the value-aware methods: weights read by *state_dict name* (not through
attnroll's anatomy), attention from the model's own eager ``output_attentions``, every formula written as
plain numpy loops over tokens, heads and shares. The naive block forward is itself checked against the
model's logits in the tests, so the references stand on the model, not on attnroll."""

from __future__ import annotations

import math

import numpy as np
import torch

T = __import__("pytest").importorskip("transformers")


# ----------------------------------------------------------------------------------------- tiny models
def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every parameter (norm weights around 1, everything else around 0) so that no bias, β or γ
    is trivial; float64, eval, eager attention."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            is_norm_weight = name.endswith("weight") and p.ndim == 1
            p.copy_(1 + 0.3 * noise if is_norm_weight else 0.35 * noise)
    return model.double().eval()


def build(kind: str, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """A ``layers``-layer float64 random-weight model of ``kind`` (bert, vit, gpt2, llama; the post-LN
    classifiers distilbert, roberta, electra have no naive :func:`spec`)."""
    eager = dict(attn_implementation="eager")
    if kind == "bert":
        cfg = T.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=layers, num_attention_heads=2,
                           intermediate_size=12, max_position_embeddings=16, num_labels=3, **eager)
        m = T.BertForSequenceClassification(cfg)
    elif kind == "distilbert":  # head: pre_classifier + ReLU
        cfg = T.DistilBertConfig(vocab_size=30, dim=8, n_layers=layers, n_heads=2, hidden_dim=12,
                                 max_position_embeddings=16, num_labels=3, **eager)
        m = T.DistilBertForSequenceClassification(cfg)
    elif kind == "roberta":  # head: dense + tanh + out_proj on the first row
        cfg = T.RobertaConfig(vocab_size=30, hidden_size=8, num_hidden_layers=layers, num_attention_heads=2,
                              intermediate_size=12, max_position_embeddings=24, num_labels=3, pad_token_id=0, **eager)
        m = T.RobertaForSequenceClassification(cfg)
    elif kind == "electra":  # head: dense + GELU + out_proj; embeddings projected 6 -> 8
        cfg = T.ElectraConfig(vocab_size=30, embedding_size=6, hidden_size=8, num_hidden_layers=layers,
                              num_attention_heads=2, intermediate_size=12, max_position_embeddings=16, num_labels=3,
                              **eager)
        m = T.ElectraForSequenceClassification(cfg)
    elif kind == "vit":
        cfg = T.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=8, num_hidden_layers=layers,
                          num_attention_heads=2, intermediate_size=12, num_labels=3, **eager)
        m = T.ViTForImageClassification(cfg)
    elif kind == "gpt2":
        cfg = T.GPT2Config(vocab_size=30, n_embd=8, n_layer=layers, n_head=2, n_positions=16, bos_token_id=0,
                           eos_token_id=0, **eager)
        m = T.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = T.LlamaConfig(vocab_size=30, hidden_size=8, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=12, max_position_embeddings=16,
                            bos_token_id=0, eos_token_id=0, **eager)
        m = T.LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    return _randomise(m, seed)


def inputs_for(kind: str, B: int = 2, n: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    if kind == "vit":
        return torch.randn(B, 3, 16, 16, generator=g, dtype=torch.float64)
    return {"input_ids": torch.randint(1, 30, (B, n), generator=g)}


# ----------------------------------------------------------------------------------------- naive spec
def _np(t):
    return t.detach().double().numpy()


def _gelu(v):
    return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


def _gelu_tanh(v):
    return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


def _silu(v):
    return v / (1 + np.exp(-v))


def spec(model, kind: str) -> dict:
    """Per-layer weights by state_dict name: heads, per-head W_V/b_V (by KV head) and W_O columns, b_O, both
    norms, the MLP, pre/post; plus the head."""
    sd = {k: _np(v) for k, v in model.state_dict().items()}
    c = model.config
    layers = []
    for l in range(c.num_hidden_layers if kind != "gpt2" else c.n_layer):
        if kind == "bert":
            p = f"bert.encoder.layer.{l}."
            Wv, bv = sd[p + "attention.self.value.weight"], sd[p + "attention.self.value.bias"]
            Wo, bo = sd[p + "attention.output.dense.weight"], sd[p + "attention.output.dense.bias"]
            ln1 = (sd[p + "attention.output.LayerNorm.weight"], sd[p + "attention.output.LayerNorm.bias"], c.layer_norm_eps, False)
            ln2 = (sd[p + "output.LayerNorm.weight"], sd[p + "output.LayerNorm.bias"], c.layer_norm_eps, False)
            mlp = dict(W1=sd[p + "intermediate.dense.weight"], b1=sd[p + "intermediate.dense.bias"],
                       W2=sd[p + "output.dense.weight"], b2=sd[p + "output.dense.bias"], act=_gelu)
            H = kv = c.num_attention_heads
            pre = False
        elif kind == "vit":
            p = f"vit.layers.{l}."
            Wv, bv = sd[p + "attention.v_proj.weight"], sd[p + "attention.v_proj.bias"]
            Wo, bo = sd[p + "attention.o_proj.weight"], sd[p + "attention.o_proj.bias"]
            ln1 = (sd[p + "layernorm_before.weight"], sd[p + "layernorm_before.bias"], c.layer_norm_eps, False)
            ln2 = (sd[p + "layernorm_after.weight"], sd[p + "layernorm_after.bias"], c.layer_norm_eps, False)
            mlp = dict(W1=sd[p + "mlp.fc1.weight"], b1=sd[p + "mlp.fc1.bias"], W2=sd[p + "mlp.fc2.weight"],
                       b2=sd[p + "mlp.fc2.bias"], act=_gelu)
            H = kv = c.num_attention_heads
            pre = True
        elif kind == "gpt2":
            p = f"transformer.h.{l}."
            d = c.n_embd
            Wv, bv = sd[p + "attn.c_attn.weight"][:, 2 * d:].T, sd[p + "attn.c_attn.bias"][2 * d:]
            Wo, bo = sd[p + "attn.c_proj.weight"].T, sd[p + "attn.c_proj.bias"]
            ln1 = (sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], c.layer_norm_epsilon, False)
            ln2 = (sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], c.layer_norm_epsilon, False)
            mlp = dict(W1=sd[p + "mlp.c_fc.weight"].T, b1=sd[p + "mlp.c_fc.bias"], W2=sd[p + "mlp.c_proj.weight"].T,
                       b2=sd[p + "mlp.c_proj.bias"], act=_gelu_tanh)
            H = kv = c.n_head
            pre = True
        else:
            p = f"model.layers.{l}."
            Wv, bv = sd[p + "self_attn.v_proj.weight"], None
            Wo, bo = sd[p + "self_attn.o_proj.weight"], None
            ln1 = (sd[p + "input_layernorm.weight"], None, c.rms_norm_eps, True)
            ln2 = (sd[p + "post_attention_layernorm.weight"], None, c.rms_norm_eps, True)
            mlp = dict(W1=sd[p + "mlp.up_proj.weight"], b1=None, W2=sd[p + "mlp.down_proj.weight"], b2=None,
                       Wg=sd[p + "mlp.gate_proj.weight"], act=_silu)
            H, kv = c.num_attention_heads, c.num_key_value_heads
            pre = True
        dh = Wv.shape[0] // kv
        heads = []
        for h in range(H):
            g = h // (H // kv)
            heads.append(dict(Wv=Wv[g * dh:(g + 1) * dh], bv=None if bv is None else bv[g * dh:(g + 1) * dh],
                              Wo=Wo[:, h * dh:(h + 1) * dh]))
        layers.append(dict(heads=heads, bo=bo, ln1=ln1, ln2=ln2, mlp=mlp, pre=pre))
    head = _head_spec(sd, kind, model.config)
    return dict(layers=layers, head=head, readout="last" if kind in ("gpt2", "llama") else "first")


def _head_spec(sd, kind, c):
    if kind == "bert":
        return dict(final=None, pooler=(sd["bert.pooler.dense.weight"], sd["bert.pooler.dense.bias"]),
                    W=sd["classifier.weight"], b=sd["classifier.bias"])
    if kind == "vit":
        return dict(final=(sd["vit.layernorm.weight"], sd["vit.layernorm.bias"], c.layer_norm_eps, False),
                    pooler=None, W=sd["classifier.weight"], b=sd["classifier.bias"])
    if kind == "gpt2":
        return dict(final=(sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"], c.layer_norm_epsilon, False),
                    pooler=None, W=sd["lm_head.weight"], b=None)
    return dict(final=(sd["model.norm.weight"], None, c.rms_norm_eps, True), pooler=None, W=sd["lm_head.weight"], b=None)


# ----------------------------------------------------------------------------------------- naive forward
def ln(v, p, actual=None):
    """A norm applied to v; with ``actual``, the share map g(v) with the actual vector's statistics (no β)."""
    g, b, eps, rms = p
    a = v if actual is None else actual
    scale = math.sqrt(np.mean(a ** 2) + eps) if rms else math.sqrt(np.var(a) + eps)
    out = (v if rms else v - v.mean()) / scale * g
    return out + b if (b is not None and actual is None) else out


def norm_matrix(p, actual):
    """G (d, d) with G v = the norm's share map of v at the actual vector (β apart): diag(γ) (I − 11ᵀ/d) / σ
    for a LayerNorm, diag(γ) / rms for an RMSNorm."""
    g, _, eps, rms = p
    d = len(actual)
    if rms:
        return np.diag(g) / math.sqrt(np.mean(actual ** 2) + eps)
    return np.diag(g) @ (np.eye(d) - np.ones((d, d)) / d) / math.sqrt(np.var(actual) + eps)


def mlp_slopes(L, u):
    """The MLP's per-element coefficients at its actual input u: act(ζ)/ζ (0 at ζ = 0), or a gated MLP's gate
    act(W_g u) held at its value."""
    m = L["mlp"]
    if "Wg" in m:
        return m["act"](m["Wg"] @ u)
    z = m["W1"] @ u + (0 if m["b1"] is None else m["b1"])
    return np.where(z != 0, m["act"](z) / np.where(z != 0, z, 1), 0.0)


def f_vec(L, h, xv):
    hd = L["heads"][h]
    v = hd["Wv"] @ xv + (0 if hd["bv"] is None else hd["bv"])
    return hd["Wo"] @ v


def mlp(L, u):
    m = L["mlp"]
    z = m["W1"] @ u + (0 if m["b1"] is None else m["b1"])
    inner = m["act"](m["Wg"] @ u) * z if "Wg" in m else m["act"](z)
    return m["W2"] @ inner + (0 if m["b2"] is None else m["b2"])


def attention_out(L, x, alpha, zero=None):
    """Attention branch output per row (n, d), b_O included; ``zero`` = a token whose values are zeroed."""
    n, d = x.shape
    xv = [ln(x[j], L["ln1"]) if L["pre"] else x[j] for j in range(n)]
    out = np.zeros((n, d))
    for i in range(n):
        for j in range(n):
            if j == zero:
                continue
            for h in range(len(L["heads"])):
                out[i] += alpha[h, i, j] * f_vec(L, h, xv[j])
        out[i] += 0 if L["bo"] is None else L["bo"]
    return out


def layer_forward(L, x, alpha, zero=None):
    """(attention-branch pre-norm sum r1 (n, d), layer output (n, d), h1 (n, d), r2 (n, d))."""
    a = attention_out(L, x, alpha, zero)
    n = len(x)
    if L["pre"]:
        h1 = x + a
        out = np.stack([h1[i] + mlp(L, ln(h1[i], L["ln2"])) for i in range(n)])
        return h1, out, h1, out
    r1 = x + a
    h1 = np.stack([ln(r1[i], L["ln1"]) for i in range(n)])
    r2 = np.stack([h1[i] + mlp(L, h1[i]) for i in range(n)])
    return r1, np.stack([ln(r2[i], L["ln2"]) for i in range(n)]), h1, r2


def head_forward(S, vec):
    hd = S["head"]
    if hd["final"] is not None:
        vec = ln(vec, hd["final"])
    if hd["pooler"] is not None:
        vec = np.tanh(hd["pooler"][0] @ vec + hd["pooler"][1])
    return hd["W"] @ vec + (0 if hd["b"] is None else hd["b"])


def model_states(model, inputs):
    """Per-layer inputs (L x (B, n, d)) and attention (L x (B, H, n, n)) from the model's own outputs."""
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True) if isinstance(inputs, dict) \
            else model(inputs, output_attentions=True, output_hidden_states=True)
    L = len(out.attentions)
    return [_np(h) for h in out.hidden_states[:L]], [_np(a) for a in out.attentions], _np(out.logits)


# ----------------------------------------------------------------------------------------- naive methods
def z_vectors(L, x, alpha, residual=True):
    n = len(x)
    xv = [ln(x[j], L["ln1"]) if L["pre"] else x[j] for j in range(n)]
    z = np.zeros((n, n, x.shape[1]))
    for i in range(n):
        for j in range(n):
            for h in range(len(L["heads"])):
                z[i, j] += alpha[h, i, j] * f_vec(L, h, xv[j])
            if residual and i == j:
                z[i, j] += x[j]
    return z


def normalise(C):
    s = C.sum(-1, keepdims=True)
    return np.where(s > 0, C / np.where(s > 0, s, 1), 0)


def matrices(method, S, xs, alphas, b):
    """The per-layer contribution matrices of example b, naive."""
    out = []
    for l, L in enumerate(S["layers"]):
        x, alpha = xs[l][b], alphas[l][b]
        n = len(x)
        r1, y_out, h1, r2 = layer_forward(L, x, alpha)
        if method == "norm":
            out.append(np.linalg.norm(z_vectors(L, x, alpha, residual=False), axis=-1))
            continue
        z = z_vectors(L, x, alpha)
        C = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                if method == "norm_rollout" or (method == "globenc" and L["pre"]):
                    v = z[i, j]
                    if method == "globenc" and l == len(S["layers"]) - 1 and S["head"]["final"] is not None:
                        v = ln(v, S["head"]["final"], actual=y_out[i])
                    C[i, j] = np.linalg.norm(v)
                elif method == "globenc":
                    C[i, j] = np.linalg.norm(ln(ln(z[i, j], L["ln1"], r1[i]), L["ln2"], r2[i]))
                elif method == "alti":
                    Tij = z[i, j] if L["pre"] else ln(z[i, j], L["ln1"], r1[i])
                    y = h1[i]
                    C[i, j] = max(0.0, np.abs(y).sum() - np.abs(y - Tij).sum())
                elif method == "value_zeroing":
                    new = layer_forward(L, x, alpha, zero=j)[1][i]
                    cos = new @ y_out[i] / (np.linalg.norm(new) * np.linalg.norm(y_out[i]))
                    C[i, j] = max(0.0, 1 - cos)
        out.append(C)
    return out


def rolled(method, S, xs, alphas, b, row):
    Cs = [normalise(C) for C in matrices(method, S, xs, alphas, b)]
    R = np.eye(len(Cs[0]))
    for C in Cs:
        R = C @ R
    return R[row]


# ----------------------------------------------------------------------------------------- measured share
def measured_parts(L, x, alpha):
    """(T_res, T_mix, bias part) of every row (n, d) each: the residual x_i and the attention mix a_i pushed
    through the block, norms with the actual statistics, the MLP linearised at the actual pre-activation."""
    n = len(x)
    a = attention_out(L, x, alpha) - (0 if L["bo"] is None else L["bo"])
    m = L["mlp"]
    parts = np.zeros((3, n, x.shape[1]))
    for i in range(n):
        full = x[i] + a[i] + (0 if L["bo"] is None else L["bo"])
        u = ln(full, L["ln2"]) if L["pre"] else ln(full, L["ln1"])  # what the MLP reads
        zeta = m["W1"] @ u + (0 if m["b1"] is None else m["b1"])
        coef = m["act"](m["Wg"] @ u) if "Wg" in m else m["act"](zeta) / zeta

        def through(s):  # a part s of the block's pre-norm sum, linearised through the rest of the block
            if L["pre"]:
                return s + m["W2"] @ (coef * (m["W1"] @ ln(s, L["ln2"], actual=full)))
            g = ln(s, L["ln1"], actual=full)
            return ln(g + m["W2"] @ (coef * (m["W1"] @ g)), L["ln2"], actual=u + mlp(L, u))

        parts[0, i], parts[1, i] = through(x[i]), through(a[i])
        out = full + mlp(L, u) if L["pre"] else ln(u + mlp(L, u), L["ln2"])
        parts[2, i] = out - parts[0, i] - parts[1, i]
    return parts


def measured_matrix(L, x, alpha):
    """measured_rollout's matrix of one layer (n, n): M_ij = (1 − r_i) mean_h α^h_ij + r_i δ_ij with
    r_i = ‖T_res,i‖ / (‖T_res,i‖ + ‖T_mix,i‖) from :func:`measured_parts`."""
    Tr, Tm, _ = measured_parts(L, x, alpha)
    M = np.zeros((len(x), len(x)))
    for i in range(len(x)):
        r = np.linalg.norm(Tr[i]) / (np.linalg.norm(Tr[i]) + np.linalg.norm(Tm[i]))
        for j in range(len(x)):
            M[i, j] = (1 - r) * alpha[:, i, j].mean() + (r if i == j else 0.0)
    return M


# ----------------------------------------------------------------------------------------- naive DecompX
def absdot_split(Si, b, mode="absdot"):
    """Si (K, d) shares of one row (last = bias slot) plus bias b split by AbsDot; ``mode="separate"``: b
    joins the bias slot."""
    if b is None:
        return Si
    Si = Si.copy()
    w = np.array([abs(b @ Si[k]) for k in range(len(Si) - 1)])
    if mode == "absdot" and w.sum() > 0:
        for k in range(len(w)):
            Si[k] += w[k] / w.sum() * b
    else:
        Si[-1] += b
    return Si


def _norm_shares(Si, p, mode):
    actual = Si.sum(0)
    out = np.stack([ln(Si[k], p, actual=actual) for k in range(len(Si))])
    return absdot_split(out, p[1], mode)


def _mlp_shares(L, U, mode):
    m = L["mlp"]
    Z = absdot_split(np.stack([m["W1"] @ u for u in U]), m["b1"], mode)
    if "Wg" in m:
        coef = m["act"](m["Wg"] @ U.sum(0))
    else:
        zeta = Z.sum(0)
        coef = np.where(zeta != 0, m["act"](zeta) / np.where(zeta != 0, zeta, 1), 0)
    return absdot_split(np.stack([m["W2"] @ (coef * z) for z in Z]), m["b2"], mode)


def decompx(S, x0, alphas, b, row, cls, bias="absdot"):
    """Token shares (n + 1,) of logit ``cls`` at output row ``row`` of example b, by loops; ``bias`` the rule
    ("absdot" or "separate": every bias in the last slot)."""
    x = x0[b]
    n, d = x.shape
    K = n + 1
    Sh = np.zeros((n, K, d))
    for i in range(n):
        Sh[i, i] = x[i]
    for l, L in enumerate(S["layers"]):
        alpha = alphas[l][b]
        X = np.stack([_norm_shares(Sh[j], L["ln1"], bias) for j in range(n)]) if L["pre"] else Sh
        new = np.zeros_like(Sh)
        b_attn = sum(hd["Wo"] @ hd["bv"] for hd in L["heads"] if hd["bv"] is not None) + (0 if L["bo"] is None else L["bo"])
        b_attn = None if isinstance(b_attn, int) else b_attn
        for i in range(n):
            z = Sh[i].copy()
            for k in range(K):
                for j in range(n):
                    for h, hd in enumerate(L["heads"]):
                        z[k] += alpha[h, i, j] * (hd["Wo"] @ (hd["Wv"] @ X[j, k]))
            z = absdot_split(z, b_attn, bias)
            if L["pre"]:
                new[i] = z + _mlp_shares(L, _norm_shares(z, L["ln2"], bias), bias)
            else:
                hh = _norm_shares(z, L["ln1"], bias)
                new[i] = _norm_shares(hh + _mlp_shares(L, hh, bias), L["ln2"], bias)
        Sh = new
    V = Sh[row]
    hd = S["head"]
    if hd["final"] is not None:
        V = _norm_shares(V, hd["final"], bias)
    if hd["pooler"] is not None:
        Z = absdot_split(np.stack([hd["pooler"][0] @ v for v in V]), hd["pooler"][1], bias)
        zeta = Z.sum(0)
        V = Z * (np.tanh(zeta) / zeta)
    logits = absdot_split(np.stack([hd["W"] @ v for v in V]), hd["b"], bias)
    return logits[:, cls]
