#!/usr/bin/env python3
"""Decode with a sliding window against a long KV cache, bf16, on an sm_90 GPU:
gpt-oss-like (head_dim 64, GQA 64:8, window 128 back, sinks), Gemma-like (head_dim 256
and 128, GQA 16:8, windows 1024 and 4096 back, softcap 50) and Mistral-like (head_dim 128,
GQA 32:8, window 4096, neither) layers, one query token per
sequence, caches of 32k and 128k keys, contiguous and paged (pages of 64 keys, randomly
placed: the window starts mid-page).

    python benchmarks/bench_decode_local.py [--rounds 3] [--out benchmarks/results] [--caches 32768]
        [--layers gpt-oss,...] [--windows 256,1024] [--batch 64] [--kernels NAME=DIR] [--policy NAME=VALUE]
        [--ragged]

(--windows: each windowed layer also at these windows; --batch: every layer at this batch;
--policy: a policy constant set for the run; the span policy's sweeps, docs/design.md
"Local attention, sinks, softcap"; --ragged: each sequence's cache length drawn from the
cache's last 64 keys, so the window's first key falls at every offset in a page and a key
tile, as in serving, where full caches fix it by the cache length. gpt-oss's own window is
128 keys, window_size (127, 0) as vLLM passes it: --windows 127.)

Figure: bytes of the window's K and V (batch x (window + 1) keys x heads_kv x head_dim x
2 tensors x 2 bytes) per second, and its ratio to the same run's device-to-device copy
(bench_decode.copy_bandwidth, 2 GiB), and to a copy of the window's bytes alone (the same
launch and ramp a small read pays: the bar's context where the window is small). Peer in the same process: cuDNN through torch SDPA on the
window's keys sliced out of the contiguous cache (what a caller without a windowed decode
would do; SDPA takes no window, sinks or cap: it computes plain attention over the slice,
so its figure is the bandwidth it reaches on the same bytes, not the same math). Our call
takes DeviceArrays made once. Rounds interleave ours and cuDNN; each cell's median and
range are reported. Writes decode-local-<date>.json.
"""

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4_aot
from fa4_aot.torch import as_device_array

import timing  # noqa: E402 (run from benchmarks/ or with it on the path)
from bench_decode import copy_bandwidth, same_size_copy  # noqa: E402

# (name, batch, heads_q, heads_kv, head_dim, window back, softcap, sinks)
LAYERS = [("gpt-oss", 256, 64, 8, 64, 128, 0.0, True), ("gemma-d256-w1024", 32, 16, 8, 256, 1024, 50.0, False),
          ("gemma-d256-w4096", 16, 16, 8, 256, 4096, 50.0, False),
          ("gemma-d128-w4096", 16, 16, 8, 128, 4096, 50.0, False),
          ("mistral-w4096", 16, 32, 8, 128, 4096, 0.0, False),  # head_dim 128, GQA 32:8, no cap, no sinks
          ("gpt-oss-full", 8, 64, 8, 64, None, 0.0, True)]  # its full layers: sinks, no window
CACHES = (32768, 131072)
PAGE = 64


def cache_lengths(layer, keys, ragged):
    """Each sequence's cache length: the whole cache, or (``ragged``) one of its last 64 keys."""
    batch = layer[1]
    if not ragged:
        return torch.full((batch,), keys, dtype=torch.int32)
    return keys - torch.randint(0, PAGE, (batch,), generator=torch.Generator().manual_seed(keys), dtype=torch.int32)


def setup(layer, keys, paged, lengths=None):
    """``lengths``: ``cache_lengths``'s (None: every cache full)."""
    _, batch, hq, hkv, d, window, cap, sinks = layer
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(batch, hq, 1, device="cuda")
    lengths = (cache_lengths(layer, keys, False) if lengths is None else lengths).cuda()
    sink = torch.randn(hq, device="cuda") if sinks else None
    table = None
    if paged:  # pages of random keys at random places (no contiguous twin: the memory)
        pages = keys // PAGE
        table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32).contiguous()
        k_cache, v_cache = (torch.randn(batch * pages, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
    else:
        k_cache, v_cache = (torch.randn(batch, keys, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mods = {"window_size": (-1, -1) if window is None else (window, 0), "softcap": cap}
    window = keys - 1 if window is None else window
    need = fa4_aot.forward_kvcache_workspace_bytes(batch, 1, hq, hkv, d, keys)
    space = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
    args = [as_device_array(t) for t in (q, k_cache, v_cache, out, lse, lengths)]
    extra = {"page_table": as_device_array(table) if table is not None else None,
             "learnable_sink": as_device_array(sink) if sink is not None else None}
    stream = torch.cuda.current_stream().cuda_stream

    def ours_with(library):
        def ours():
            fa4_aot.forward_kvcache(*args, space_array, stream=stream, library=library, **mods, **extra)
        return ours

    space_array = as_device_array(space) if need else None

    qt = q.transpose(1, 2)
    kt, vt = (x[:, keys - window - 1:].transpose(1, 2) for x in (k_cache, v_cache))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    # every tensor behind a DeviceArray kept (a DeviceArray is a pointer: bench_decode.setup)
    return ours_with, (cudnn if not paged else None), (q, k_cache, v_cache, space, table, sink, out, lse, lengths)


def window_bytes(layer, lengths):
    """The bytes of K and V each sequence's window holds (its whole cache without one)."""
    _, _, _, hkv, d, window, _, _ = layer
    seen = lengths if window is None else lengths.clamp(max=window + 1)
    return int(seen.sum()) * hkv * d * 2 * 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--kernels", action="append", default=[], metavar="NAME=DIR",
                    help="a built folder timed beside the package's cubins (an A/B), repeatable")
    ap.add_argument("--layers", default="", help="comma-separated layer names to keep")
    ap.add_argument("--windows", default="",
                    help="comma-separated windows (keys back) each windowed layer is also run at (a policy sweep)")
    ap.add_argument("--batch", type=int, default=0, help="every layer's batch (0: each layer's own)")
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=VALUE",
                    help="set a fa4_aot.policy constant for the run (an int), e.g. DECODE_STACK_MIN_CTAS_PER_SM=0")
    ap.add_argument("--caches", default=",".join(str(k) for k in CACHES),
                    help="comma-separated cache lengths in keys (gpt-oss's batch at 128k needs 68 GB)")
    ap.add_argument("--ragged", action="store_true",
                    help="cache lengths drawn from each cache's last 64 keys (default: every cache full)")
    timing.add_argument(ap)
    args = ap.parse_args()
    timing.configure(args)
    for setting in args.policy:
        name, value = setting.split("=")
        if not hasattr(fa4_aot.policy, name):
            ap.error(f"--policy: fa4_aot.policy has no {name}")
        setattr(fa4_aot.policy, name, int(value))
    layers = [x for x in LAYERS if not args.layers or x[0] in args.layers.split(",")]
    layers += [(f"{x[0]}-w{w}", *x[1:5], w, *x[6:]) for x in list(layers) if x[5] is not None
               for w in (int(y) for y in args.windows.split(",") if y) if w != x[5]]
    if args.batch:
        layers = [(f"{x[0]} b{args.batch}", args.batch, *x[2:]) for x in layers]
    caches = [int(x) for x in args.caches.split(",") if x]
    libraries = {None: None, **{x.split("=")[0]: fa4_aot.KernelLibrary(Path(x.split("=")[1])) for x in args.kernels}}
    bench = timing.bench
    copies, cells = [], {}
    for r in range(args.rounds):
        copies.append(copy_bandwidth(bench))
        for layer in layers:
            for keys in caches:
                for paged in (False, True):
                    label = f"{layer[0]} {keys // 1024}k{' paged' if paged else ''}"
                    lengths = cache_lengths(layer, keys, args.ragged)
                    ours_with, cudnn, keep = setup(layer, keys, paged, lengths)
                    cell = cells.setdefault(label, {"ours": [], "cudnn": [], "copy": []})
                    timed = [("ours", ours_with(None))] + ([("cudnn", cudnn)] if cudnn else [])
                    timed += [(f"ours:{n}", ours_with(lib)) for n, lib in libraries.items() if n]
                    nbytes = window_bytes(layer, lengths)
                    copy_fn, copy_keep = same_size_copy(nbytes)
                    timed += [("copy", copy_fn)]
                    for name, fn in (timed if r % 2 == 0 else timed[::-1]):
                        cell.setdefault(name, []).append(nbytes / (bench(fn) * 1e-3))
                    del keep, copy_keep
                    torch.cuda.empty_cache()
    copy = statistics.median(copies)
    lines = [f"Windowed decode: GB/s of the window's K and V (median over {args.rounds} rounds, range), and of the "
             f"copy ({copy / 1e9:.0f} GB/s: {min(copies) / 1e9:.0f}-{max(copies) / 1e9:.0f}); "
             f"{'ragged' if args.ragged else 'full'} caches", "",
             "| layer, cache | fa4_aot GB/s | / copy | / same-size copy | cuDNN on the slice GB/s | ours / cuDNN |",
             "|---|---|---|---|---|---|"]
    for label, cell in cells.items():
        o = statistics.median(cell["ours"])
        c = statistics.median(cell["cudnn"]) if cell["cudnn"] else float("nan")
        rng = f" ({min(cell['ours']) / 1e9:.0f}-{max(cell['ours']) / 1e9:.0f})"
        same = statistics.median(cell["copy"])
        lines.append(f"| {label} | {o / 1e9:.0f}{rng} | {o / copy:.2f} | {o / same:.2f} | {c / 1e9:.0f} | {o / c:.2f} |"
                     + "".join(f" {n}: {statistics.median(x) / 1e9:.0f}" for n, x in cell.items() if ":" in n))
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-local-{datetime.date.today()}.json"
    path.write_text(json.dumps({"copy_bytes_per_s": copies, "cells": cells, "table": table,
                                "gpu": torch.cuda.get_device_name(), "clear_l2": timing.MODE["clear"],
                                "ragged": args.ragged}, indent=1))


if __name__ == "__main__":
    main()
