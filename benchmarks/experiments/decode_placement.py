#!/usr/bin/env python3
"""Experiment (issue 38, item 5): what split-KV decode's speed is sensitive to when the
allocator moves its buffers.

    python benchmarks/experiments/decode_placement.py OUT.json [TRIALS]

For each shape, TRIALS times: an unrelated allocation of a random size (1 MiB to 3 GiB) is
made, then the buffers named by the mode are made fresh behind it (the others kept), and the
call is timed (bytes of K and V per second). Modes: "all" (q, K, V, out, lse, workspace
fresh), "kv" (only K and V fresh), "workspace" (only the split workspace fresh), "none"
(nothing fresh: the noise floor). Each trial records the buffers' addresses, so the
sensitivity can be read against them (offsets modulo 2 MiB pages, 1 GiB, each other).
"""

import json
import random
import statistics
import sys

import torch
import triton.testing

import fa4_aot
from fa4_aot.torch import as_device_array

SHAPES = [  # (name, batch, seqlen_q, heads_q, heads_kv, head_dim, keys, num_splits)
    ("32x1x16k GQA16:2 d64 s2", 32, 1, 16, 2, 64, 16384, 2),
    ("32x1x16k GQA16:2 d64 s4", 32, 1, 16, 2, 64, 16384, 4),
    ("1x1x128k GQA32:8 d128", 1, 1, 32, 8, 128, 131072, None),
    ("8x1x32k GQA32:8 d128", 8, 1, 32, 8, 128, 32768, None),
]


def main():
    out_path = sys.argv[1]
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    rng = random.Random(0)
    stream = torch.cuda.current_stream().cuda_stream
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")  # noqa: E731
    result = {}
    for name, b, sq, hq, hkv, d, keys, splits in SHAPES:
        nbytes = b * keys * hkv * d * 4
        need = fa4_aot.forward_kvcache_workspace_bytes(b, sq, hq, hkv, d, keys, num_splits=splits,
                                                        sm_count=fa4_aot.default_library().sm_count(0))
        bufs = {}

        def make(which):
            if "q" in which:
                bufs["q"] = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
                bufs["out"] = torch.empty_like(bufs["q"])
                bufs["lse"] = torch.empty(b, hq, sq, device="cuda")
                bufs["lengths"] = torch.full((b,), keys, dtype=torch.int32, device="cuda")
            if "kv" in which:
                bufs["k"] = torch.randn(b, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
                bufs["v"] = torch.randn(b, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
            if "ws" in which:
                bufs["ws"] = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")

        make(("q", "kv", "ws"))
        rows = []
        pads = []
        for mode, which in (("all", ("q", "kv", "ws")), ("kv", ("kv",)), ("workspace", ("ws",)), ("none", ())):
            for t in range(trials):
                pads.append(torch.empty(rng.randint(1 << 20, 3 << 30), dtype=torch.uint8, device="cuda"))
                for w in which:  # drop the old ones first, so the new land behind the pad
                    for n in {"q": ("q", "out", "lse", "lengths"), "kv": ("k", "v"), "ws": ("ws",)}[w]:
                        bufs.pop(n, None)
                make(which)
                a = [as_device_array(bufs[n]) for n in ("q", "k", "v", "out", "lse", "lengths")]
                ws = as_device_array(bufs["ws"]) if need else None
                ms = bench(lambda: fa4_aot.forward_kvcache(*a, ws, num_splits=splits, stream=stream))
                rows.append({"mode": mode, "tb_s": nbytes / (ms * 1e-3) / 1e12,
                             "ptr": {n: bufs[n].data_ptr() for n in ("k", "v", "ws", "out", "lse")}})
                if len(pads) > 3:
                    pads.pop(0)
        pads.clear()
        bufs.clear()
        torch.cuda.empty_cache()
        result[name] = rows
        for mode in ("all", "kv", "workspace", "none"):
            got = [r["tb_s"] for r in rows if r["mode"] == mode]
            print(f"{name:26s} {mode:10s} median {statistics.median(got):.2f} min {min(got):.2f} "
                  f"max {max(got):.2f} TB/s", flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
