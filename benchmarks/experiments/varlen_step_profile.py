"""Where a varlen training step's host time goes on an sm_90 GPU (flash_attn_varlen_func,
causal, bf16, 12 heads of 64): host time of the forward alone, the backward alone, and the
step, deterministic or not, each with the GPU idle at its start, beside the GPU time of the
step (CUDA events); then the cProfile of the step's Python (the functions whose own time is
largest). Session 47 measured the step at about a millisecond of host time on the H100
against about 100 us of the adapter's Python on a CPU with the driver stubbed.

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_step_profile.py [--steps 50]
"""
import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from fa4_aot.torch import flash_attn_varlen_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import host_us  # noqa: E402 (benchmarks/timing.py)


def gpu_us(fn, steps: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    lengths, h, d = [512, 512, 300, 700], 12, 64
    total, m = sum(lengths), max(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
    for deterministic in (False, True):
        def forward():
            return flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True, deterministic=deterministic)

        def step():
            forward().backward(grad)

        held = []

        def backward_only():  # a forward made before, untimed
            held.pop().backward(grad)

        for _ in range(10):
            step()
        fwd = host_us(forward, args.steps)
        bwd = []
        for _ in range(args.steps):
            held.append(forward())
            torch.cuda.synchronize()
            start = time.perf_counter()
            backward_only()
            bwd.append(time.perf_counter() - start)
        print(f"deterministic={deterministic}: host us forward {fwd:.0f}, backward {statistics.median(bwd) * 1e6:.0f}, "
              f"step {host_us(step, args.steps):.0f}; GPU us step {gpu_us(step, args.steps):.0f}")
    profile = cProfile.Profile()
    profile.runcall(lambda: [step() for _ in range(args.steps)])
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
