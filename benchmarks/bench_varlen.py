#!/usr/bin/env python3
"""Varlen forward (and, with --bwd, backward) benchmark: packed sequences of mixed lengths, head_dim 128 bf16.

Run on an sm_90 GPU:  python benchmarks/bench_varlen.py [--rounds 3] [--out results/]
    [--kernels DIR ...]   # A/B: each build's varlen forward beside the package's, interleaved
    [--order plain,lpt]   # the sequence order(s), forward or --bwd: each a cell, in the same rounds
    [--mixes NAME,...]    # only these mixes (substrings of their names)

Peers in the same process, on the same inputs: torch's ``varlen_attn`` (FlashAttention
through torch; GQA only where the installed torch takes ``enable_gqa``), and our dense
forward on the batch padded to the longest sequence (its FLOPs counted as the varlen
problem's: the padding is wasted work, which is the point of varlen). FA4 upstream's
varlen kernels are not timed here (benchmarks/fa4_upstream compiles its dense ones).

Mixes (issue 28): one 16384-token sequence plus 63 of 256; 16 sequences of uniform random
length in 1..8191 (seed 0); a serving-like mix of 256 short prompts (16..1024 tokens,
seed 1) with GQA 32:8; and for the heaviest-first order (--order), the long sequence LAST
(63 of 256 then one of 16384), with 16 heads and with 4 (fewer heads: fewer CTAs per
sequence, so a late long sequence leaves more of the last wave idle). Heads: 16 (2048 /
128) unless the mix says. FLOPs per sequence:
4 * s_q * s_k * d * heads for the rows x keys pairs computed; causal counts only the
visible pairs (bottom-right aligned). Time: median of CUDA-event timings
(triton.testing.do_bench, warmup 50 ms, rep 200 ms); --rounds N interleaves the peers
round by round and reports each cell's median and range.
"""

import argparse
import json
import random
import statistics
from pathlib import Path

import torch
import triton.testing

from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd, flash_attn_varlen_bwd, flash_attn_varlen_fwd

D = 128


def mixes():
    rng = random.Random(0)
    serving = random.Random(1)
    return {
        "1x16384+63x256": ([16384] + [256] * 63, 16, 16),
        "16xU(1,8191)": ([rng.randint(1, 8191) for _ in range(16)], 16, 16),
        "256 prompts GQA 32:8": ([serving.randint(16, 1024) for _ in range(256)], 32, 8),
        "63x256+1x16384 (long last)": ([256] * 63 + [16384], 16, 16),
        "63x256+1x16384 (long last) h4": ([256] * 63 + [16384], 4, 4),
    }


def flops(lengths, heads, causal):
    total = 0
    for s in lengths:
        pairs = s * (s + 1) // 2 if causal else s * s
        total += 4 * pairs * D * heads
    return total


def tflops(fn, work):
    ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
    return work / ms / 1e9


def cells(lengths, hq, hkv, causal, libraries=(), orders=(None,)):
    """{peer: callable} on one set of inputs; ``libraries``: (name, KernelLibrary) of other
    builds whose varlen forward runs beside the package's; ``orders``: the forward's
    sequence orders to time ("plain", "lpt"; None: the policy's), one cell each."""
    total, longest = sum(lengths), max(lengths)
    q = torch.randn(total, hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    out, lse = torch.empty_like(q), torch.empty(hq, total, device="cuda")
    import fa4_aot

    space = torch.empty(fa4_aot.forward_varlen_workspace_bytes(len(lengths)), dtype=torch.uint8, device="cuda")
    peers = {}
    for order in orders:
        peers["fa4_aot varlen" + (f" {order}" if order else "")] = (
            lambda order=order: flash_attn_varlen_fwd(q, k, v, cu, cu, longest, longest, causal=causal, out=out,
                                                      lse=lse, order=order, workspace=space))
    for name, library in libraries:
        arrays = [fa4_aot.torch.varlen._array(x) for x in (q, k, v, out, lse, cu, cu)]
        stream = torch.cuda.current_stream().cuda_stream
        peers[f"fa4_aot varlen {name}"] = (lambda lib=library: fa4_aot.forward_varlen(
            *arrays, longest, longest, causal=causal, stream=stream, library=lib))
    b = len(lengths)
    qp = torch.zeros(b, longest, hq, D, device="cuda", dtype=torch.bfloat16)
    kp, vp = (torch.zeros(b, longest, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for i, (start, s) in enumerate(zip(cu.tolist(), lengths)):
        qp[i, :s], kp[i, :s], vp[i, :s] = q[start:start + s], k[start:start + s], v[start:start + s]
    peers["fa4_aot dense, padded"] = lambda: flash_attn_fwd(qp, kp, vp, causal=causal)
    try:
        from torch.nn.attention.varlen import varlen_attn

        gqa = {"enable_gqa": True} if hq != hkv else {}
        window = {"window_size": (-1, 0)} if causal else {}
        varlen_attn(q, k, v, cu, cu, longest, longest, **gqa, **window)
        peers["torch varlen_attn"] = lambda: varlen_attn(q, k, v, cu, cu, longest, longest, **gqa, **window)
    except Exception as e:  # this torch's varlen_attn lacks the mix's GQA or causal options
        print(f"  torch varlen_attn skipped: {type(e).__name__}: {str(e)[:80]}")
    return peers


def cells_bwd(lengths, hq, hkv, causal, orders=(None,)):
    """{peer: callable} of the backward on one set of inputs (outputs and the workspace
    given, so the timings are the kernels'): ours varlen (one cell per sequence order, as
    ``cells``; the workspace has room for the heaviest-first one), ours dense on the padded
    batch, torch's varlen_attn backward (autograd.grad of a kept forward)."""
    total, longest = sum(lengths), max(lengths)
    q = torch.randn(total, hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    out, lse = flash_attn_varlen_fwd(q, k, v, cu, cu, longest, longest, causal=causal)
    dout = torch.randn_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    import fa4_aot

    size = fa4_aot.backward_varlen_workspace_bytes(total, len(lengths), hq, D, causal=causal)
    space = torch.empty(size, dtype=torch.uint8, device="cuda")
    peers = {}
    for order in orders:
        peers["fa4_aot varlen" + (f" {order}" if order else "")] = (
            lambda order=order: flash_attn_varlen_bwd(q, k, v, out, dout, lse, cu, cu, longest, longest, causal=causal,
                                                      dq=dq, dk=dk, dv=dv, workspace=space, order=order))
    b = len(lengths)
    qp = torch.zeros(b, longest, hq, D, device="cuda", dtype=torch.bfloat16)
    kp, vp = (torch.zeros(b, longest, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for i, (start, n) in enumerate(zip(cu.tolist(), lengths)):
        qp[i, :n], kp[i, :n], vp[i, :n] = q[start:start + n], k[start:start + n], v[start:start + n]
    op, lp = flash_attn_fwd(qp, kp, vp, causal=causal)
    dop = torch.randn_like(qp)
    peers["fa4_aot dense, padded"] = lambda: flash_attn_bwd(qp, kp, vp, op, dop, lp, causal=causal)
    try:
        from torch.nn.attention.varlen import varlen_attn

        if hq != hkv:
            raise TypeError("no GQA")
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        window = {"window_size": (-1, 0)} if causal else {}
        o = varlen_attn(qg, kg, vg, cu, cu, longest, longest, **window)
        peers["torch varlen_attn"] = lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
    except Exception as e:
        print(f"  torch varlen_attn backward skipped: {type(e).__name__}: {str(e)[:80]}")
    return peers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernels", type=Path, action="append", default=[],
                        help="another build's folder (manifest.json, cubins/); repeatable")
    parser.add_argument("--bwd", action="store_true", help="time the backward (FLOPs 2.5x the forward's)")
    parser.add_argument("--order", default=None,
                        help="the sequence orders, comma-separated: plain, lpt (default: the policy's)")
    parser.add_argument("--mixes", default=None, help="only the mixes whose names contain one of these (comma-separated)")
    args = parser.parse_args()
    from fa4_aot.launch.loader import KernelLibrary

    libraries = [(str(folder), KernelLibrary(folder)) for folder in args.kernels]
    orders = tuple(args.order.split(",")) if args.order else (None,)
    wanted = args.mixes.split(",") if args.mixes else None
    results = {}
    for name, (lengths, hq, hkv) in mixes().items():
        if wanted and not any(w in name for w in wanted):
            continue
        for causal in (False, True):
            peers = (cells_bwd(lengths, hq, hkv, causal, orders) if args.bwd
                     else cells(lengths, hq, hkv, causal, libraries, orders))
            work = flops(lengths, hq, causal) * (2.5 if args.bwd else 1)
            rounds = {p: [] for p in peers}
            for _ in range(args.rounds):
                for p, fn in peers.items():
                    rounds[p].append(tflops(fn, work))
            results[f"{name}{' causal' if causal else ''}"] = rounds
    peers = sorted({p for r in results.values() for p in r})
    print(f"varlen {'backward' if args.bwd else 'forward'}, head_dim {D}, bf16, TFLOP/s (median of {args.rounds} rounds [range]), "
          f"{torch.cuda.get_device_name()}")
    ours = next(p for p in peers if p.startswith("fa4_aot varlen") and "/" not in p)
    both = {"fa4_aot varlen plain", "fa4_aot varlen lpt"} <= set(peers)
    print("| mix | " + " | ".join(peers) + f" | {ours} / torch varlen |" + (" lpt / plain |" if both else ""))
    print("|---|" + "---|" * (len(peers) + 1 + both))
    for cell, rounds in results.items():
        med = {p: statistics.median(v) for p, v in rounds.items()}
        line = [f"{med[p]:.0f} [{min(rounds[p]):.0f}-{max(rounds[p]):.0f}]" if p in med else "-" for p in peers]
        ratio = (f"{med[ours] / med['torch varlen_attn']:.2f}" if "torch varlen_attn" in med else "-")
        gain = f" {med['fa4_aot varlen lpt'] / med['fa4_aot varlen plain']:.3f} |" if both else ""
        print(f"| {cell} | " + " | ".join(line) + f" | {ratio} |" + gain)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "varlen-bwd-bf16.json" if args.bwd else "varlen-fwd-bf16.json"
        (args.out / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
