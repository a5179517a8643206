#!/usr/bin/env python3
"""Head dims between the built ones (docs/design.md, "Head dims"): each runs on the narrowest
built head dim at least as wide, with zeros past its columns; and v's head dim apart from
q's (DeepSeek V3's 192/128, MHA and GQA 4). Per cell, forward and backward TFLOP/s (counted
at the cell's own head dims) of ours, of ours at the kernel's own width D on the same
batch, heads and tokens (the dedicated variant it rides on), and of cuDNN at the cell's
head dims (torch SDPA's cuDNN backend; "-" where it refuses them), in one process.

"x own" is d's TFLOP/s over D's: the share of the variant's own rate that d keeps; the
arithmetic alone predicts d / D (the kernel computes D columns either way).

Method: bf16, (batch, seqlen, heads, d) with batch 4, seqlen 4096 and heads 2048 // d
(the dense benchmark's 16k tokens and about 2048 head columns; 16 heads for 192/128);
FLOPs 2 B H S^2 (d + d_v), halved when causal, 2.5x for the backward; bench_attention.bench (triton do_bench medians); the
cells run in ``--rounds`` interleaved rounds, each figure the median of its rounds with
the range beside it.

    PYTHONPATH=$PWD python benchmarks/bench_head_dims.py [--rounds 2] [--out DIR]
"""

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import bench, flops  # noqa: E402

from fa4_aot.launch.calls import default_library  # noqa: E402
from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd  # noqa: E402

# (q/k head dim, v head dim, query heads per KV head)
CELLS = [(d, d, 1) for d in (32, 40, 72, 80, 104, 112, 160, 200)] + [(192, 128, 1), (192, 128, 4)]
BATCH, SEQLEN = 4, 4096


def pair_flops(b, h, s, d, dv, causal):
    f = 2 * b * h * s * s * (d + dv)
    return f / 2 if causal else f


def _inputs(b, s, h, d, dv, group, layout="bshd"):
    """q, k, v, dout of bf16 random normal: (b, s, h, d) (k, v with h // group heads, v and
    dout d_v wide), or SDPA's (b, h, s, d) where ``layout`` is "bhsd"."""
    shapes = [(h, d), (h // group, d), (h // group, dv), (h, dv)]
    made = [torch.randn(b, s, heads, width, device="cuda", dtype=torch.bfloat16) for heads, width in shapes]
    return made if layout == "bshd" else [t.transpose(1, 2).contiguous() for t in made]


def _ours(b, s, h, d, dv, group, causal):
    """(forward ms, backward ms) of ours."""
    q, k, v, dout = _inputs(b, s, h, d, dv, group)
    out, lse = flash_attn_fwd(q, k, v, causal=causal)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    fwd = bench(lambda: flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse))
    bwd = bench(lambda: flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, dq=grads[0], dk=grads[1],
                                       dv=grads[2]))
    return fwd, bwd


def _cudnn(b, s, h, d, dv, group, causal):
    """(forward ms, backward ms) of SDPA's cuDNN backend, or None where it refuses the shape."""
    q, k, v, dout = _inputs(b, s, h, d, dv, group, "bhsd")
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    attend = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)  # noqa: E731
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fwd = bench(attend)
            o = attend()
            bwd = bench(lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
    except RuntimeError:
        return None
    return fwd, bwd


def cell(d, dv, group, causal):
    kernel_d = default_library().manifest.kernel_head_dim("fwd", max(d, dv))
    h = 16 if d != dv else 2048 // d
    f = pair_flops(BATCH, h, SEQLEN, d, dv, causal)
    f_own = flops(BATCH, h, SEQLEN, kernel_d, causal)
    ours = _ours(BATCH, SEQLEN, h, d, dv, group, causal)
    own = _ours(BATCH, SEQLEN, h, kernel_d, kernel_d, group, causal)
    cudnn = _cudnn(BATCH, SEQLEN, h, d, dv, group, causal)
    row = {"head_dim": d, "head_dim_v": dv, "group": group, "kernel_head_dim": kernel_d, "causal": causal,
           "batch": BATCH, "seqlen": SEQLEN, "heads": h}
    for i, way in enumerate(("fwd", "bwd")):
        scale = 1.0 if way == "fwd" else 2.5
        row[f"{way}_tflops"] = scale * f / ours[i] / 1e9
        row[f"{way}_own_tflops"] = scale * f_own / own[i] / 1e9
        row[f"{way}_cudnn_tflops"] = None if cudnn is None else scale * f / cudnn[i] / 1e9
    return row


def median_rows(rounds):
    rows = []
    for cells in zip(*rounds):
        row = dict(cells[0])
        for key in [k for k in row if k.endswith("tflops") and row[k] is not None]:
            figures = [c[key] for c in cells]
            row[key], row[key + "_rounds"] = statistics.median(figures), figures
        rows.append(row)
    return rows


def table(rows) -> str:
    lines = ["| d / d_v (on D), group | causal | way | ours TFLOP/s | D's own | x own ((d + d_v) / 2D) | cuDNN | "
             "ours/cuDNN |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for way in ("fwd", "bwd"):
            ours, own, cudnn = r[f"{way}_tflops"], r[f"{way}_own_tflops"], r[f"{way}_cudnn_tflops"]
            span = r[f"{way}_tflops_rounds"]
            share = (r["head_dim"] + r["head_dim_v"]) / (2 * r["kernel_head_dim"])
            peer = "- | -" if cudnn is None else f"{cudnn:.0f} | {ours / cudnn:.2f}"
            lines.append(f"| {r['head_dim']} / {r['head_dim_v']} (on {r['kernel_head_dim']}), {r['group']} | "
                         f"{r['causal']} | {way} | {ours:.0f} ({min(span):.0f}-{max(span):.0f}) | {own:.0f} | "
                         f"{ours / own:.2f} ({share:.2f}) | {peer} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    rounds = [[cell(*c, causal) for c in CELLS for causal in (False, True)] for _ in range(args.rounds)]
    rows = median_rows(rounds)
    text = table(rows)
    print(text)
    date = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"head-dims-{date}.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "date": date, "rounds": args.rounds, "rows": rows, "table": text},
        indent=1))


if __name__ == "__main__":
    main()
