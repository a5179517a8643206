"""Host time of a training step's attention (forward + backward through autograd, causal, bf16,
d64) on an sm_90 GPU: fa4_aot's flash_attn_func, SDPA's flash backend, a floor (a Python
autograd.Function that allocates what fa4_aot's allocates and launches nothing: torch's autograd
machinery and the allocations alone), and optionally an older fa4_aot.torch.autograd module
beside the current one (``--before FILE``: its source, e.g. from ``git show REV:...``).

Each step timed alone (the GPU idle at its start); blocks of 25 steps, the layers taking turns
in alternating order; per layer the median of the blocks' medians (range), and per layer the
median of the blocks' ratios to SDPA flash (the layers of one block met the same host).

    PYTHONPATH=$PWD python benchmarks/experiments/host_step_floor.py [--blocks 16] [--before FILE] [--out JSON]
"""
import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from fa4_aot.torch import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import timing  # noqa: E402 (benchmarks/timing.py)

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--blocks", type=int, default=16)
ap.add_argument("--before", default=None, help="an older fa4_aot/torch/autograd.py to time beside")
ap.add_argument("--out", default=None)
args = ap.parse_args()

class Floor(torch.autograd.Function):
    """What flash_attn_func's Function allocates and saves, and no launch."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, deterministic, left, right, softcap, sink):
        b, s, h, _ = q.shape
        out = q.new_empty(q.shape)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        torch.empty(1 << 16, dtype=torch.uint8, device=q.device)  # the workspace
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *[None] * 7


def sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)


RESULTS = {}
LAYERS = {"fa4_aot": lambda q, k, v: flash_attn_func(q, k, v, causal=True), "sdpa_flash": sdpa,
          "floor": lambda q, k, v: Floor.apply(q, k, v, True, 0.125, False, -1, -1, 0.0, None)[0]}
if args.before:
    spec = importlib.util.spec_from_file_location("fa4_aot.torch._before_autograd", args.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    LAYERS["fa4_aot_before"] = lambda q, k, v: before.flash_attn_func(q, k, v, causal=True)
for size in [(1, 128, 8), (4, 512, 12), (8, 1024, 12)]:
    b, s, h = size
    q, k, v = (torch.randn(b, s, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, s, h, 64, device="cuda", dtype=torch.bfloat16)
    steps = {n: (lambda f=f: f(q, k, v).backward(grad)) for n, f in LAYERS.items()}
    for f in steps.values():
        for _ in range(20):
            f()
    torch.cuda.synchronize()
    res = timing.host_blocks(steps, args.blocks, 25)
    line = " | ".join(f"{n} {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for n, v in res.items())
    ratios = " ".join(f"{n} {statistics.median(a / b for a, b in zip(v, res['sdpa_flash'])):.3f}" for n, v in res.items())
    print(f"{size}: host us/step: {line} | x sdpa_flash (median of the blocks' ratios): {ratios}")
    RESULTS[str(size)] = res
if args.out:
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "blocks_us": RESULTS}, f, indent=1)
