"""Validation harness (seed 777) for the value-aware candidate maps. float64 re-implementation of the shapes ViT."""
import math, sys, time
import numpy as np, torch
import torch.nn.functional as Fn
from attnroll.models.shapes import load_shapes_model, make_dataset, preprocess, patch_masks
from attnroll.evaluate.registry import MetricInputs, metric_info
from attnroll.evaluate.suite import _stderr
from attnroll.commands._data import fill_tensor
from attnroll.models import load_model

torch.set_grad_enabled(False)
MODEL = load_shapes_model(); MODEL.eval()
SD = {k: v.double() for k, v in MODEL.state_dict().items()}
L, H, D = 4, 4, 64
dh = D // H

def ln(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdim=True); var = x.var(-1, unbiased=False, keepdim=True)
    s = (var + eps).sqrt()
    return (x - mu) / s * w + b, s

def forward(px, target=None, want_grad=True):
    """float64 forward; returns per-layer dict list, logits; grads of target logit if want_grad."""
    with torch.enable_grad():
        p = SD
        t = Fn.conv2d(px.double(), p['vit.embeddings.patch_embeddings.projection.weight'], p['vit.embeddings.patch_embeddings.projection.bias'], stride=8)
        B = t.shape[0]
        t = t.flatten(2).transpose(1, 2)
        x = torch.cat([p['vit.embeddings.cls_token'].expand(B, 1, D), t], 1) + p['vit.embeddings.position_embeddings']
        layers = []
        for l in range(L):
            q = f'vit.layers.{l}.'
            u, s1 = ln(x, p[q+'layernorm_before.weight'], p[q+'layernorm_before.bias'])
            Q = (u @ p[q+'attention.q_proj.weight'].T + p[q+'attention.q_proj.bias']).view(B, -1, H, dh).transpose(1, 2)
            K = (u @ p[q+'attention.k_proj.weight'].T + p[q+'attention.k_proj.bias']).view(B, -1, H, dh).transpose(1, 2)
            V = (u @ p[q+'attention.v_proj.weight'].T + p[q+'attention.v_proj.bias']).view(B, -1, H, dh)
            Wo = p[q+'attention.o_proj.weight'].view(D, H, dh)
            F = torch.einsum('bnhe,dhe->bnhd', V, Wo)  # f^h(u_j)
            alpha = torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(dh), -1)
            alpha.retain_grad() if alpha.requires_grad else alpha.requires_grad_(True)
            a = torch.einsum('bhij,bjhd->bid', alpha, F) + p[q+'attention.o_proj.bias']
            a.retain_grad()
            h = x + a
            v2, s2 = ln(h, p[q+'layernorm_after.weight'], p[q+'layernorm_after.bias'])
            zeta = v2 @ p[q+'mlp.fc1.weight'].T + p[q+'mlp.fc1.bias']
            act = Fn.gelu(zeta)
            m = act @ p[q+'mlp.fc2.weight'].T + p[q+'mlp.fc2.bias']
            out = h + m
            h.retain_grad(); out.retain_grad()
            layers.append(dict(x=x, u=u, alpha=alpha, F=F, a=a, h=h, s2=s2, zeta=zeta, m=m, out=out, l=l))
            x = out
        xf, sf = ln(x, p['vit.layernorm.weight'], p['vit.layernorm.bias'])
        logits = xf[:, 0] @ p['classifier.weight'].T + p['classifier.bias']
        if target is None:
            target = logits.argmax(1)
        if want_grad:
            y = logits.gather(1, target[:, None]).sum()
            y.backward()
    for d in layers:
        d['g_alpha'] = d['alpha'].grad
        d['g_h'] = d['h'].grad  # = dy/da
        d['g_out'] = d['out'].grad
        for k in list(d):
            if isinstance(d[k], torch.Tensor):
                d[k] = d[k].detach()
    return layers, logits.detach(), target, sf.detach(), xf.detach()

def rownorm(C):
    s = C.sum(-1, keepdim=True)
    return torch.where(s > 0, C / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(C))

def roll(Ms):
    """CLS row of M_L ... M_1, drop CLS column."""
    r = torch.zeros(Ms[0].shape[0], Ms[0].shape[-1], dtype=Ms[0].dtype); r[:, 0] = 1
    for M in reversed(Ms):
        r = torch.einsum('bi,bij->bj', r, M)
    return r[:, 1:]

# ------------------------------------------------------------------ data + scoring
def data(seed, n=200):
    images, labels, masks = make_dataset(n, seed)
    return preprocess(images), labels, patch_masks(masks)

LM = load_model('shapes')
def score(x, masks, target, scores, steps=None, metrics=None):
    fill = fill_tensor('black', LM, x)
    inp = MetricInputs(MODEL, x, target.tolist(), masks, 64, {'fill': fill, 'steps': steps, 'bins': None, 'keep': None})
    metrics = metrics or ['deletion', 'insertion', 'positive', 'negative', 'pointing', 'mass', 'iou']
    out = {}
    with torch.no_grad():
        for k in metrics:
            v = metric_info(k).compute(inp, scores.float(), (8, 8))
            pe = np.asarray(v.per_example, dtype=np.float64)
            out[k] = (float(np.nanmean(pe)), _stderr(pe), pe)
    return out
