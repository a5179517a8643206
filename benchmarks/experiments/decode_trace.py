#!/usr/bin/env python3
"""Where a small decode call's time goes: torch.profiler's kernel timestamps for bench_decode
shapes (1 x 4096, 8 x 4096, 8 x 1024 keys; ours at the policy's splits, and cuDNN), ten calls
each after timing.clear_l2, the median call's kernels, durations and the gaps between them
(a negative gap: the combine launched programmatically, waiting before the decode ends),
beside the CUDA-event median. With ``ncu``: six calls of 1 x 4096 alone, for ncu.

    PYTHONPATH=$PWD python benchmarks/experiments/decode_trace.py
    ncu --launch-skip 8 --launch-count 2 -k regex:"decode|combine" python .../decode_trace.py ncu
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import timing  # noqa: E402
from bench_decode import setup  # noqa: E402

SHAPES = [("1x1x4096", 1, 1, 32, 8, 128, 4096, None), ("8x1x4096", 8, 1, 32, 8, 128, 4096, None),
          ("8x1x1024", 8, 1, 32, 8, 128, 1024, None)]


def main():
    if sys.argv[1:] == ["ncu"]:
        ours, _, keep = setup(*SHAPES[0][1:])
        for _ in range(6):
            timing.clear_l2()
            ours()
        torch.cuda.synchronize()
        return
    for name, *shape in SHAPES:
        ours, cudnn, keep = setup(*shape)
        for label, fn in (("ours", ours), ("cudnn", cudnn)):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            ms = timing.bench(fn, warmup=10, rep=50)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    timing.clear_l2()
                    fn()
                torch.cuda.synchronize()
            ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
            calls, cur = [], None  # the kernels after each clear (the clear's own: a reduction)
            for e in ev:
                if "reduce" in e.name.lower() or "sum" in e.name.lower():
                    cur = []
                    calls.append(cur)
                elif cur is not None:
                    cur.append(e)
            rows = []
            for c in calls[2:]:
                if c:
                    span = c[-1].time_range.end - c[0].time_range.start
                    rows.append((span, [(e.name[:40], e.time_range.end - e.time_range.start) for e in c],
                                 [c[i + 1].time_range.start - c[i].time_range.end for i in range(len(c) - 1)]))
            mid = sorted(rows)[len(rows) // 2]
            print(f"{name} {label}: event median {ms * 1e3:.1f} us; traced span {mid[0]:.1f} us; kernels "
                  + ", ".join(f"{n} {d:.1f}" for n, d in mid[1]) + f"; gaps {[round(g, 1) for g in mid[2]]}")
        del ours, cudnn, keep


if __name__ == "__main__":
    main()
