#!/usr/bin/env python3
"""GPU time of each kernel of one forward and one backward call, by CUDA events recorded
around every launch (the loader's driver call is wrapped for the measurement).

Run on an sm_90 GPU:  python benchmarks/kernel_times.py [--head-dim 128] [--seqlen 1024 16384] [--causal]
Same shapes as bench_attention.py (16384 tokens, heads * head_dim = 2048, bf16). Prints the
median microseconds of each kernel over the timed calls, and the bytes the backward's
pre/postprocess must move, as an effective bandwidth.
"""

import argparse
import statistics
from pathlib import Path

import torch

import fa4_aot

import fa4_aot.launch.loader as loader
from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd

_events = []
_real_call = loader.call


def _timed_call(fn, *args):
    if fn is not loader.cu.cuLaunchKernelEx:
        return _real_call(fn, *args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = _real_call(fn, *args)
    end.record()
    _events.append((start, end))
    return result


def per_kernel(run, calls):
    """Median time in us of each launch position of ``run``."""
    loader.call = _timed_call
    try:
        samples = []
        for _ in range(calls):
            _events.clear()
            run()
            torch.cuda.synchronize()
            samples.append([s.elapsed_time(e) * 1e3 for s, e in _events])
    finally:
        loader.call = _real_call
    return [statistics.median(col) for col in zip(*samples)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--deterministic", action="store_true", help="the deterministic backward")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--kernels", type=Path, help="time the cubins of this build folder (default: the package's)")
    args = p.parse_args()
    if args.kernels:
        from fa4_aot.launch.loader import KernelLibrary

        fa4_aot.set_default_library(KernelLibrary(args.kernels))
    d = args.head_dim
    for s in args.seqlen:
        b, h = 16384 // s, 2048 // d
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = flash_attn_fwd(q, k, v, causal=args.causal)
        grads = [torch.empty_like(x) for x in (q, k, v)]
        fwd = lambda: flash_attn_fwd(q, k, v, causal=args.causal, out=out, lse=lse)  # noqa: E731
        bwd = lambda: flash_attn_bwd(q, k, v, out, dout, lse, causal=args.causal,  # noqa: E731
                                     deterministic=args.deterministic, dq=grads[0], dk=grads[1], dv=grads[2])
        for _ in range(3):
            fwd()
            bwd()
        (t_fwd,) = per_kernel(fwd, args.calls)
        t_pre, t_main, t_post = per_kernel(bwd, args.calls)
        tokens = b * s * h * d
        pre_bytes, post_bytes = tokens * (2 + 2 + 4), tokens * (4 + 2)
        print(f"d{d} seqlen {s} (batch {b}, heads {h}, causal={args.causal}), median us: "
              f"fwd {t_fwd:.1f} | bwd pre {t_pre:.1f} ({pre_bytes / t_pre / 1e6:.2f} TB/s), "
              f"main {t_main:.1f}, post {t_post:.1f} ({post_bytes / t_post / 1e6:.2f} TB/s); "
              f"pre+post {100 * (t_pre + t_post) / (t_pre + t_main + t_post):.0f}% of the backward")


if __name__ == "__main__":
    main()
