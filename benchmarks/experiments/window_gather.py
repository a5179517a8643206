#!/usr/bin/env python3
"""How fast the memory reads a decode window's K and V in the orders a kernel could take
them, with no attention math: is windowed decode bounded by its access pattern?

gpt-oss's sliding layers (head_dim 64, 8 KV heads, window 128 back: 129 keys, batch 256,
32k caches) keep each token's 8 heads side by side, so one KV head's keys are 128-byte rows
1 KB apart. A Triton kernel sums the window's K and V with one program per

- ``head``: (sequence, KV head): 128-byte rows, as the decode kernels' items read today;
- ``pair``: (sequence, two KV heads): 256-byte rows;
- ``seq``: (sequence): the whole 1 KB of every token, contiguous;
- ``dense``: the same bytes as ``seq`` packed together (the window's bytes copied out).

Each program reads the window's keys in chunks of ``--chunk`` keys. Timed by the
benchmarks' timer (``timing.bench``: the L2 cleared by a read before each call; a clear
by a write leaves dirty lines that a 35 us call pays to write back). Beside them, the
same-size copy: a contiguous copy whose read and write together are the window's bytes.
Figures: GB/s of the window's bytes (K and V), each case's median and range over the
rounds, interleaved, and the ratio to a 2 GiB copy (``bench_decode.copy_bandwidth`` and
``same_size_copy``, as the decode benchmarks).

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/experiments/window_gather.py [--rounds 5] [--chunk 32] [--out DIR]
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

import timing  # noqa: E402 (run with benchmarks/ on the path)
from bench_decode import copy_bandwidth, same_size_copy  # noqa: E402


@triton.jit
def window_sum(k_ptr, v_ptr, out_ptr, lengths_ptr, stride_b, stride_t, window,
               HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
               STAGES: tl.constexpr):
    pid = tl.program_id(0)
    per_seq = HEADS // GROUP
    b = pid // per_seq
    g = pid % per_seq
    end = tl.load(lengths_ptr + b)
    start = tl.maximum(end - window, 0)
    cols = tl.arange(0, GROUP * D)
    acc = tl.zeros((CHUNK, GROUP * D), dtype=tl.float32)
    base = b.to(tl.int64) * stride_b + g * GROUP * D
    for c in tl.range(start, end, CHUNK, num_stages=STAGES):
        keys = c + tl.arange(0, CHUNK)
        offs = base + keys.to(tl.int64)[:, None] * stride_t + cols[None, :]
        mask = (keys < end)[:, None]
        acc += tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--window", type=int, default=129)
    ap.add_argument("--chunk", type=int, default=32, help="keys a program loads at once (a power of two)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    heads, d = 8, 64
    B, S, W = args.batch, args.keys, args.window
    k, v = (torch.randn(B, S, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    full = torch.full((B,), S, dtype=torch.int32, device="cuda")
    ragged = torch.randint(W, S + 1, (B,), dtype=torch.int32, device="cuda")
    kd, vd = (t[:, S - W:].contiguous() for t in (k, v))
    dense_len = torch.full((B,), W, dtype=torch.int32, device="cuda")
    window_bytes = B * W * heads * d * 2 * 2

    def launcher(kt, vt, lengths, group):
        out = torch.empty(B * heads // group, device="cuda")
        # the loop's loads of K and V wait in (stages - 1) shared-memory buffers: at most
        # 4 stages, and as many as 192 KB holds (a sequence's 1 KB rows at 128 keys: 1)
        chunk_bytes = args.chunk * group * d * 2 * 2
        stages = max(1, min(4, 1 + (192 << 10) // chunk_bytes))

        def run():
            window_sum[(B * heads // group,)](kt, vt, out, lengths, kt.stride(0), kt.stride(1), W,
                                              HEADS=heads, GROUP=group, D=d, CHUNK=args.chunk, STAGES=stages,
                                              num_warps=4)
        return run

    cases = {"head": launcher(k, v, full, 1), "pair": launcher(k, v, full, 2), "seq": launcher(k, v, full, 8),
             "head ragged": launcher(k, v, ragged, 1), "seq ragged": launcher(k, v, ragged, 8),
             "dense": launcher(kd, vd, dense_len, 8), "dense head": launcher(kd, vd, dense_len, 1)}
    cases["same-size copy"], _buffers = same_size_copy(window_bytes)  # read + write: the window's bytes
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    gbs = {name: [] for name in cases}
    copies = []
    for _ in range(args.rounds):
        copies.append(copy_bandwidth(timing.bench) / 1e9)
        for name, fn in cases.items():
            gbs[name].append(window_bytes / (timing.bench(fn) * 1e-3) / 1e9)
    copy = statistics.median(copies)
    print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s  batch {B}  window {W} keys  "
          f"{window_bytes / 1e6:.1f} MB")
    print("| order | GB/s (median, range) | of the copy |\n|---|---|---|")
    rows = {}
    for name, xs in gbs.items():
        med = statistics.median(xs)
        rows[name] = {"median": med, "min": min(xs), "max": max(xs), "of_copy": med / copy}
        print(f"| {name} | {med:.0f} ({min(xs):.0f}-{max(xs):.0f}) | {med / copy:.2f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "window-gather.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "rows": rows, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
