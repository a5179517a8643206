"""Host time of a varlen training step through flash_attn_varlen_func on an sm_90 GPU
(causal, bf16, d64; 4 sequences of 300-700 tokens at 12 heads, and of 9-128 at 8), deterministic
or not, beside an older fa4_aot.torch.varlen module (``--before FILE``: its source, e.g. from
``git show REV:fa4_aot/torch/varlen.py``) and SDPA flash's dense step (4 x 512) as a
yardstick: blocks of 25 steps, each step timed alone with the GPU idle at its start, the
layers taking turns (benchmarks/timing.host_blocks); medians of the blocks (range), the
ratio to the older module by block, and the GPU time of a step.

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_step_ab.py [--blocks 10] [--before FILE]
"""
import argparse
import importlib.util
import itertools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from fa4_aot.torch import flash_attn_varlen_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import host_blocks  # noqa: E402 (benchmarks/timing.py)

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--blocks", type=int, default=10)
ap.add_argument("--before", default=None, help="an older fa4_aot/torch/varlen.py to time beside")
args = ap.parse_args()
before = None
if args.before:  # loaded inside the package, so that its relative imports resolve
    spec = importlib.util.spec_from_file_location("fa4_aot.torch.varlen_before", args.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
blocks = args.blocks
for lengths, h in (([512, 512, 300, 700], 12), ([128, 100, 60, 9], 8)):
    total, m, d = sum(lengths), max(lengths), 64
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
    qs, ks, vs = (torch.randn(4, h, 512, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    gs = torch.randn(4, h, 512, d, device="cuda", dtype=torch.bfloat16)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).backward(gs)

    modules = {"now": flash_attn_varlen_func, **({"before": before.flash_attn_varlen_func} if before else {})}
    fns = {f"{name}{' deterministic' if det else ''}":
           (lambda f=f, det=det: f(q, k, v, cu, cu, m, m, causal=True, deterministic=det).backward(grad))
           for det in (False, True) for name, f in modules.items()}
    fns["SDPA flash dense 4x512"] = sdpa
    for f in fns.values():
        for _ in range(5):
            f()
    figures = host_blocks(fns, blocks, 25)
    print(f"lengths {lengths}, {h} heads: host us a step, median of {blocks} blocks (range)")
    for name, xs in figures.items():
        print(f"  {name:24s} {statistics.median(xs):7.1f} ({min(xs):.0f}-{max(xs):.0f})")
    if before:
        ratio = [a / b for a, b in zip(figures["now"], figures["before"])]
        print(f"  now / before, by block: {statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f})")
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        a.record()
        fns["now"]()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    print(f"  GPU us a step (now): {statistics.median(times):.0f}")
