"""192/128 backward: the d192v128 kernels' gradients against the d192 kernels' (v padded
to 192 columns of zeros, which takes the d192 kernels) at growing sequence lengths.

    python benchmarks/experiments/pair_dq_check.py [NAME=KERNELS ...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, ".")
import fa4_aot  # noqa: E402
from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd  # noqa: E402

libs = {"pkg": fa4_aot.KernelLibrary()}
for arg in sys.argv[1:]:
    n, d = arg.split("=", 1)
    libs[n] = fa4_aot.KernelLibrary(Path(d))
for b, s, h, causal, det in [(1, 4096, 2, False, False), (1, 8192, 2, False, False), (1, 12288, 2, False, False),
                             (1, 16384, 2, False, False), (1, 16384, 2, True, False), (1, 16384, 2, False, True),
                             (2, 8192, 2, False, False), (1, 16384, 16, False, False)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, h, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    fa4_aot.set_default_library(libs["pkg"])
    v192 = torch.cat([v, torch.zeros_like(v[..., :64])], -1)
    d192 = torch.cat([dout, torch.zeros_like(dout[..., :64])], -1)
    o192, lse = flash_attn_fwd(q, k, v192, causal=causal)
    ref = flash_attn_bwd(q, k, v192, o192, d192, lse, causal=causal, deterministic=det)
    out = o192[..., :128].contiguous()
    line = f"b{b} s{s} h{h} c{int(causal)} det{int(det)}:"
    for n, lib in libs.items():
        fa4_aot.set_default_library(lib)
        o, l2 = flash_attn_fwd(q, k, v, causal=causal)
        grads = flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=det)
        torch.cuda.synchronize()
        errs = [((a.float() - r[..., :a.shape[-1]].float()).abs().max() / r.float().abs().max()).item()
                for a, r in zip(grads, ref)]
        line += f" {n}: out {(o.float() - out.float()).abs().max().item():.1e} dq/dk/dv " + " ".join(
            f"{e:.1e}" for e in errs)
    print(line, flush=True)
