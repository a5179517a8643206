#!/usr/bin/env python3
"""Decode shapes through the dense entry points (issue 38): what the routing policy rests on,
and what each entry point reaches.

Run on an sm_90 GPU:
    python benchmarks/bench_dense_decode.py --sweep [--out results/]   # the policy's sweep
    python benchmarks/bench_dense_decode.py [--rounds 3] [--out results/]  # every entry point

``--sweep [--local]``: for a grid of (head_dim, GQA group, query tokens, keys, batch), the prefill
kernel (fa4_aot.forward with q_tiles 1 and 2 where built: the faster) against the decode
kernel on the same k and v as a full cache (fa4_aot.forward_kvcache without cache_seqlens,
split by the decode policy), as time and the ratio prefill / decode: policy.dense_decode
takes the decode kernel where that ratio is above 1. Writes dense-decode-sweep-<date>.json;
with --local, the local layers of gpt-oss and Gemma and plain group 2
(dense-decode-local-sweep-<date>.json).

Default: the decode benchmark's shapes (bench_decode.py's ISSUE and MORE) through every entry
point: fa4_aot.forward (DeviceArrays kept, with its workspace), fa4_aot.torch.flash_attn_fwd,
flash_attn_func (inference, no grad), torch's SDPA with the fa4_aot hook active, and
flash_attn_with_kvcache (the reference path), as bytes of K and V read per second against
the same run's device copy, and cuDNN (SDPA) beside them. Rounds interleaved; median and
range. Writes dense-decode-<date>.json.
"""

import argparse
import datetime
import itertools
import json
import statistics
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4_aot
import fa4_aot.torch_sdpa as hook
from fa4_aot.torch import as_device_array, flash_attn_fwd

import timing
from bench_decode import ISSUE, MORE, copy_bandwidth, kv_bytes


def bench(fn, rep=100):
    return timing.bench(fn, warmup=20, rep=rep)


def arrays(batch, sq, hq, hkv, d, keys, dtype=torch.bfloat16):
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, keys, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, keys, hkv, d, device="cuda", dtype=dtype)
    return q, k, v, torch.empty_like(q), torch.empty(batch, hq, sq, device="cuda")


# --local: the models' local layers (window, sinks, softcap) and plain group 2, which the
# main sweep leaves out: (name, head_dim, heads_q, heads_kv, mods)
LOCAL_LAYERS = [
    ("gpt-oss d64 64:8 w128 sinks", 64, 64, 8, {"window_size": (128, 0), "sink": True}),
    ("gemma2 d256 16:8 w4096 cap50", 256, 16, 8, {"window_size": (4096, 0), "softcap": 50.0}),
    ("gemma3 d128 32:16 w1024", 128, 32, 16, {"window_size": (1024, 0)}),
    ("group 2 d128 32:16", 128, 32, 16, {}),
]


def grid(args):
    """(head_dim, heads_q, heads_kv, seqlen_q, keys, batch, causal, mods) of the sweep."""
    if args.local:
        for (name, d, hq, hkv, mods), sq, keys, batch in itertools.product(
                LOCAL_LAYERS, (1, 4, 16, 32, 64), (2048, 8192, 32768), (2, 16)):
            if mods or sq in (1, 16, 64):
                yield d, hq, hkv, sq, keys, batch, False, mods
        return
    for d, group, sq, keys, batch, causal in itertools.product(
            (64, 128, 256), (1, 4, 8), (1, 2, 4, 8, 16, 32, 64, 128), (512, 2048, 8192, 32768), (2, 16),
            (False, True)):
        hkv = 32 // group if group > 1 else 16
        if not causal or (d == 128 and sq >= 4):
            yield d, hkv * group, hkv, sq, keys, batch, causal, {}


def sweep(args):
    library = fa4_aot.launch.calls.default_library()
    stream = torch.cuda.current_stream().cuda_stream
    cells = []
    for d, hq, hkv, sq, keys, batch, causal, mods in grid(args):
        torch.cuda.empty_cache()
        group = hq // hkv
        if batch * keys * hkv * d * 4 > 8 << 30:
            continue
        q, k, v, out, lse = arrays(batch, sq, hq, hkv, d, keys)
        a = [as_device_array(t) for t in (q, k, v, out, lse)]
        opts = {n: x for n, x in mods.items() if n != "sink"}
        sink = torch.randn(hq, device="cuda")  # kept alive: the arrays below are pointers
        if mods.get("sink"):
            opts["learnable_sink"] = as_device_array(sink)
        need = fa4_aot.forward_kvcache_workspace_bytes(batch, sq, hq, hkv, d, keys,
                                                        sm_count=library.sm_count(0))
        space = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
        ws = as_device_array(space) if need else None
        prefill = {}
        for tiles in (1, 2):
            try:
                prefill[tiles] = bench(lambda: fa4_aot.forward(*a, causal=causal, q_tiles=tiles, stream=stream,
                                                               **opts))
            except fa4_aot.Fa4AotError:  # not built
                pass
        dec = bench(lambda: fa4_aot.forward_kvcache(*a, None, ws, causal=causal, stream=stream, **opts))
        one = bench(lambda: fa4_aot.forward_kvcache(*a, None, None, causal=causal, num_splits=1, stream=stream,
                                                    **opts))
        best = min(prefill.values())
        cell = {"head_dim": d, "group": group, "seqlen_q": sq, "keys": keys, "batch": batch, "heads_kv": hkv,
                "causal": causal, "mods": {n: x for n, x in mods.items()}, "prefill_ms": prefill,
                "decode_ms": dec, "decode_one_split_ms": one, "ratio": best / dec, "ratio_one_split": best / one,
                "rows": group * sq}
        cells.append(cell)
        print(f"d{d:3d} g{group} sq{sq:3d} k{keys:6d} b{batch:2d} {'causal' if causal else '      '} {mods} "
              f"prefill {best * 1e3:8.1f} us decode {dec * 1e3:8.1f} us (1 split {one * 1e3:8.1f})  "
              f"prefill/decode {best / dec:5.2f} ({best / one:5.2f})", flush=True)
    return {"cells": cells}


def entry_points(batch, sq, hq, hkv, d, keys):
    """The call of each entry point on one problem, and cuDNN's."""
    q, k, v, out, lse = arrays(batch, sq, hq, hkv, d, keys)
    stream = torch.cuda.current_stream().cuda_stream
    need = fa4_aot.forward_workspace_bytes(batch, sq, hq, hkv, d, keys)
    space = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
    a = [as_device_array(t) for t in (q, k, v, out, lse)]
    ws = as_device_array(space) if need else None
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    import fa4_aot.torch as ft

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hq != hkv)

    def hooked():  # timed with the hook active (every_entry)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa()

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa()

    calls = {
        "forward": lambda: fa4_aot.forward(*a, workspace=ws, stream=stream),
        "prefill": lambda: fa4_aot.forward(*a, q_tiles=1, stream=stream),
        "flash_attn_fwd": lambda: flash_attn_fwd(q, k, v),
        "flash_attn_func": lambda: ft.flash_attn_func(q, k, v),
        "sdpa_hook": hooked,
        "kvcache": lambda: ft.flash_attn_with_kvcache(q, k, v),
        "cudnn": cudnn,
    }
    return calls, (q, k, v, out, lse, space)


def every_entry(args):
    copies, cells = [], {}
    shapes = [s for s in ISSUE + MORE if s[7] is None]
    for r in range(args.rounds):
        copies.append(copy_bandwidth(bench))
        for name, batch, sq, hq, hkv, d, keys, _ in shapes:
            calls, keep = entry_points(batch, sq, hq, hkv, d, keys)
            nbytes = kv_bytes(batch, hkv, d, keys)
            cell = cells.setdefault(name, {"shape": [batch, sq, hq, hkv, d, keys]})
            with torch.no_grad():
                for label, fn in calls.items():
                    if label == "sdpa_hook":
                        hook.activate()
                    try:
                        cell.setdefault(label, []).append(nbytes / (bench(fn) * 1e-3))
                    except RuntimeError as e:
                        cell[f"{label}_error"] = str(e)[:200]
                    finally:
                        if label == "sdpa_hook":
                            hook.restore()
            del keep, calls
            torch.cuda.empty_cache()
    copy = statistics.median(copies)
    labels = ("forward", "flash_attn_fwd", "flash_attn_func", "sdpa_hook", "kvcache", "prefill", "cudnn")
    print(f"device copy {copy / 1e12:.2f} TB/s; TB/s median (x copy), range over {args.rounds} rounds")
    print(f"{'shape':18s}" + "".join(f"{x:>22s}" for x in labels))
    for name, cell in cells.items():
        line = f"{name:18s}"
        for x in labels:
            got = cell.get(x)
            line += (f"{statistics.median(got) / 1e12:6.2f} ({statistics.median(got) / copy:4.2f}) "
                     f"{min(got) / 1e12:4.2f}-{max(got) / 1e12:4.2f}" if got else f"{'-':>22s}")
        print(line)
    return {"copy_bytes_per_s": copies, "cells": cells}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="the policy's sweep: prefill against decode kernel")
    ap.add_argument("--local", action="store_true", help="with --sweep: the local layers and group 2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    timing.add_argument(ap)
    args = ap.parse_args()
    timing.configure(args)
    result = sweep(args) if args.sweep else every_entry(args)
    date = datetime.date.today().isoformat()
    result.update(gpu=torch.cuda.get_device_name(), date=date, clear_l2=timing.MODE["clear"])
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"dense-decode-{'local-' if args.local else ''}sweep-{date}.json" if args.sweep else f"dense-decode-{date}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
