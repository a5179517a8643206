"""Where a backward case's dq error comes from, for one seed (tests/gpu/test_bwd.py's inputs).
On the H200 from the repository root (PYTHONPATH=.):
    dq_error_anatomy.py B,SQ,SK,HQ,HKV VARIANT SEED[,SEED...]
Per seed: the kernel's, PyTorch's low-precision and float32 emulations' max dq error against
the float32 reference, and at the kernel's worst element the query row, how many keys it
sees and each term. The emulations follow the kernel's algorithm in float32 with one
rounding at a time (tests.reference.attention_bwd_from_out): D = rowsum(dO o O) from the
stored (16-bit) O or the exact one; dS (and P) rounded to the input dtype or not.
(Session 21's s21-call2-dq-anatomy.txt came from this script's first version, 56e3520,
which took P from the kernel's LSE instead of the exact softmax.)"""
import sys

import torch

sys.path.insert(0, ".")
from fa4_aot.variants import MATRIX  # noqa: E402
from tests.gpu import test_bwd as T  # noqa: E402
from tests.reference import attention_bwd_from_out, attention_ref  # noqa: E402

shape, name = tuple(int(x) for x in sys.argv[1].split(",")), sys.argv[2]
variant = next(v for v in MATRIX if v.name == name)
dtype = T.DTYPES[variant.dtype]


for seed in (int(s) for s in sys.argv[3].split(",")):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout, out, lse = T._case(shape, variant.head_dim, dtype, variant.causal, gen)
    dq, dk, dv = T._poisoned_grads(q, k, v)
    T.flash_attn_bwd(q, k, v, out, dout, lse, causal=variant.causal, deterministic=variant.deterministic,
                     q_tiles=variant.q_tiles, dq=dq, dk=dk, dv=dv,
                     workspace=T._poisoned_workspace(q, variant.causal, variant.deterministic))
    torch.cuda.synchronize()
    ref = T.reference_grads(q, k, v, dout, variant.causal, True)[0]
    low = T.reference_grads(q, k, v, dout, variant.causal, False)[0]
    o_exact = attention_ref(q.float(), k.float(), v.float(), causal=variant.causal)[0]
    emulated = lambda o, operands: attention_bwd_from_out(q, k, v, dout, o, variant.causal,  # noqa: E731
                                                          operands=operands)[0]
    rows = {
        "kernel": dq.float(),
        "torch low precision": low.float(),
        "emulated (O stored, dS rounded)": emulated(out, dtype),
        "emulated (O stored, dS fp32)": emulated(out, None),
        "emulated (O exact, dS rounded)": emulated(o_exact, dtype),
        "emulated (O exact, dS fp32)": emulated(o_exact, None),
    }
    err = (dq.float() - ref).abs()
    at = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
    tol = 2 * (low.float() - ref).abs().max().item() + 1e-5
    sk, sq = k.shape[1], q.shape[1]
    keys = min(sk, at[1] + sk - sq + 1) if variant.causal else sk
    print(f"seed {seed}: tolerance {tol:.3e}; worst kernel element (b, s, h, d) {at}: query row {at[1]} "
          f"sees {keys} keys; reference {ref[at].item():+.4e}")
    for label, g in rows.items():
        e = (g - ref).abs()
        print(f"  {label:34s} max err {e.max().item():.3e} (x{e.max().item() / tol:.2f} of tol)"
              f"  at the kernel's worst {e[at].item():.3e}  value {g[at].item():+.4e}")
