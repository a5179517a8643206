"""Save backward cases (tests/gpu/test_bwd.py inputs per seed) and the kernel's gradients, to
study their errors off the GPU (tolerance_from_dumps.py). On the H200 from the repository
root: dump_bwd_case.py OUTFILE B,SQ,SK,HQ,HKV VARIANT SEED[,SEED...] (appends to OUTFILE)."""
import sys
import torch
sys.path.insert(0, ".")
from fa4_aot.variants import MATRIX
from tests.gpu import test_bwd as T
shape, name = tuple(int(x) for x in sys.argv[2].split(",")), sys.argv[3]
variant = next(v for v in MATRIX if v.name == name)
cases = {}
for seed in (int(s) for s in sys.argv[4].split(",")):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout, out, lse = T._case(shape, variant.head_dim, T.DTYPES[variant.dtype], variant.causal, gen)
    dq, dk, dv = T._poisoned_grads(q, k, v)
    T.flash_attn_bwd(q, k, v, out, dout, lse, causal=variant.causal, deterministic=variant.deterministic,
                     q_tiles=variant.q_tiles, dq=dq, dk=dk, dv=dv,
                     workspace=T._poisoned_workspace(q, variant.causal, variant.deterministic))
    torch.cuda.synchronize()
    cases[seed] = {n: t.cpu() for n, t in dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}
try:
    old = torch.load(sys.argv[1])
except FileNotFoundError:
    old = {}
old[name + "@" + sys.argv[2]] = cases
torch.save(old, sys.argv[1])
