"""One backward test case (tests/gpu/test_bwd.py's check) over many seeds, per build folder:
how many seeds fail the tolerance rule, which, and the largest err/tol ratio of dq, dk, dv.
On the H200 from the repository root (PYTHONPATH=.):
    tolerance_seeds.py FOLDER[,FOLDER...] B,SQ,SK,HQ,HKV VARIANT EXTRA_SEEDS N
e.g. tolerance_seeds.py fa4_aot,build/old 3,17,17,2,1 bwd.sm90a.fp16.d64.causal 950291885 300
(the listed seeds, then seeds 0..N-1)."""
import sys
from pathlib import Path
import torch
sys.path.insert(0, ".")
import fa4_aot.api as api
from fa4_aot.loader import KernelLibrary
from fa4_aot.variants import MATRIX
from tests.gpu import test_bwd as T

folders, shape, name = sys.argv[1].split(","), tuple(int(x) for x in sys.argv[2].split(",")), sys.argv[3]
seeds = [int(s) for s in sys.argv[4].split(",")] + list(range(int(sys.argv[5])))
variant = next(v for v in MATRIX if v.name == name)
for folder in folders:
    api._default_library = KernelLibrary(Path(folder))
    worst = [0.0, 0.0, 0.0]; fails = 0; first = []
    for seed in seeds:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v, dout, out, lse = T._case(shape, variant.head_dim, T.DTYPES[variant.dtype], variant.causal, gen)
        dq, dk, dv = T._poisoned_grads(q, k, v)
        T.flash_attn_bwd(dout, q, k, v, out, lse, causal=variant.causal, deterministic=variant.deterministic,
                         q_tiles=variant.q_tiles, dq=dq, dk=dk, dv=dv,
                         workspace=T._poisoned_workspace(q, variant.causal, variant.deterministic))
        torch.cuda.synchronize()
        ref = T.reference_grads(q, k, v, dout, variant.causal, True)
        low = T.reference_grads(q, k, v, dout, variant.causal, False)
        bad = False
        for i, (g, r, lo) in enumerate(zip((dq, dk, dv), ref, low)):
            err = (g.float() - r).abs().max().item(); tol = 2 * (lo.float() - r).abs().max().item() + 1e-5
            worst[i] = max(worst[i], err / tol); bad |= err > tol or g.isnan().any().item()
        if bad:
            fails += 1; first.append(seed)
    print(folder, name, shape, f"{fails}/{len(seeds)} failed {first[:5]}", "worst err/tol dq %.2f dk %.2f dv %.2f" % tuple(worst))
