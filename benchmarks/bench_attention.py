#!/usr/bin/env python3
"""Attention benchmark on the GPU (forward, and with --bwd the backward), from the built
cubins, against cuDNN.

Run on an sm_90 GPU:  python benchmarks/bench_attention.py --out results/ [--bwd]
Writes fwd-<dtype>.json (every figure, with the GPU and the date) and, where matplotlib is
installed, fwd-<dtype>.png (plot_attention.py: TFLOP/s against seqlen per head dim; the
title names the GPU, the date and the shapes; elsewhere plot_attention.py draws it from the
JSON), bwd-* likewise (deterministic too), and prints tables. Needs triton (the ``bench``
extra also has matplotlib). Peers timed in the same process: torch SDPA's cuDNN backend on the same inputs,
and a bf16 8192^3 matmul (the practical ceiling of the tensor cores), timed before the
tables and again after the forward's: its figure moves by up to 10% between runs (clocks,
power), so /matmul is taken against the higher of the two (the stricter ratio).

Method: bf16 unless --dtype says otherwise; layout (batch, seqlen, heads, head_dim);
batch*seqlen = 16384 tokens and heads*head_dim = 2048, seqlen_q = seqlen_k, random normal
inputs. Time = median of CUDA-event timings (triton.testing.do_bench, warmup 50 ms,
rep 200 ms, return_mode="median": the method of the baselines file). With --rounds N the
whole grid runs N times over (round after round, so each cell meets the GPU in N thermal
states) and every time is the median of its N rounds; the JSON keeps each round's
figure. FLOPs = 4*B*H*S*S*D, halved when causal, and 2.5x that for the backward (FA4's
and flash-attn's convention). The backward is timed alone: for
ours the three backward kernels with outputs preallocated, for cuDNN autograd's backward
of its own forward (retain_graph).
"""

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

import fa4_aot

from fa4_aot.torch import flash_attn_fwd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plot_attention beside this file

# FA4 upstream's forward TFLOP/s on this H200, measured in another process on 2026-11-30
# (the same-process comparison: benchmarks/fa4_upstream/).
FA4_UPSTREAM_FWD = {
    (64, 1024, False): 399, (64, 1024, True): 264, (64, 4096, False): 497, (64, 4096, True): 424,
    (64, 16384, False): 542, (64, 16384, True): 512, (128, 1024, False): 546, (128, 1024, True): 408,
    (128, 4096, False): 644, (128, 4096, True): 545, (128, 16384, False): 681, (128, 16384, True): 624,
    (256, 1024, False): 608, (256, 1024, True): 452, (256, 4096, False): 690, (256, 4096, True): 591,
    (256, 16384, False): 722, (256, 16384, True): 687,
    # batch 2, seqlen 8192 (21 heads of 96, 10 of 192): --seqlens 8192 runs this shape
    (96, 8192, False): 593, (96, 8192, True): 554, (192, 8192, False): 689, (192, 8192, True): 647,
}


# FA4 upstream's backward TFLOP/s (same baselines file), and its deterministic backward.
FA4_UPSTREAM_BWD = {
    (64, 1024, False): 414, (64, 1024, True): 314, (64, 4096, False): 502, (64, 4096, True): 451,
    (64, 16384, False): 501, (64, 16384, True): 519, (128, 1024, False): 454, (128, 1024, True): 355,
    (128, 4096, False): 539, (128, 4096, True): 518, (128, 16384, False): 575, (128, 16384, True): 609,
    (256, 1024, False): 306, (256, 1024, True): 247, (256, 4096, False): 327, (256, 4096, True): 336,
    (256, 16384, False): 370, (256, 16384, True): 370,
    (96, 8192, False): 539, (96, 8192, True): 512, (192, 8192, False): 511, (192, 8192, True): 489,
}
FA4_UPSTREAM_BWD_DET = {
    (64, 4096, False): 495, (64, 4096, True): 449, (64, 16384, False): 531, (64, 16384, True): 511,
    (128, 4096, False): 544, (128, 4096, True): 481, (128, 16384, False): 593, (128, 16384, True): 545,
}


def flops(b, h, s, d, causal):
    f = 4 * b * h * s * s * d
    return f / 2 if causal else f


# do_bench's warm-up and measuring windows (ms); --warmup-ms / --rep-ms set them
TIMING = {"warmup": 50, "rep": 200}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=TIMING["warmup"], rep=TIMING["rep"], return_mode="median")


def rounds_median(rounds, flop_keys):
    """One row per cell from ``rounds`` (lists of rows in the same cell order): each time
    the median of its rounds, each TFLOP/s figure recomputed from it, and the rounds'
    figures kept (``<key>_rounds``). flop_keys: time key -> TFLOP/s key."""
    rows = []
    for cells in zip(*rounds):
        row = dict(cells[0])
        for ms_key, tf_key in flop_keys.items():
            row[ms_key] = statistics.median(c[ms_key] for c in cells)
            row[tf_key] = row["flop"] / row[ms_key] / 1e9
            row[tf_key + "_rounds"] = [c[tf_key] for c in cells]
        rows.append(row)
    return rows


def spread(row, key):
    """'lo-hi' of a figure's rounds, or '-' for one round."""
    figures = row.get(key + "_rounds", [])
    return f"{min(figures):.0f}-{max(figures):.0f}" if len(figures) > 1 else "-"


def matmul_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return 2 * 8192**3 / ms / 1e9


def run_case(d, s, causal, dtype):
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    ours = bench(lambda: flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    f = flops(b, h, s, d, causal)
    return {"head_dim": d, "seqlen": s, "causal": causal, "dtype": str(dtype).split(".")[-1],
            "batch": b, "heads": h, "flop": f, "ms": ours, "cudnn_ms": cudnn,
            "tflops": f / ours / 1e9, "cudnn_tflops": f / cudnn / 1e9}


def run_bwd_case(d, s, causal, dtype):
    from fa4_aot.torch import flash_attn_bwd

    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(4))
    out, lse = flash_attn_fwd(q, k, v, causal=causal)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    timing = {}
    for det in (False, True):
        timing[det] = bench(lambda: flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=det,
                                                   dq=grads[0], dk=grads[1], dv=grads[2]))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        g = dout.transpose(1, 2)
        cudnn = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))
    f = 2.5 * flops(b, h, s, d, causal)
    return {"head_dim": d, "seqlen": s, "causal": causal, "batch": b, "heads": h, "flop": f,
            "ms": timing[False], "det_ms": timing[True], "cudnn_ms": cudnn,
            "tflops": f / timing[False] / 1e9, "det_tflops": f / timing[True] / 1e9,
            "cudnn_tflops": f / cudnn / 1e9}


def cells(args):
    return [(d, s, causal) for d in args.head_dims for s in args.seqlens for causal in (False, True)]


def bwd_table(args, dtype, mm):
    rounds = [[run_bwd_case(d, s, causal, dtype) for d, s, causal in cells(args)] for _ in range(args.rounds)]
    rows = rounds_median(rounds, {"ms": "tflops", "det_ms": "det_tflops", "cudnn_ms": "cudnn_tflops"})
    for r in rows:
        cell = (r["head_dim"], r["seqlen"], r["causal"])
        r["fa4_upstream_tflops"] = FA4_UPSTREAM_BWD.get(cell) if args.dtype == "bf16" else None
        r["fa4_upstream_det_tflops"] = FA4_UPSTREAM_BWD_DET.get(cell) if args.dtype == "bf16" else None
    result = {"direction": "backward", "dtype": args.dtype, "matmul_tflops": mm, "rounds": args.rounds,
              "timing_ms": TIMING, "device": torch.cuda.get_device_name(), "date": TODAY, "rows": rows}
    (args.out / f"bwd-{args.dtype}{args.tag}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"bwd-{args.dtype}{args.tag}.png")
    print(f"\nbackward (median of {args.rounds} round(s); rounds: the range of ours over them)")
    print("| head_dim | seqlen | causal | fa4_aot | rounds | /cuDNN | /FA4 | deterministic | det/nondet | /FA4 det |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fa4 = f"{r['tflops'] / r['fa4_upstream_tflops']:.2f}" if r["fa4_upstream_tflops"] else "-"
        fa4d = f"{r['det_tflops'] / r['fa4_upstream_det_tflops']:.2f}" if r["fa4_upstream_det_tflops"] else "-"
        print(f"| {r['head_dim']} | {r['seqlen']} | {'yes' if r['causal'] else 'no'} | {r['tflops']:.0f} | "
              f"{spread(r, 'tflops')} | {r['tflops'] / r['cudnn_tflops']:.2f} ({r['cudnn_tflops']:.0f}) | {fa4} | "
              f"{r['det_tflops']:.0f} | {r['det_tflops'] / r['tflops']:.2f} | {fa4d} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 96, 128, 192, 256])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--bwd", action="store_true", help="also time the backward")
    p.add_argument("--no-fwd", action="store_true", help="skip the forward table")
    p.add_argument("--kernels", type=Path, help="time the cubins of this build folder (default: the package's)")
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--rounds", type=int, default=1, help="runs of the whole grid; each time their median")
    p.add_argument("--warmup-ms", type=float, default=TIMING["warmup"], help="do_bench warm-up per timing")
    p.add_argument("--rep-ms", type=float, default=TIMING["rep"], help="do_bench measuring window per timing")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    TIMING.update(warmup=args.warmup_ms, rep=args.rep_ms)
    if args.kernels:
        from fa4_aot.launch.loader import KernelLibrary

        fa4_aot.set_default_library(KernelLibrary(args.kernels))  # what the adapters launch from
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    args.out.mkdir(parents=True, exist_ok=True)
    mm = matmul_tflops()
    if args.bwd:
        bwd_table(args, dtype, mm)
    if args.no_fwd:
        return
    rounds = [[run_case(d, s, causal, dtype) for d, s, causal in cells(args)] for _ in range(args.rounds)]
    rows = rounds_median(rounds, {"ms": "tflops", "cudnn_ms": "cudnn_tflops"})
    for r in rows:
        r["vs_cudnn"] = r["tflops"] / r["cudnn_tflops"]
        base = FA4_UPSTREAM_FWD.get((r["head_dim"], r["seqlen"], r["causal"])) if args.dtype == "bf16" else None
        r["fa4_upstream_tflops"] = base
        r["vs_fa4_upstream"] = r["tflops"] / base if base else None
    mm_runs = [mm, matmul_tflops()]
    mm = max(mm_runs)
    for r in rows:
        r["vs_matmul"] = r["tflops"] / mm
    result = {"direction": "forward", "dtype": args.dtype, "matmul_tflops": mm, "matmul_tflops_runs": mm_runs,
              "device": torch.cuda.get_device_name(),
              "date": TODAY, "rows": rows,
              "rounds": args.rounds, "timing_ms": TIMING, "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version()}
    (args.out / f"fwd-{args.dtype}{args.tag}.json").write_text(json.dumps(result, indent=1))
    print(f"bf16 8192^3 matmul: {mm_runs[0]:.0f} TFLOP/s before the tables, {mm_runs[1]:.0f} after the forward's, "
          f"on {result['device']} (/matmul: against {mm:.0f})")
    print(f"forward (median of {args.rounds} round(s); rounds: the range of ours over them)")
    print("| head_dim | seqlen | causal | fa4_aot | rounds | cuDNN | /cuDNN | FA4 upstream | /FA4 | /matmul |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = f"{r['fa4_upstream_tflops']}" if r["fa4_upstream_tflops"] else "-"
        vs = f"{r['vs_fa4_upstream']:.2f}" if r["vs_fa4_upstream"] else "-"
        print(f"| {r['head_dim']} | {r['seqlen']} | {'yes' if r['causal'] else 'no'} | {r['tflops']:.0f} | "
              f"{spread(r, 'tflops')} | {r['cudnn_tflops']:.0f} | {r['vs_cudnn']:.2f} | {base} | {vs} | "
              f"{r['vs_matmul']:.2f} |")
    plot(result, args.out / f"fwd-{args.dtype}{args.tag}.png")


TODAY = datetime.date.today().isoformat()


def plot(result: dict, path: Path) -> None:
    """The result's plot (plot_attention.py), or where matplotlib is missing (the H200's
    image) a line saying how to render it from the JSON elsewhere."""
    try:
        import plot_attention
    except ImportError as e:
        print(f"plot not drawn ({e}): python benchmarks/plot_attention.py {path.with_suffix('.json')}")
        return
    plot_attention.render(result, path)


if __name__ == "__main__":
    main()
