#!/usr/bin/env python3
"""Decode benchmark: a few query tokens per sequence against a KV cache, bf16.

Run on an sm_90 GPU:  python benchmarks/bench_decode.py [--rounds 3] [--out results/] [--quick]

Figure: bytes of K and V read (batch x keys x heads_kv x head_dim x 2 tensors x 2 bytes)
per second, and its ratio to the same run's device-to-device copy (torch's copy_ of 2 GiB:
bytes read plus bytes written per second) and to a copy of the cache's bytes alone ("x
same": the launch and ramp a call of that size pays). Peer in the same process, on the same cache
memory: cuDNN through torch SDPA (``enable_gqa=True``, the cache as a (b, h, s, d) view).
Our call takes DeviceArrays made once (fa4_aot.torch.as_device_array), so a repeated
call re-launches its packed kernels (the host path costs microseconds, not the GPU's
time). Every cache is full (cache_seqlens = keys) and not causal (SDPA's causal aligns top-left,
the decode's bottom-right; at one query token they agree). Time: median of CUDA-event
timings (benchmarks/timing.py: warmup 50 ms, rep 200 ms, the L2 cleared before each call as
--clear-l2 says); --rounds N interleaves ours
and cuDNN round by round and reports each cell's median and range. --placement N: a placement
sweep (each shape N more times, every buffer fresh behind an unrelated allocation of a
random size), its minimum beside its median. --fp8: each shape also with an FP8 (e4m3)
cache with scales per (sequence, KV head): its own bytes (half) per second against the
copy, and its speed-up over the same shape's bf16 cache in the same round (tokens per
second: the ratio of times); the peers stay bf16 (neither cuDNN nor FA4 has an FP8 decode
on sm90). Writes
decode-<date>.json and a plot of bandwidth against keys (decode-keys-<date>.png).
"""

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4_aot
import timing
from fa4_aot.torch import as_device_array

# (name, batch, seqlen_q, heads_q, heads_kv, head_dim, keys, page_size or None)
ISSUE = [("8x1x32768", 8, 1, 32, 8, 128, 32768, None), ("1x1x131072", 1, 1, 32, 8, 128, 131072, None),
         ("64x1x4096", 64, 1, 32, 8, 128, 4096, None), ("8x4x32768", 8, 4, 32, 8, 128, 32768, None)]
MORE = [("MHA 8x1x32768", 8, 1, 32, 32, 128, 32768, None), ("d64 8x1x32768", 8, 1, 32, 8, 64, 32768, None),
        ("d256 8x1x32768", 8, 1, 32, 8, 256, 32768, None), ("8x16x32768", 8, 16, 32, 8, 128, 32768, None),
        ("1x1x4096", 1, 1, 32, 8, 128, 4096, None), ("16x1x4096", 16, 1, 32, 8, 128, 4096, None),
        ("128x1x4096", 128, 1, 32, 8, 128, 4096, None)]
# issue 38's placement case: split-KV at num_splits 2 (its figures moved 3.16 <-> 1.66 TB/s)
SPLIT = [("32x1x16384 GQA16:2 d64", 32, 1, 16, 2, 64, 16384, None)]
KEYS = [("keys", 8, 1, 32, 8, 128, n, None) for n in (1024, 4096, 16384, 65536, 131072)]
PAGED = [(f"{n} paged {p}", b, sq, hq, hkv, d, s, p) for n, b, sq, hq, hkv, d, s, _ in ISSUE for p in (256, 64, 16)]


def kv_bytes(batch, heads_kv, head_dim, keys, itemsize=2):
    return batch * keys * heads_kv * head_dim * 2 * itemsize


def copy_bandwidth(bench):
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def same_size_copy(nbytes):
    """(a device-to-device copy moving ``nbytes``, half read and half written, as one call;
    the tensors behind it): a small call's launch and ramp, the bar's context where the
    bytes are few."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src), (src, dst)


def setup(batch, sq, hq, hkv, d, keys, page, split_counts=(), fp8=False):
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, sq, device="cuda")
    lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    table = None
    scales, scale_tensors = {}, []
    if fp8:  # e4m3 with scales per (sequence, KV head), as a serving stack quantizes
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scale_tensors = [torch.rand(batch, hkv, device="cuda") + 0.5 for _ in range(2)]
        scales = {n: as_device_array(t) for n, t in zip(("k_descale", "v_descale"), scale_tensors)}
    k_cache, v_cache = k, v
    if page:
        pages = keys // page
        perm = torch.randperm(batch * pages, device="cuda")
        table = perm.view(batch, pages).to(torch.int32).contiguous()
        k_cache = torch.empty(batch * pages, page, hkv, d, device="cuda", dtype=k.dtype)
        v_cache = torch.empty_like(k_cache)
        k_cache.view(torch.uint8)[perm] = k.view(torch.uint8).view(batch * pages, page, hkv, -1)
        v_cache.view(torch.uint8)[perm] = v.view(torch.uint8).view(batch * pages, page, hkv, -1)
    need = max(fa4_aot.forward_kvcache_workspace_bytes(batch, sq, hq, hkv, d, keys, num_splits=n)
               for n in (None, *split_counts))
    space = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream

    # DeviceArrays kept, as a serving loop would: the call then repeats its packed launches
    # (the host path; torch tensors would be converted each call)
    args = [as_device_array(t) for t in (q, k_cache, v_cache, out, lse, lengths)]
    space_a = as_device_array(space) if need else None
    table_a = as_device_array(table) if table is not None else None

    def ours(splits=None, library=None):
        fa4_aot.forward_kvcache(*args, space_a, page_table=table_a, num_splits=splits, stream=stream,
                                library=library, **scales)

    ours.split_counts = split_counts

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    # every tensor behind a DeviceArray is kept with the call: a DeviceArray is a pointer, and
    # a freed lengths or workspace block is soon another tensor's (the kernel then reads its
    # values as lengths: calls that skip their keys, figures past the copy)
    keep = (q, k, v, out, lse, lengths, k_cache, v_cache, table, space, *scale_tensors, qt, kt, vt)
    return ours, (cudnn if not page and not fp8 else None), keep


def placement_sweep(shapes, trials, bench, cells):
    """Each shape ``trials`` times with every buffer made fresh behind an unrelated
    allocation of a random size, so the allocator puts them elsewhere each time (issue 38:
    split decode once moved between 3.16 and 1.66 TB/s with placement): cells[label]["placed"]."""
    import random

    rng = random.Random(0)
    for shape in shapes:
        name, batch, sq, hq, hkv, d, keys, page = shape
        label = name if name != "keys" else f"8x1x{keys}"
        nbytes = kv_bytes(batch, hkv, d, keys)
        placed = cells[label].setdefault("placed", [])
        pads = []
        for t in range(trials + 1):
            pads = pads[-2:] + [torch.empty(rng.randint(1 << 20, 3 << 30), dtype=torch.uint8, device="cuda")]
            ours, _, keep = setup(batch, sq, hq, hkv, d, keys, page)
            rate = nbytes / (bench(ours) * 1e-3)
            if t:  # the first: a warm-up after the shape's first allocation
                placed.append(rate)
            del ours, keep
        del pads
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="the issue's four shapes and their paged forms only")
    ap.add_argument("--kernels", type=Path, default=None, help="a built folder instead of the package's cubins")
    ap.add_argument("--turn-strides", default="", help="comma-separated policy.DECODE_TURN_STRIDE values to time "
                    "beside the policy's (an A/B of the CTAs' starting points)")
    ap.add_argument("--splits", default="", help="comma-separated num_splits to time beside the heuristic's")
    ap.add_argument("--only", default="", help="comma-separated shape labels to keep")
    ap.add_argument("--fp8", action="store_true", help="each shape also with an FP8 (e4m3) cache")
    ap.add_argument("--ab", action="append", default=[], metavar="NAME=DIR",
                    help="a built folder timed right after the default library in every cell of every round "
                    "(an A/B in one process; with --fp8 its FP8 cells too), repeatable")
    ap.add_argument("--placement", type=int, default=0, metavar="N",
                    help="a placement sweep: each shape N more times, every buffer made fresh behind an "
                    "unrelated allocation of a random size (1 MiB-3 GiB); reports the minimum beside the median")
    timing.add_argument(ap)
    args = ap.parse_args()
    if args.kernels:
        fa4_aot.set_default_library(fa4_aot.KernelLibrary(args.kernels))
    timing.configure(args)
    bench = timing.bench
    shapes = ISSUE + SPLIT + PAGED if args.quick else ISSUE + MORE + SPLIT + KEYS + PAGED
    if args.only:
        keep = set(args.only.split(","))
        shapes = [s for s in shapes if s[0] in keep]
    split_counts = [int(x) for x in args.splits.split(",") if x]
    import fa4_aot.policy as policy

    default_turn = policy.DECODE_TURN_STRIDE
    turns = [int(x) for x in args.turn_strides.split(",") if x]
    others = {x.split("=")[0]: fa4_aot.KernelLibrary(Path(x.split("=")[1])) for x in args.ab}
    copies, cells = [], {}
    for r in range(args.rounds):
        copies.append(copy_bandwidth(bench))
        for shape in shapes:
            name, batch, sq, hq, hkv, d, keys, page = shape
            label = name if name != "keys" else f"8x1x{keys}"
            ours, cudnn, keep = setup(batch, sq, hq, hkv, d, keys, page, split_counts)
            nbytes = kv_bytes(batch, hkv, d, keys)
            cell = cells.setdefault(label, {"shape": shape, "ours": [], "cudnn": []})
            if r == 0 and cudnn is not None:
                ours()
                ref = cudnn().transpose(1, 2)
                cell["max_diff_vs_cudnn"] = (keep[3].float() - ref.float()).abs().max().item()
            t16 = bench(ours)
            cell["ours"].append(nbytes / (t16 * 1e-3))
            copy_fn, copy_keep = same_size_copy(nbytes)
            cell.setdefault("same_size_copy", []).append(nbytes / (bench(copy_fn) * 1e-3))
            del copy_keep
            for n, lib in others.items():
                cell.setdefault(f"ours:{n}", []).append(nbytes / (bench(lambda: ours(library=lib)) * 1e-3))
            for n in ours.split_counts:
                cell.setdefault(f"splits{n}", []).append(nbytes / (bench(lambda: ours(n)) * 1e-3))
            for turn in turns:
                policy.DECODE_TURN_STRIDE = turn
                cell.setdefault(f"turn{turn}", []).append(nbytes / (bench(ours) * 1e-3))
                policy.DECODE_TURN_STRIDE = default_turn
            if cudnn is not None:
                try:
                    cell["cudnn"].append(nbytes / (bench(cudnn) * 1e-3))
                except RuntimeError as e:
                    cell["cudnn_error"] = str(e)[:200]
            del keep
            if args.fp8:
                ours8, _, keep = setup(batch, sq, hq, hkv, d, keys, page, fp8=True)
                t8 = bench(ours8)
                cell.setdefault("fp8", []).append(kv_bytes(batch, hkv, d, keys, 1) / (t8 * 1e-3))
                cell.setdefault("fp8_speedup", []).append(t16 / t8)
                for n, lib in others.items():
                    rate = kv_bytes(batch, hkv, d, keys, 1) / (bench(lambda: ours8(library=lib)) * 1e-3)
                    cell.setdefault(f"fp8:{n}", []).append(rate)
                del keep
            torch.cuda.empty_cache()
    if args.placement:
        placement_sweep(shapes, args.placement, bench, cells)
    copy = statistics.median(copies)
    print(f"device-to-device copy: {copy / 1e12:.2f} TB/s (range {min(copies) / 1e12:.2f}-{max(copies) / 1e12:.2f})")
    print(f"{'shape':28s} {'ours TB/s':>16s} {'x copy':>7s} {'x same':>7s} {'cuDNN TB/s':>16s} {'ours/cuDNN':>10s}")
    for label, cell in cells.items():
        o = cell["ours"]
        line = f"{label:28s} {statistics.median(o) / 1e12:6.2f} ({min(o) / 1e12:.2f}-{max(o) / 1e12:.2f})"
        same = statistics.median(cell["same_size_copy"])
        line += f" {statistics.median(o) / copy:7.2f} {statistics.median(o) / same:7.2f}"
        if cell["cudnn"]:
            c = cell["cudnn"]
            line += f" {statistics.median(c) / 1e12:6.2f} ({min(c) / 1e12:.2f}-{max(c) / 1e12:.2f})"
            line += f" {statistics.median(o) / statistics.median(c):10.2f}"
        line += "".join(f"  {n} splits: {statistics.median(cell[f'splits{n}']) / 1e12:.2f}" for n in split_counts)
        line += "".join(f"  turn {t}: {statistics.median(cell[f'turn{t}']) / 1e12:.2f}" for t in turns)
        if "fp8" in cell:
            f, u = cell["fp8"], cell["fp8_speedup"]
            line += (f"  fp8: {statistics.median(f) / 1e12:.2f} ({min(f) / 1e12:.2f}-{max(f) / 1e12:.2f}) TB/s "
                     f"{statistics.median(f) / copy:.2f} x copy, {statistics.median(u):.2f}x bf16 "
                     f"({min(u):.2f}-{max(u):.2f})")
        line += "".join(f"  {n}: {statistics.median(x) / 1e12:.2f} ({statistics.median(x) / copy:.2f})"
                        for n, x in cell.items() if n.startswith(("ours:", "fp8:")))
        if "placed" in cell:
            p = cell["placed"]
            line += (f"  placement: median {statistics.median(p) / 1e12:.2f} min {min(p) / 1e12:.2f} "
                     f"({min(p) / statistics.median(p):.3f})")
        print(line)
    date = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": gpu, "date": date, "clear_l2": timing.MODE["clear"], "copy_bytes_per_s": copies, "cells": cells}
    (args.out / f"decode-{date}.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = [(c["shape"][6], c) for label, c in cells.items() if c["shape"][0] == "keys"]
    if keys:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [k for k, _ in keys]
        ax.plot(xs, [statistics.median(c["ours"]) / 1e12 for _, c in keys], "o-", label="fa4_aot")
        if all(c["cudnn"] for _, c in keys):
            ax.plot(xs, [statistics.median(c["cudnn"]) / 1e12 for _, c in keys], "s-", label="cuDNN (SDPA)")
        ax.axhline(copy / 1e12, color="gray", ls="--", label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("keys per sequence")
        ax.set_ylabel("K+V read, TB/s")
        ax.set_title(f"Decode, 8 x 1 query token, GQA 32:8, d128 bf16\n{gpu}, {date}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / f"decode-keys-{date}.png", dpi=120)


if __name__ == "__main__":
    main()
