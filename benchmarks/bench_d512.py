#!/usr/bin/env python3
"""head_dim 512 (Gemma 4's global layers): the forward's TFLOP/s beside torch SDPA's backends
that take the shape and beside the same run's matmul ceiling, and decode's bytes per second
beside the same run's copy bandwidth (docs/design.md, "Head dims").

Per cell (bf16, batch x seqlen, heads q:kv, causal or not): ours (fa4_aot.torch.flash_attn_fwd),
each SDPA backend that accepts head_dim 512 (cuDNN, efficient, math; "-" where one refuses
or would not fit), and "x matmul": ours over torch.mm's bf16 TFLOP/s on 8192^3 in the same
round. FLOPs 4 B H S_q S_k d, halved when causal. Decode (flash_attn_with_kvcache, one
query token, contiguous and paged 64-key caches, the split count its policy picks): K and
V bytes over the time, "x copy" over bench_decode's device-to-device copy in the same round. The cells run in ``--rounds`` interleaved
rounds; each figure the median of its rounds, the range beside it.

    PYTHONPATH=$PWD python benchmarks/bench_d512.py [--rounds 2] [--out DIR] [--kernels DIR]
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
from bench_attention import bench  # noqa: E402

import timing  # noqa: E402
from bench_decode import copy_bandwidth  # noqa: E402

import fa4_aot  # noqa: E402
from fa4_aot.torch import flash_attn_fwd, flash_attn_with_kvcache  # noqa: E402

D = 512
# (batch, seqlen, heads_q, heads_kv): 8k+ tokens (the bar), MHA and GQA 2
CELLS = [(2, 4096, 8, 8), (1, 8192, 8, 8), (1, 16384, 8, 4), (4, 8192, 8, 4)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}
MATH_MAX_BYTES = 8 << 30  # the math backend's S and P: skipped past this
# decode: (batch, cache keys, heads_q, heads_kv, page size or None)
DECODE_CELLS = [(8, 32768, 8, 4, None), (8, 32768, 8, 4, 64), (1, 131072, 8, 4, None), (32, 4096, 8, 1, 64)]


def decode_cell(b, n, hq, hkv, page):
    q = torch.randn(b, 1, hq, D, device="cuda", dtype=torch.bfloat16)
    if page is None:
        k, v = (torch.randn(b, n, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = None
    else:
        pages = b * n // page
        k, v = (torch.randn(pages, page, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, n // page)
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    ms = timing.bench(lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, page_table=table))
    return {"batch": b, "keys": n, "heads_q": hq, "heads_kv": hkv, "page": page,
            "tbps": 2 * b * n * hkv * D * 2 / ms / 1e9}


def attention_flops(b, s, h, causal):
    f = 4 * b * h * s * s * D
    return f / 2 if causal else f


def matmul_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    ms = bench(lambda: torch.mm(a, a, out=c))
    return 2 * 8192 ** 3 / ms / 1e9


def cell(b, s, hq, hkv, causal):
    q = torch.randn(b, s, hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = flash_attn_fwd(q, k, v, causal=causal)
    f = attention_flops(b, s, hq, causal)
    row = {"batch": b, "seqlen": s, "heads_q": hq, "heads_kv": hkv, "causal": causal,
           "ours": f / bench(lambda: flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse)) / 1e9}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    for name, backend in BACKENDS.items():
        row[name] = None
        if name == "math" and 2 * b * hq * s * s * 4 > MATH_MAX_BYTES:
            continue
        try:
            with sdpa_kernel(backend):
                def attend():
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hq != hkv)
                attend()
                row[name] = f / bench(attend) / 1e9
        except RuntimeError:
            pass
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--kernels", type=Path, default=None, help="a built folder instead of the package's cubins")
    timing.add_argument(ap)
    args = ap.parse_args()
    timing.configure(args)
    if args.kernels:
        fa4_aot.set_default_library(fa4_aot.KernelLibrary(args.kernels))
    rounds, ceilings, decodes, copies = [], [], [], []
    for _ in range(args.rounds):
        ceilings.append(matmul_tflops())
        rounds.append([cell(*c, causal) for c in CELLS for causal in (False, True)])
        copies.append(copy_bandwidth(timing.bench) / 1e12)
        decodes.append([decode_cell(*c) for c in DECODE_CELLS])
    ceiling = statistics.median(ceilings)
    rows = []
    for cells in zip(*rounds):
        row = dict(cells[0])
        for key in ("ours", *BACKENDS):
            figures = [c[key] for c in cells]
            row[key] = None if None in figures else statistics.median(figures)
            row[key + "_rounds"] = figures
        rows.append(row)
    lines = [f"matmul (bf16 8192^3): {ceiling:.0f} TFLOP/s (rounds {', '.join(f'{c:.0f}' for c in ceilings)})",
             "| b x s | heads | causal | ours TFLOP/s | x matmul | cuDNN | efficient | math | ours / best SDPA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        span = r["ours_rounds"]
        peers = [r[k] for k in BACKENDS if r[k] is not None]
        cols = " | ".join("-" if r[k] is None else f"{r[k]:.0f}" for k in BACKENDS)
        best = f"{r['ours'] / max(peers):.2f}" if peers else "-"
        lines.append(f"| {r['batch']} x {r['seqlen']} | {r['heads_q']}:{r['heads_kv']} | {r['causal']} | "
                     f"{r['ours']:.0f} ({min(span):.0f}-{max(span):.0f}) | {r['ours'] / ceiling:.2f} | {cols} | {best} |")
    copy = statistics.median(copies)
    lines += ["", f"device-to-device copy: {copy:.2f} TB/s (rounds {', '.join(f'{c:.2f}' for c in copies)})",
              "| decode b x keys | heads | page | TB/s | x copy |", "|---|---|---|---|---|"]
    decode_rows = []
    for cells in zip(*decodes):
        row = dict(cells[0])
        figures = [c["tbps"] for c in cells]
        row["tbps"], row["tbps_rounds"] = statistics.median(figures), figures
        decode_rows.append(row)
        lines.append(f"| {row['batch']} x {row['keys']} | {row['heads_q']}:{row['heads_kv']} | {row['page'] or '-'} | "
                     f"{row['tbps']:.2f} ({min(figures):.2f}-{max(figures):.2f}) | {row['tbps'] / copy:.2f} |")
    text = "\n".join(lines)
    print(text)
    date = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"d512-{date}.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "date": date, "clear_l2": timing.MODE["clear"], "rounds": args.rounds,
         "matmul_tflops": ceilings, "rows": rows, "copy_tbps": copies, "decode_rows": decode_rows, "table": text}, indent=1))


if __name__ == "__main__":
    main()
