"""Host time of a varlen training step's attention (forward + backward, causal, deterministic,
bf16, 12 heads of 64) on an sm_90 GPU: flash_attn_varlen_func's eager path (VarlenAttention)
against the custom ops torch.compile traces (fa4_aot::fwd_varlen with its registered autograd),
in turns (blocks of 20 steps, each step timed alone with the GPU idle at its start; medians);
and whether their outputs and gradients are bitwise equal.

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_step_host.py
"""
import itertools
import math
import statistics
import sys
from pathlib import Path

import torch
from fa4_aot.torch import flash_attn_varlen_func
from fa4_aot.torch import varlen as V

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import timing  # noqa: E402 (benchmarks/timing.py)

def run(lengths, h=12, d=64, blocks=12):
    total = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
    m = max(lengths)
    args = lambda: (q, k, v, cu, cu, m, m, None, None, True, 1 / math.sqrt(d), True, -1, 0, 0.0, None)
    paths = {"eager": lambda: flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True, deterministic=True),
             "ops": lambda: V._fwd_varlen_op(*args())[0]}
    outs = {}
    for n, f in paths.items():
        for x in (q, k, v):
            x.grad = None
        o = f()
        o.backward(grad)
        torch.cuda.synchronize()
        outs[n] = (o.detach().clone(), [x.grad.clone() for x in (q, k, v)])
    same = torch.equal(outs["eager"][0], outs["ops"][0]) and all(torch.equal(a, b) for a, b in zip(outs["eager"][1], outs["ops"][1]))
    steps = {n: (lambda f=f: f().backward(grad)) for n, f in paths.items()}
    for f in steps.values():
        for _ in range(10):
            f()
    res = timing.host_blocks(steps, blocks, 20)
    ratio = statistics.median(a / b for a, b in zip(res["eager"], res["ops"]))
    print(f"{len(lengths)} x {lengths[0]}.. tokens {total}: host us/step eager {statistics.median(res['eager']):.0f} "
          f"({min(res['eager']):.0f}-{max(res['eager']):.0f}) ops {statistics.median(res['ops']):.0f} "
          f"({min(res['ops']):.0f}-{max(res['ops']):.0f}) eager/ops {ratio:.3f} | bitwise equal: {same}")

if __name__ == "__main__":
    run([128, 100, 60, 9])
    run([512, 512, 300, 700])
