#!/usr/bin/env python3
"""Would gpt-oss's windowed decode read faster if one CTA took all eight KV heads of a
sequence, each key one contiguous 1 KB row, instead of one head's 128-byte rows?

Probed with kernels already built, on the same bytes (batch 256, 32k caches of 8 KV heads
at head_dim 64, GQA 64:8, bf16, the first L keys of each sequence):

- ``stacked``: the head_dim 512 decode on the cache viewed as one KV head of 512 columns
  (each token's 8 heads side by side), Q block-diagonal: query head h's 64 values in
  columns [64 (h // 8), 64 (h // 8) + 64), zeros elsewhere, so S is each head's own scores;
  O's row h is taken from the same columns. Checked against ``plain``.
- ``plain``: the decode of the same call as it is served today (by policy: the d64 heads
  read in pairs on the d128 kernel, 256-byte rows);
- ``window``: gpt-oss's real windowed call (window 128 back, sinks, whole 32k caches: the
  span-narrow kernel, 128-byte rows), bytes of its 129 keys.

GB/s of the keys' K and V, the median of interleaved rounds, against a 2 GiB copy.

    python benchmarks/experiments/stacked_heads_probe.py [--rounds 3] [--lengths 128,129,256]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa4_aot  # noqa: E402
from fa4_aot.torch import as_device_array  # noqa: E402

import timing  # noqa: E402
from bench_decode import copy_bandwidth  # noqa: E402

B, S, HKV, D, HQ = 256, 32768, 8, 64, 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="128,129,256")
    timing.add_argument(ap)
    args = ap.parse_args()
    timing.configure(args)
    g = HQ // HKV
    torch.manual_seed(0)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qs = torch.zeros(B, 1, HQ, HKV * D, device="cuda", dtype=torch.bfloat16)
    for h in range(HKV):
        qs[:, :, h * g:(h + 1) * g, h * D:(h + 1) * D] = q[:, :, h * g:(h + 1) * g]
    ks, vs = (t.view(B, S, 1, HKV * D) for t in (k, v))
    out_p, out_s = torch.empty_like(q), torch.empty_like(qs)
    lse_p, lse_s = (torch.empty(B, HQ, 1, device="cuda") for _ in range(2))
    sink = torch.randn(HQ, device="cuda")
    out_w, lse_w = torch.empty_like(q), torch.empty(B, HQ, 1, device="cuda")
    full = torch.full((B,), S, dtype=torch.int32, device="cuda")
    space = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    A = as_device_array

    def call(qq, kk, vv, out, lse, lengths, **kw):
        arrays = [A(t) for t in (qq, kk, vv, out, lse, lengths)]
        space_a = A(space)

        def run():
            fa4_aot.forward_kvcache(*arrays, space_a, stream=stream, softmax_scale=D ** -0.5, **kw)
        return run

    window = call(q, k, v, out_w, lse_w, full, window_size=(128, 0), learnable_sink=A(sink))
    copies, cells = [], {}
    lengths = [int(x) for x in args.lengths.split(",")]
    for r in range(args.rounds):
        copies.append(copy_bandwidth(timing.bench))
        for L in lengths:
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            runs = {"plain": call(q, k, v, out_p, lse_p, lens), "stacked": call(qs, ks, vs, out_s, lse_s, lens),
                    "stacked 1 split": call(qs, ks, vs, out_s, lse_s, lens, num_splits=1)}
            if r == 0:  # the stacked call's math: each row's own head's columns
                for t in (out_p, out_s, lse_p, lse_s):
                    t.fill_(float("nan"))
                runs["plain"]()
                runs["stacked"]()
                torch.cuda.synchronize()
                picked = torch.stack([out_s[:, :, h, (h // g) * D:(h // g + 1) * D] for h in range(HQ)], dim=2)
                err = (picked.float() - out_p.float()).abs().max().item()
                lerr = (lse_s - lse_p).abs().max().item()
                print(f"L={L}: stacked vs plain: max |dO| {err:.2e}, max |dLSE| {lerr:.2e}")
            nbytes = B * L * HKV * D * 2 * 2
            items = list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]
            for name, fn in items:
                cells.setdefault((L, name), []).append(nbytes / (timing.bench(fn) * 1e-3))
        cells.setdefault((129, "window (the package route)"), []).append(B * 129 * HKV * D * 4 / (timing.bench(window) * 1e-3))
    copy = statistics.median(copies)
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e9:.0f} GB/s; batch {B}, 8 KV heads d64, GQA 64:8")
    print("| keys | call | GB/s (median, range) | / copy |\n|---|---|---|---|")
    for (L, name), xs in sorted(cells.items()):
        m = statistics.median(xs)
        print(f"| {L} | {name} | {m / 1e9:.0f} ({min(xs) / 1e9:.0f}-{max(xs) / 1e9:.0f}) | {m / copy:.2f} |")


if __name__ == "__main__":
    main()
