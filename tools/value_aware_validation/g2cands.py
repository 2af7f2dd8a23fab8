"""Candidates (logit shares started above the input, class-specific top blocks) for the second shapes goal (class-specific and covering) and the first (negative
perturbation). Validation seeds only (777, 778, ...; never 12345). Usage:

    python g2cands.py NAMES STEPS [N] [SEEDS]      # e.g. mr,lin_l1 16 200 777,778

Families (all from the float64 re-implementation in harness.py):
  lin_l{l}   DecompX-style shares of the target logit at the layer-l tokens (attention, norm divisors and the
             GELU slope theta = gelu(z)/z frozen at their actual values, biases apart; the logit is then
             linear in x^l and token j's share is <dy_lin/dx^l_j, x^l_j>), carried to the input tokens by
             measured_rollout's matrices of the layers below. lin_l0 = DecompX bias="separate"; l = L gives
             measured_rollout itself (all of the logit sits on the CLS row).
  gxi_l{l}   the same with the model's true gradient (attention and norms not frozen).
  *_roll     carried by rollout's 1/2(A + I) instead of the measured share.
  linh_l{l}  shares of h^l (after block l's attention), carried by its attention-only measured share.
  prod_X     positive part of X times measured_rollout's map (the class evidence weighted by coverage).
  sum_X      positive part of X plus measured_rollout's map, each scaled to max 1 (an ensemble).
  top{k}_P   measured_rollout with the top k blocks' pattern class-specific (P = gae, grad, kob; cands.py).
  oracle_X, budget_X   DIAGNOSTICS that read the ground-truth mask (not methods): the object first in X's
             order; X's order with at most the background patches IoU >= 0.70 allows in the top k.
  mr         measured_rollout (tr_block in cands.py); rollout.
"""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
import cands

I65 = torch.eye(65, dtype=torch.float64)


def lin_forward(px, target, frozen):
    """Logit of ``target`` with attention / norm divisors / GELU slope frozen at ``frozen`` (a layers list
    from harness.forward), or the true model if frozen is None; returns logit sum and the layer inputs."""
    p = SD
    with torch.enable_grad():
        t = Fn.conv2d(px.double(), p['vit.embeddings.patch_embeddings.projection.weight'],
                      p['vit.embeddings.patch_embeddings.projection.bias'], stride=8)
        B = t.shape[0]
        t = t.flatten(2).transpose(1, 2)
        x = torch.cat([p['vit.embeddings.cls_token'].expand(B, 1, D), t], 1) + p['vit.embeddings.position_embeddings']
        xs, hs = [], []
        for l in range(L):
            q = f'vit.layers.{l}.'
            x = x.detach().requires_grad_(True) if l == 0 else x
            x.retain_grad(); xs.append(x)
            fr = frozen[l] if frozen is not None else None
            def lnf(v, w, b, s_act):
                mu = v.mean(-1, keepdim=True)
                s = s_act if s_act is not None else (v.var(-1, unbiased=False, keepdim=True) + 1e-12).sqrt()
                return (v - mu) / s * w + b
            s1 = None
            if fr is not None:
                s1 = (fr['x'].var(-1, unbiased=False, keepdim=True) + 1e-12).sqrt()
            u = lnf(x, p[q+'layernorm_before.weight'], p[q+'layernorm_before.bias'], s1)
            V = (u @ p[q+'attention.v_proj.weight'].T + p[q+'attention.v_proj.bias']).view(B, -1, H, dh)
            F = torch.einsum('bnhe,dhe->bnhd', V, p[q+'attention.o_proj.weight'].view(D, H, dh))
            if fr is not None:
                alpha = fr['alpha']
            else:
                Q = (u @ p[q+'attention.q_proj.weight'].T + p[q+'attention.q_proj.bias']).view(B, -1, H, dh).transpose(1, 2)
                K = (u @ p[q+'attention.k_proj.weight'].T + p[q+'attention.k_proj.bias']).view(B, -1, H, dh).transpose(1, 2)
                alpha = torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(dh), -1)
            h = x + torch.einsum('bhij,bjhd->bid', alpha, F) + p[q+'attention.o_proj.bias']
            h.retain_grad(); hs.append(h)
            v2 = lnf(h, p[q+'layernorm_after.weight'], p[q+'layernorm_after.bias'], fr['s2'] if fr is not None else None)
            zeta = v2 @ p[q+'mlp.fc1.weight'].T + p[q+'mlp.fc1.bias']
            act = zeta * (Fn.gelu(fr['zeta']) / fr['zeta']) if fr is not None else Fn.gelu(zeta)
            x = h + act @ p[q+'mlp.fc2.weight'].T + p[q+'mlp.fc2.bias']
        sf = None
        if frozen is not None:
            sf = (x.detach().var(-1, unbiased=False, keepdim=True) + 1e-12).sqrt()
        mu = x.mean(-1, keepdim=True)
        s = sf if sf is not None else (x.var(-1, unbiased=False, keepdim=True) + 1e-12).sqrt()
        xf = (x - mu) / s * p['vit.layernorm.weight'] + p['vit.layernorm.bias']
        logits = xf[:, 0] @ p['classifier.weight'].T + p['classifier.bias']
        y = logits.gather(1, target[:, None]).sum()
        y.backward()
    return logits.detach(), [(v.grad * v.detach()).sum(-1) for v in xs] + [(v.grad * v.detach()).sum(-1) for v in hs]


def carry(share_l, Ms, l):
    """Input-token scores (B, 64): layer-l token shares (B, 65) pushed down through M_{l-1} ... M_0."""
    r = share_l
    for M in reversed(Ms[:l]):
        r = torch.einsum('bi,bij->bj', r, M)
    return r[:, 1:]


def budget_order(b, m):
    """Scores whose top k = |object| holds at most floor(0.1765 k) background patches, in b's order."""
    out = torch.empty_like(b)
    for i in range(b.shape[0]):
        k = int(m[i].sum()); allow = int(math.floor(k * (1 - 0.7) / 1.7 + 1e-9))
        order = torch.argsort(b[i], descending=True).tolist()
        bg = [j for j in order if m[i, j] == 0]; ob = [j for j in order if m[i, j] == 1]
        first = [j for j in order[:k] if m[i, j] == 0][:allow]
        top = sorted(first + ob[:k - len(first)], key=order.index)
        rest = [j for j in order if j not in top]
        for r, j in enumerate(top + rest):
            out[i, j] = 64 - r
    return out


def unit(s):
    """Scale each map to max |s| = 1 (ranking unchanged)."""
    return s / s.abs().amax(-1, keepdim=True).clamp(min=1e-30)


def candidates(x, layers, target, names, masks_t=None):
    Ms_mr = cands.per_layer(layers, 'tr_block')
    Ms_ro = cands.per_layer(layers, 'rollout')
    mr = roll(Ms_mr)
    need_lin = any('lin' in n for n in names)
    need_gxi = any('gxi' in n for n in names)
    out, cache = {}, {}
    if need_lin:
        lg, cache['lin'] = lin_forward(x, target, layers)
    if need_gxi:
        _, cache['gxi'] = lin_forward(x, target, None)
    def base(nm):
        if nm == 'mr':
            return mr
        if nm == 'rollout':
            return roll(Ms_ro)
        if nm.startswith('top'):  # measured_rollout below, the top layer's pattern made class-specific
            k = int(nm[3]); v = {'gae': 'tr_block_gae', 'grad': 'tr_block_grad', 'kob': 'tr_block_kob'}[nm.split('_')[1]]
            return roll(Ms_mr[:L - k] + cands.per_layer(layers[L - k:], v))
        fam, rest = nm.split('_', 1)
        l = int(rest[1]); Ms = Ms_ro if rest.endswith('_roll') else Ms_mr
        if fam.endswith('h'):  # shares of h^l (after layer l's attention), carried by its attention-only share
            Ma = cands.per_layer(layers[l:l + 1], 'tr_att')[0]
            return carry(cache[fam[:-1]][L + l], Ms[:l] + [Ma], l + 1)
        if l == L:
            return roll(Ms)
        return carry(cache[fam][l], Ms, l)
    for nm in names:
        if nm.startswith('prod_'):
            b = base(nm[5:])
            out[nm] = unit(b).clamp(min=0) * unit(mr)
        elif nm.startswith('sum_'):  # positive part of the class evidence plus coverage, each scaled to max 1
            b = base(nm[4:])
            out[nm] = unit(b).clamp(min=0) + unit(mr)
        elif nm.startswith('budget_'):  # DIAGNOSTIC ONLY (reads the mask): X's order, but at most as many
            # background patches in the top k (k = object size) as IoU >= 0.70 allows; the rest of the object next
            b = unit(base(nm[7:])); out[nm] = budget_order(b, masks_t)
        elif nm.startswith('oracle_'):  # DIAGNOSTIC ONLY (reads the mask): object first, each part ranked by X
            b = unit(base(nm[7:]))
            out[nm] = b + 3 * masks_t
        else:
            out[nm] = base(nm)
    return out


if __name__ == '__main__':
    names = sys.argv[1].split(',')
    steps = None if sys.argv[2] == 'full' else int(sys.argv[2])
    nimg = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    seeds = [int(s) for s in (sys.argv[4] if len(sys.argv) > 4 else '777').split(',')]
    allr = {}
    for seed in seeds:
        x, labels, masks = data(seed, nimg)
        layers, logits, target, sf, xf = forward(x)
        maps = candidates(x, layers, target, names, torch.as_tensor(np.asarray(masks), dtype=torch.float64).reshape(len(target), -1))
        for nm, s in maps.items():
            r = score(x, masks, target, s, steps=steps)
            allr.setdefault(nm, []).append(r)
            print(f"seed {seed} {nm:16s} " + "  ".join(f"{k} {v[0]:.4f}" for k, v in r.items()), flush=True)
            np.save(os.environ.get('VA_OUT', '/tmp') + f'/g2_{nm}_{seed}_{sys.argv[2]}.npy',
                    np.stack([v[2] for v in r.values()]))
    if len(seeds) > 1:
        for nm, rs in allr.items():
            pe = {k: np.concatenate([r[k][2] for r in rs]) for k in rs[0]}
            print(f"all  {nm:16s} " + "  ".join(f"{k} {np.nanmean(v):.4f}" for k, v in pe.items()), flush=True)
