#!/usr/bin/env python3
"""torch's context parallelism (ring attention over NCCL) on fa4_aot's kernels (issue 41).

    torchrun --nproc-per-node 2 examples/context_parallel.py [--seqlen 131072] [--causal] [--steps 5]

NOT YET RUN: written against torch's context_parallel (2.11-2.13) while no machine with two
GPUs was lent; the one-GPU test of the same arithmetic on our kernels passes
(tests/gpu/test_ring.py). Treat its first run as its test.

What it does on each rank: the whole q, k, v (batch 1, 16 heads, head_dim 128, bf16, the
same seed everywhere), attention forward and backward unsharded on this GPU as the
reference; then the same inside ``context_parallel`` (the sequence sharded over the ranks,
load-balanced when causal, K/V passed round the ring, SDPA's flash op per block, merged by
LSE) with the fa4_aot implementation active; out, dq, dk, dv gathered back
(``context_parallel_unshard``) and compared with the reference; then the time per
context-parallel step, fa4_aot against torch's own flash kernel in the same run. Nothing
distributed is fa4_aot's: torch's engine calls ``aten._scaled_dot_product_flash_attention``
and its backward per block, which ``fa4_aot.torch_sdpa`` serves.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4_aot.torch_sdpa as hook


def step(q, k, v, dout, causal):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return out


def context_parallel_step(mesh, q, k, v, dout, causal):
    """One forward + backward with the sequence sharded over ``mesh``: out and the
    gradients, gathered whole."""
    cp = [t.detach().clone() for t in (q, k, v, dout)]
    with context_parallel(mesh, buffers=cp, buffer_seq_dims=[2, 2, 2, 2]):
        for t in cp[:3]:
            t.requires_grad_(True)
        out = step(*cp, causal)
        grads = [t.grad for t in cp[:3]]
        for t in cp[:3]:
            t.requires_grad_(False)
    return context_parallel_unshard(mesh, [out.detach(), *grads], [2, 2, 2, 2])


def timed(mesh, q, k, v, dout, causal, steps):
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        context_parallel_step(mesh, q, k, v, dout, causal)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    _cp_options.enable_load_balance = args.causal  # load balancing is for causal only

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, args.heads, args.seqlen, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))

    hook.activate()
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref_inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            ref_out = step(*ref_inputs, dout, args.causal)
            ref = [ref_out.detach(), *(t.grad for t in ref_inputs)]
            got = context_parallel_step(mesh, q, k, v, dout, args.causal)
            for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
                err = (g.float() - r.float()).abs().max().item()
                scale = r.float().abs().max().item()
                if rank == 0:
                    print(f"{name}: max |context parallel - unsharded| {err:.3e} (max |unsharded| {scale:.3e})")
            ours = timed(mesh, q, k, v, dout, args.causal, args.steps)
    finally:
        hook.restore()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        theirs = timed(mesh, q, k, v, dout, args.causal, args.steps)
    if rank == 0:
        print(f"{world} ranks, {args.seqlen} tokens, {'causal' if args.causal else 'not causal'}: "
              f"fa4_aot {ours * 1e3:.1f} ms a step, torch's flash {theirs * 1e3:.1f} ms ({theirs / ours:.2f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
