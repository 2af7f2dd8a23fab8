"""`measured_rollout`'s `class_blocks=k` against g2cands.py's `top{k}_gae` candidate (the float64
harness) on validation images (seed 777, never 12345). Usage: python check_class_blocks.py [N] [K,...]"""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *
import g2cands
import copy
import attnroll

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
ks = [int(k) for k in (sys.argv[2] if len(sys.argv) > 2 else '1,2').split(',')]
x, labels, masks = data(777, n)
layers, logits, target, sf, xf = forward(x)
m64 = copy.deepcopy(MODEL).double().eval()
for k in ks:
    ref = g2cands.candidates(x, layers, target, [f'top{k}_gae'])[f'top{k}_gae']
    with torch.enable_grad():
        lib = attnroll.explain(m64, x.double(), 'measured_rollout', class_blocks=k).scores
        lib32 = attnroll.explain(MODEL, x, 'measured_rollout', class_blocks=k).scores.double()
    rel = lambda a: ((a - ref).abs().max() / ref.abs().max()).item()
    print(f'class_blocks={k}: max |library - harness| / max |harness| = {rel(lib):.2e} (float64 model), '
          f'{rel(lib32):.2e} (the float32 model)')
