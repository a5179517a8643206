"""Where the varlen backward's time goes on 1 x 16384 + 63 x 256 (head_dim 128 bf16, 16
heads), the mix where it trails FA4 upstream's varlen by 1-2.5% (same process): the long
sequence alone as a varlen batch of one, against our dense backward on (1, 16384) with its
split last wave (docs/design.md, "Backward: split last wave") and with the split turned
off (causal does not split: that cell and a second set of inputs show the noise
between cells); and the 63 short sequences alone. Times in us, median of do_bench (50/200 ms), rounds
interleaved, the range over rounds in brackets.

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_bwd_long_gap.py ROUNDS
"""
import statistics
import sys

import torch
import triton.testing

import fa4_aot
from fa4_aot import dense as api, policy
from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd, flash_attn_varlen_bwd, flash_attn_varlen_fwd

D, H = 128, 16


def varlen_cell(lengths, causal):
    total, longest = sum(lengths), max(lengths)
    q, k, v, dout = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    out, lse = flash_attn_varlen_fwd(q, k, v, cu, cu, longest, longest, causal=causal)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    space = torch.empty(fa4_aot.backward_varlen_workspace_bytes(total, len(lengths), H, D, causal=causal),
                        dtype=torch.uint8, device="cuda")
    return lambda: flash_attn_varlen_bwd(q, k, v, out, dout, lse, cu, cu, longest, longest, causal=causal,
                                         dq=dq, dk=dk, dv=dv, workspace=space, order="plain")


def dense_cell(s, causal, split):
    q, k, v, dout = (torch.randn(1, s, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = flash_attn_fwd(q, k, v, causal=causal)
    real = policy.backward_tail_split

    def run():
        if not split:
            api.policy.backward_tail_split = lambda *a: (0, 1)
        try:
            flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)
        finally:
            api.policy.backward_tail_split = real
    return run


rounds = int(sys.argv[1])
for causal in (False, True):
    cells = {
        "dense 1x16384 (split last wave)": dense_cell(16384, causal, True),
        "dense 1x16384 (split), other inputs": dense_cell(16384, causal, True),
        "dense 1x16384, no split": dense_cell(16384, causal, False),
        "varlen [16384]": varlen_cell([16384], causal),
        "varlen 1x16384+63x256": varlen_cell([16384] + [256] * 63, causal),
        "varlen 63x256": varlen_cell([256] * 63, causal),
    }
    times = {name: [] for name in cells}
    for r in range(rounds):
        for name in (list(cells) if r % 2 == 0 else list(cells)[::-1]):
            times[name].append(1000 * triton.testing.do_bench(cells[name], warmup=50, rep=200, return_mode="median"))
    print(f"\ncausal={causal} (us)")
    for name, ts in times.items():
        print(f"  {name:34s} {statistics.median(ts):9.1f} ({min(ts):.1f}-{max(ts):.1f})  rounds: "
              + " ".join(f"{t:.0f}" for t in ts))
