#!/usr/bin/env python3
"""Host time of one fa4_aot launch from Python, against the GPU time of its kernels.

When the host takes longer to issue a call than the GPU takes to run it, a benchmark of
back-to-back calls measures the host, not the kernels: small problems (1k tokens causal,
a 0.2 ms forward) are where that starts to show. This times N calls of a tiny problem
(the kernels take microseconds, so the queue never backs up the host), host clock only.

Run on an sm_90 GPU:  python benchmarks/launch_overhead.py [--calls 2000]
"""

import argparse
import time

import torch

from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd


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
    args = p.parse_args()
    q, k, v, dout = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = flash_attn_fwd(q, k, v)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    fwd = host_us(lambda: flash_attn_fwd(q, k, v, out=out, lse=lse), args.calls)
    bwd = host_us(lambda: flash_attn_bwd(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2]), args.calls)
    empty = host_us(lambda: torch.empty(1, device="cuda"), args.calls)
    print(f"host time per call, us: forward {fwd:.1f} | backward (3 kernels, workspace from torch) {bwd:.1f} | "
          f"torch.empty for scale {empty:.1f}")
    if args.profile:
        import cProfile
        import pstats

        for name, fn in (("forward", lambda: flash_attn_fwd(q, k, v, out=out, lse=lse)),
                         ("backward", lambda: flash_attn_bwd(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1],
                                                             dv=grads[2]))):
            profile = cProfile.Profile()
            profile.runcall(host_us, fn, args.calls)
            print(f"--- {name}: cumulative host time over {args.calls} calls")
            pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
