#!/usr/bin/env python3
"""What each dense entry point does per call at the decode benchmark's short shapes
(issue 38: the SDPA hook read 0.04 of the copy at 1 x 4096 and 0.64 at 16 x 4096 on the
H100, flash_attn_func 0.16 at 1 x 4096): host microseconds per call (no synchronize, the
GPU idle enough that the host is what is timed), the CUDA API calls and kernels of one
call (torch.profiler), and the benchmark's figure with and without the L2 read clear.

Run on an sm_90 GPU: PYTHONPATH=$PWD python benchmarks/experiments/entry_host_probe.py
``--profile LABEL [--shape 1x4096]``: instead, cProfile's costliest functions over 1000 calls
of that entry point (its Python, the driver calls among them).
"""

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import timing  # noqa: E402
from bench_dense_decode import entry_points  # noqa: E402
from launch_overhead import host_us  # noqa: E402
import fa4_aot.torch_sdpa as hook  # noqa: E402

SHAPES = {"1x4096": (1, 1, 32, 8, 128, 4096), "16x4096": (16, 1, 32, 8, 128, 4096),
          "8x32768": (8, 1, 32, 8, 128, 32768)}


def one_call(fn):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    api, kernels = Counter(), Counter()
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[name[:70]] += 1
        elif name.startswith(("cuda", "cu")) and not name.startswith("cudnn"):
            api[name] += 1
    return ({k: v / 3 for k, v in api.items()}, {k: v / 3 for k, v in kernels.items()})


def profile_one(label, shape):
    import cProfile
    import pstats

    calls, keep = entry_points(*SHAPES[shape])
    fn = calls[label]
    if label == "sdpa_hook":
        hook.activate()
    with torch.no_grad():
        host_us(fn, 300)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(1000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    if label == "sdpa_hook":
        hook.restore()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, metavar="LABEL")
    ap.add_argument("--shape", default="1x4096", choices=sorted(SHAPES))
    args = ap.parse_args()
    if args.profile:
        return profile_one(args.profile, args.shape)
    for name, shape in SHAPES.items():
        calls, keep = entry_points(*shape)
        print(f"== {name} {shape}", flush=True)
        with torch.no_grad():
            for label, fn in calls.items():
                if label == "sdpa_hook":
                    hook.activate()
                try:
                    h = host_us(fn, 300)
                    read = timing.bench(fn, clear="read") * 1e3
                    none = timing.bench(fn, clear="none") * 1e3
                    api, kernels = one_call(fn)
                    print(f"{label:16s} host {h:7.1f} us/call  timed(read clear) {read:7.1f} us  timed(no clear) {none:7.1f} us")
                    print(f"{'':16s} api/call {dict(sorted(api.items()))}")
                    print(f"{'':16s} kernels/call {kernels}", flush=True)
                finally:
                    if label == "sdpa_hook":
                        hook.restore()
        del calls, keep
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
