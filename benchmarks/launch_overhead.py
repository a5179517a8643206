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

from fa4_aot.torch import flash_attn_bwd, flash_attn_func, flash_attn_fwd


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
