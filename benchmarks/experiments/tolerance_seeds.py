"""Backward test cases (tests/gpu/test_bwd.py's check) over many seeds, per build folder:
how many seeds fail each tolerance rule, which, and the largest err/tol ratio of dq, dk, dv.
Rules: "low": twice PyTorch's low-precision autograd error (tests before session 21);
"test": the tests' rule (check_grads: twice the larger of that and the error of the flash
recipe from the given output with 16-bit GEMM operands, its gradients rounded).
On the H200 from the repository root (PYTHONPATH=.):
    tolerance_seeds.py FOLDER[,FOLDER...] B,SQ,SK,HQ,HKV[;...] VARIANT[,VARIANT...] EXTRA_SEEDS N
e.g. tolerance_seeds.py fa4_aot "3,17,17,2,1;2,81,80,2,1" bwd.sm90a.fp16.d64.causal 950291885 300
(the listed seeds, then seeds 0..N-1)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, ".")
import fa4_aot
from fa4_aot.launch.loader import KernelLibrary  # noqa: E402
from fa4_aot.variants import MATRIX  # noqa: E402
from tests.gpu import test_bwd as T  # noqa: E402

folders = sys.argv[1].split(",")
shapes = [tuple(int(x) for x in s.split(",")) for s in sys.argv[2].split(";")]
names = sys.argv[3].split(",")
seeds = [int(s) for s in sys.argv[4].split(",")] + list(range(int(sys.argv[5])))
RULES = ("low", "test")
for folder in folders:
    fa4_aot.set_default_library(KernelLibrary(Path(folder)))
    for name in names:
        variant = next(v for v in MATRIX if v.name == name)
        dtype = T.DTYPES[variant.dtype]
        for shape in shapes:
            worst = {r: [0.0, 0.0, 0.0] for r in RULES}
            failed = {r: [] for r in RULES}
            for seed in seeds:
                gen = torch.Generator(device="cuda").manual_seed(seed)
                q, k, v, dout, out, lse = T._case(shape, variant.head_dim, dtype, variant.causal, gen)
                dq, dk, dv = T._poisoned_grads(q, k, v)
                T.flash_attn_bwd(q, k, v, out, dout, lse, causal=variant.causal,
                                 deterministic=variant.deterministic, q_tiles=variant.q_tiles, dq=dq, dk=dk, dv=dv,
                                 workspace=T._poisoned_workspace(q, variant.causal, variant.deterministic))
                torch.cuda.synchronize()
                ref, errors = T.reference_errors(q, k, v, dout, out, variant.causal)
                bad = {r: False for r in RULES}
                for i, (g, r, (e_low, e_recipe)) in enumerate(zip((dq, dk, dv), ref, errors)):
                    err = (g.float() - r).abs().max().item()
                    for rule, scale in (("low", e_low), ("test", max(e_low, e_recipe))):
                        tol = 2 * scale + 1e-5
                        worst[rule][i] = max(worst[rule][i], err / tol)
                        bad[rule] |= err > tol or g.isnan().any().item()
                for rule in RULES:
                    if bad[rule]:
                        failed[rule].append(seed)
            for rule in RULES:
                print(folder, name, shape, f"rule {rule}: {len(failed[rule])}/{len(seeds)} failed {failed[rule][:5]}",
                      "worst err/tol dq %.2f dk %.2f dv %.2f" % tuple(worst[rule]), flush=True)
