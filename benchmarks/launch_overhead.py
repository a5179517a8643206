#!/usr/bin/env python3
"""Host time of one fa4_aot launch from Python, against the GPU time of its kernels.

When the host takes longer to issue a call than the GPU takes to run it, a benchmark of
back-to-back calls measures the host, not the kernels: small problems (1k tokens causal,
a 0.2 ms forward) are where that starts to show. This times N calls of a tiny problem
(the kernels take microseconds, so the queue never backs up the host), host clock only.

It also times the first call in fresh processes (``--fresh N``, default 5): in a torch
process whose CUDA context is up, ``import fa4_aot.torch`` and the first
``flash_attn_fwd`` (manifest, one cubin loaded, its launch, a synchronize), or the first
``flash_attn_func`` (its eager autograd path: the custom ops wait for a torch.compile trace); and in a
cuda-python process with its context and arrays made, ``import fa4_aot`` and the first
``fa4_aot.forward``. cuda-python's own import (``cuda.bindings.driver``, which fa4_aot
needs and a torch process has not made) is timed apart from fa4_aot's. Those processes may cache bytecode (PYTHONDONTWRITEBYTECODE is
cleared for them, the cache in a temporary folder, warmed by one unreported run), as an
installed wheel has it.

Run on an sm_90 GPU:  PYTHONPATH=$PWD python benchmarks/launch_overhead.py [--calls 2000] [--fresh 5]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fa4_aot.torch import flash_attn_bwd, flash_attn_func, flash_attn_fwd

# A fresh torch process: the context up and the inputs made before the clock starts.
FIRST_TORCH = r"""
import time, torch
q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
start = time.perf_counter()
from cuda.bindings import driver
bound = time.perf_counter()
import fa4_aot.torch
imported = time.perf_counter()
fa4_aot.torch.FUNCTION(q, k, v)
torch.cuda.synchronize()
done = time.perf_counter()
print((bound - start) * 1e3, (imported - bound) * 1e3, (done - imported) * 1e3)
"""
# A fresh cuda-python process: its context and device arrays made before the clock starts.
FIRST_RAW = r"""
import time
begin = time.perf_counter()
from cuda.bindings import driver as cu
bound = time.perf_counter()
cu.cuInit(0)
_, ctx = cu.cuDevicePrimaryCtxRetain(0)
cu.cuCtxSetCurrent(ctx)
b, s, h, d = 1, 128, 2, 64
ptrs = [int(cu.cuMemAlloc(b * s * h * d * 2)[1]) for _ in range(4)] + [int(cu.cuMemAlloc(b * h * s * 4)[1])]
cu.cuCtxSynchronize()
start = time.perf_counter()
import fa4_aot
imported = time.perf_counter()
bshd = (s * h * d, h * d, d, 1)
q, k, v, out = (fa4_aot.DeviceArray(p, (b, s, h, d), bshd, "bf16", 0) for p in ptrs[:4])
lse = fa4_aot.DeviceArray(ptrs[4], (b, h, s), (h * s, s, 1), "fp32", 0)
fa4_aot.forward(q, k, v, out, lse, stream=0)
cu.cuCtxSynchronize()
done = time.perf_counter()
print((bound - begin) * 1e3, (imported - start) * 1e3, (done - imported) * 1e3)
"""


def first_call(code: str, runs: int) -> list[tuple[float, float, float]]:
    """(cuda-python's import, fa4_aot's import, the first call), ms, in each of ``runs``
    fresh processes, after one warm-up."""
    env = {k: x for k, x in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as cache:
        env["PYTHONPYCACHEPREFIX"] = cache
        times = []
        for _ in range(runs + 1):
            out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(out.stdout + out.stderr)
            times.append(tuple(float(x) for x in out.stdout.split()[-3:]))
    return times[1:]


def print_first_calls(runs: int) -> None:
    for name, code in (("torch process: import fa4_aot.torch + first flash_attn_fwd",
                        FIRST_TORCH.replace("FUNCTION", "flash_attn_fwd")),
                       ("torch process: import fa4_aot.torch + first flash_attn_func",
                        FIRST_TORCH.replace("FUNCTION", "flash_attn_func")),
                       ("cuda-python process: import fa4_aot + first fa4_aot.forward", FIRST_RAW)):
        times = first_call(code, runs)
        parts = {"cuda-python import": [t[0] for t in times], "fa4_aot import": [t[1] for t in times],
                 "first call": [t[2] for t in times], "ours (import + call)": [t[1] + t[2] for t in times],
                 "total": [sum(t) for t in times]}
        print(f"{name}, ms (median [range] of {runs} fresh processes): " + " | ".join(
            f"{part} {statistics.median(x):.1f} [{min(x):.1f}-{max(x):.1f}]" for part, x in parts.items()))


def host_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print the N functions with the most cumulative host time (cProfile)")
    p.add_argument("--fresh", type=int, default=5, metavar="N",
                   help="fresh processes for the first call's figures (0: skip them)")
    args = p.parse_args()
    if args.fresh:
        print_first_calls(args.fresh)
    q, k, v, dout = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = flash_attn_fwd(q, k, v)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    fwd = host_us(lambda: flash_attn_fwd(q, k, v, out=out, lse=lse), args.calls)
    bwd = host_us(lambda: flash_attn_bwd(q, k, v, out, dout, lse, dq=grads[0], dk=grads[1], dv=grads[2]), args.calls)
    empty = host_us(lambda: torch.empty(1, device="cuda"), args.calls)
    print(f"host time per call, us: forward {fwd:.1f} | backward (3 kernels, workspace from torch) {bwd:.1f} | "
          f"torch.empty for scale {empty:.1f}")
    # the raw API with its DeviceArrays made once (a framework-free caller's steady state)
    import fa4_aot
    from fa4_aot.torch import as_device_array

    raw = [as_device_array(t) for t in (q, k, v, out, lse)]
    stream = torch.cuda.current_stream().cuda_stream
    raw_fwd = host_us(lambda: fa4_aot.forward(*raw, stream=stream), args.calls)
    print(f"raw fa4_aot.forward (DeviceArrays kept), us: {raw_fwd:.1f}")
    # the autograd entry point: torch's custom-op dispatch and the allocations of out/lse
    # (and, with grad, the saved tensors and the backward's dq, dk, dv, workspace)
    q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))

    def step():
        flash_attn_func(q_, k_, v_).backward(dout)

    op_fwd = host_us(lambda: flash_attn_func(q, k, v), args.calls)
    op_step = host_us(step, max(args.calls // 4, 50))
    print(f"flash_attn_func (custom op), us: forward without grad {op_fwd:.1f} | forward + backward {op_step:.1f}")
    # the same through torch SDPA's cuDNN backend ((b, h, s, d) layout), for scale
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dout_t = dout.transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref_fwd = host_us(lambda: sdpa(qt.detach(), kt.detach(), vt.detach()), args.calls)
        ref_step = host_us(lambda: sdpa(qt, kt, vt).backward(dout_t), max(args.calls // 4, 50))
    print(f"torch SDPA (cuDNN), us: forward without grad {ref_fwd:.1f} | forward + backward {ref_step:.1f}")
    if args.profile:
        import cProfile
        import pstats

        for name, fn in (("forward", lambda: flash_attn_fwd(q, k, v, out=out, lse=lse)),
                         ("backward", lambda: flash_attn_bwd(q, k, v, out, dout, lse, dq=grads[0], dk=grads[1],
                                                             dv=grads[2]))):
            profile = cProfile.Profile()
            profile.runcall(host_us, fn, args.calls)
            print(f"--- {name}: cumulative host time over {args.calls} calls")
            pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
