import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
from attnroll.core.value_aware import pairwise_norms, alti_matrix
gelu = Fn.gelu
I65 = torch.eye(65, dtype=torch.float64)

def mlp_share(z, d, l):
    """DecompX-linearised MLP share of shares z (B, n, m, d) of h (row stats of h)."""
    p = SD; q = f'vit.layers.{l}.'
    g = (z - z.mean(-1, keepdim=True)) / d['s2'][:, :, None] * p[q+'layernorm_after.weight']
    zeta = d['zeta']; theta = gelu(zeta) / zeta
    zs = g @ p[q+'mlp.fc1.weight'].T
    return (zs * theta[:, :, None]) @ p[q+'mlp.fc2.weight'].T

def head_mix_full(d, resid=True):
    z = torch.einsum('bhij,bjhd->bijd', d['alpha'], d['F'])
    if resid:
        z = z + torch.diag_embed(d['x'].transpose(1, 2)).permute(0, 2, 3, 1)
    return z

def per_layer(layers, name):
    Ms = []
    for d in layers:
        al, F, x = d['alpha'], d['F'], d['x']
        if name == 'rollout':
            M = 0.5 * al.mean(1) + 0.5 * I65
        elif name == 'kob_half':
            M = 0.5 * rownorm(pairwise_norms(al, F)) + 0.5 * I65
        elif name in ('headw_half', 'headw_layer_half'):
            o = torch.einsum('bhij,bjhd->bihd', al, F).norm(dim=-1)  # (B, n, H)
            if name == 'headw_layer_half':
                o = o.mean(1, keepdim=True).expand_as(o)
            w = o / o.sum(-1, keepdim=True)
            M = 0.5 * torch.einsum('bih,bhij->bij', w, al) + 0.5 * I65
        elif name == 'tok_resid':  # measured residual share per token, attention pattern mean_h alpha
            r = x.norm(dim=-1) / (x.norm(dim=-1) + (d['a'] - SD[f"vit.layers.{d['l']}.attention.o_proj.bias"]).norm(dim=-1))
            M = r[..., None] * I65 + (1 - r[..., None]) * al.mean(1)
        elif name == 'tok_resid_kob':
            r = x.norm(dim=-1) / (x.norm(dim=-1) + (d['a'] - SD[f"vit.layers.{d['l']}.attention.o_proj.bias"]).norm(dim=-1))
            M = r[..., None] * I65 + (1 - r[..., None]) * rownorm(pairwise_norms(al, F))
        elif name in ('block_norm', 'block_alti', 'block_kob_half'):
            out = []
            for b0 in range(0, x.shape[0], 20):
                sl = slice(b0, b0 + 20)
                dd = {k: (v[sl] if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
                z = head_mix_full(dd, resid=(name != 'block_kob_half'))
                T = z + mlp_share(z, dd, d['l'])
                if name == 'block_alti':
                    y = dd['out'][:, :, None]
                    C = (y.abs().sum(-1) - (y - T).abs().sum(-1)).clamp(min=0)
                else:
                    C = T.norm(dim=-1)
                out.append(C)
            C = rownorm(torch.cat(out))
            M = 0.5 * C + 0.5 * I65 if name == 'block_kob_half' else C
        elif name == 'gae':
            M = I65 + (d['g_alpha'] * al).clamp(min=0).mean(1)
        elif name == 'gae_headsum':  # I + (g_i . sum_h alpha f)^+
            M = I65 + torch.einsum('bid,bhij,bjhd->bij', d['g_h'], al, F).clamp(min=0)
        elif name == 'gradkob_half':
            M = 0.5 * I65 + 0.5 * rownorm(torch.einsum('bid,bhij,bjhd->bij', d['g_h'], al, F).clamp(min=0))
        elif name.startswith('tr_'):
            bo = SD[f"vit.layers.{d['l']}.attention.o_proj.bias"]
            av = d['a'] - bo
            if name.startswith('tr_proj'):  # orthogonal-projection shares of h - b_O
                hh = x + av
                rr = (x * hh).sum(-1) / (hh * hh).sum(-1)
                r = rr.clamp(0, 1)
            elif name.startswith('tr_alti'):
                both = torch.stack([x, av], 2)
                if name.startswith('tr_altiblock'):
                    T = both + mlp_share(both, d, d['l']); y = d['out']
                else:
                    T = both; y = d['h']
                y = y[:, :, None]
                c = (y.abs().sum(-1) - (y - T).abs().sum(-1)).clamp(min=0)
                cs = c.sum(-1); r = torch.where(cs > 0, c[..., 0] / torch.where(cs > 0, cs, torch.ones_like(cs)), torch.ones_like(cs))
            elif name.startswith('tr_block'):
                both = torch.stack([x, av], 2)  # (B, n, 2, d) shares of h (b_O apart)
                ms = mlp_share(both, d, d['l'])
                T = both + ms
                nx, na = T[:, :, 0].norm(dim=-1), T[:, :, 1].norm(dim=-1)
                r = nx / (nx + na)
            else:
                r = x.norm(dim=-1) / (x.norm(dim=-1) + av.norm(dim=-1))
            if name.endswith('_headwl'):
                o = torch.einsum('bhij,bjhd->bihd', al, F).norm(dim=-1).mean(1, keepdim=True)
                P = torch.einsum('bih,bhij->bij', (o / o.sum(-1, keepdim=True)).expand(-1, al.shape[-1], -1), al)
            elif name.endswith('_kob'):
                P = rownorm(pairwise_norms(al, F))
            elif name.endswith('_headw'):
                o = torch.einsum('bhij,bjhd->bihd', al, F).norm(dim=-1)
                P = torch.einsum('bih,bhij->bij', o / o.sum(-1, keepdim=True), al)
            elif name.endswith('_grad'):
                P = rownorm(torch.einsum('bid,bhij,bjhd->bij', d['g_h'], al, F).clamp(min=0))
            elif name.endswith('_gae'):
                P = rownorm((d['g_alpha'] * al).clamp(min=0).mean(1))
            else:
                P = al.mean(1)
            M = r[..., None] * I65 + (1 - r[..., None]) * P
            if d['l'] == 0 and x.shape[0] > 0:
                print(name, 'r mean per layer0', r.mean().item(), end='; ')
        else:
            raise KeyError(name)
        Ms.append(M)
    return Ms

if __name__ == '__main__':
    names = sys.argv[1].split(',')
    steps = None if sys.argv[2] == 'full' else int(sys.argv[2])
    nimg = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    x, labels, masks = data(777, nimg)
    t0 = time.time()
    layers, logits, target, sf, xf = forward(x)
    # identity check: dy/dalpha = <g_h, F>
    d = layers[2]
    print('grad identity', (d['g_alpha'] - torch.einsum('bid,bjhd->bhij', d['g_h'], d['F'])).abs().max().item(), flush=True)
    for nm in names:
        s = roll(per_layer(layers, nm))
        t1 = time.time()
        r = score(x, masks, target, s, steps=steps)
        print(f"{nm:18s} " + "  ".join(f"{k} {v[0]:.4f}±{v[1]:.4f}" for k, v in r.items()), f"({time.time()-t1:.0f}s)", flush=True)
        np.save(os.environ.get('VA_OUT', '/tmp') + f'/pe_{nm}_{sys.argv[2]}.npy', np.stack([v[2] for v in r.values()]))
