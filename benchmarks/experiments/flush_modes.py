#!/usr/bin/env python3
"""How the decode figures depend on what the timer leaves in L2 before each call.

``triton.testing.do_bench`` (the decode benchmarks' timer before benchmarks/timing.py)
zeroes a 256 MB buffer before every timed call: the L2 (50 MB) is then full of dirty lines, which the timed call must
write back to DRAM before its own reads get the bandwidth. At 4 TB/s that is ~12 us, a
fixed cost that a 70-90 us decode call (issue 38's split case) feels and a 1 ms copy does
not. Each shape is timed four ways, interleaved round by round:

- ``zero``: do_bench as the benchmarks called it (warmup 50 ms, rep 200 ms, median);
- ``read``: timing.bench's read clear (a sum over 256 MB: L2 left full of clean
  lines of other data);
- ``warm``: timing.bench with no clear (the same buffers call after call);
- ``serving``: four distinct copies of the shape's buffers, called in turn back to back,
  one event pair around 48 calls (a serving loop's throughput, nothing L2-resident).

The copy (2 GiB) is timed the same four ways; cuDNN (SDPA), where the shape has it, by
``zero`` and ``read``. Then torch.profiler's kernel durations and
the gap between the decode kernel's end and the combine's start for the split shapes.

    PYTHONPATH=$PWD python benchmarks/experiments/flush_modes.py OUT_JSON [ROUNDS]
"""

import json
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import timing  # noqa: E402
from bench_decode import kv_bytes, setup  # noqa: E402
from bench_decode_local import LAYERS, cache_lengths, window_bytes  # noqa: E402
from bench_decode_local import setup as setup_local  # noqa: E402

SHAPES = [  # (label, batch, seqlen_q, heads_q, heads_kv, head_dim, keys, page, fp8)
    ("split 32x16k GQA16:2 d64", 32, 1, 16, 2, 64, 16384, None, False),
    ("8x32k GQA32:8 d128", 8, 1, 32, 8, 128, 32768, None, False),
    ("1x128k GQA32:8 d128", 1, 1, 32, 8, 128, 131072, None, False),
    ("64x4k GQA32:8 d128", 64, 1, 32, 8, 128, 4096, None, False),
    ("d512 32x4k MQA p64", 32, 1, 8, 1, 512, 4096, 64, False),
    ("fp8 8x32k GQA32:8 d128", 8, 1, 32, 8, 128, 32768, None, True),
    ("local gpt-oss 256x8k w128", "gpt-oss"),
    ("local gemma d256 32x8k w1024", "gemma-d256-w1024"),
]


def make(shape):
    """(ours, cudnn or None, buffers kept, bytes the figure counts)"""
    if len(shape) == 2:
        layer = next(x for x in LAYERS if x[0] == shape[1])
        ours_with, cudnn, keep = setup_local(layer, 8192, False)  # the window's bytes as at 32k or 128k
        return ours_with(None), cudnn, keep, window_bytes(layer, cache_lengths(layer, 8192, False))
    label, batch, sq, hq, hkv, d, keys, page, fp8 = shape
    ours, cudnn, keep = setup(batch, sq, hq, hkv, d, keys, page, fp8=fp8)
    return ours, cudnn, keep, kv_bytes(batch, hkv, d, keys, 1 if fp8 else 2)

def serving(fns, calls=48):
    for f in fns:
        f()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(calls):
        fns[i % len(fns)]()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls


def kernel_profile(fn, calls=20):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            timing.clear_l2()
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    names, gaps = {}, []
    prev = None
    for e in events:
        names.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
        if prev is not None and "reduce" not in e.name.lower() and "reduce" not in prev.name.lower():
            gaps.append(e.time_range.start - prev.time_range.end)
        prev = e
    return {"kernels_us": {n: statistics.median(v) for n, v in names.items()},
            "gaps_us": sorted(gaps)[len(gaps) // 2] if gaps else None}


def main():
    out = Path(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    import inspect

    src = inspect.getsource(triton.testing.do_bench)
    result = {"gpu": torch.cuda.get_device_name(), "do_bench_clears_by": [
        line.strip() for line in src.splitlines() if "cache" in line.lower()][:6], "cells": {}}
    src_t = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst_t = torch.empty_like(src_t)
    copy = lambda: dst_t.copy_(src_t)  # noqa: E731
    cells = result["cells"]
    clears = {"zero": "zero", "read": "read", "warm": "none"}  # the figure's name: timing.bench's clear
    for r in range(rounds):
        c = cells.setdefault("copy 2 GiB", {})
        nbytes = 2 * src_t.numel()
        for mode, clear in clears.items():
            c.setdefault(mode, []).append(nbytes / timing.bench(copy, clear=clear) / 1e9)
        c.setdefault("serving", []).append(nbytes / serving([copy], 8) / 1e9)
        for shape in SHAPES:
            label = shape[0]
            sets = [make(shape) for _ in range(4)]
            fn, cudnn, _, nbytes = sets[0]
            c = cells.setdefault(label, {})
            if cudnn is not None:
                for mode in ("zero", "read"):
                    c.setdefault(f"cudnn_{mode}", []).append(nbytes / timing.bench(cudnn, clear=mode) / 1e9)
            for mode, clear in clears.items():
                c.setdefault(mode, []).append(nbytes / timing.bench(fn, clear=clear) / 1e9)
            c.setdefault("serving", []).append(nbytes / serving([s[0] for s in sets]) / 1e9)
            if r == 0:
                c["profile_read_flush"] = kernel_profile(fn)
            del sets, fn, cudnn
            torch.cuda.empty_cache()
    copy_cell = cells["copy 2 GiB"]
    print(json.dumps(result["do_bench_clears_by"]))
    modes = ("zero", "read", "warm", "serving", "cudnn_zero", "cudnn_read")
    print(f"{'shape':30s} " + " ".join(f"{m:>16s}" for m in modes))
    for label, c in cells.items():
        line = f"{label:30s} "
        for m in modes:
            if m not in c:
                line += f"{'':>16s} "
                continue
            v = statistics.median(c[m])
            base = statistics.median(copy_cell.get(m.replace("cudnn_", ""), copy_cell["zero"]))
            line += f"{v:6.2f} ({v / base:4.2f})   "
        print(line)
        if "profile_read_flush" in c:
            print("   ", json.dumps(c["profile_read_flush"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
