"""Is PyTorch's own FP8 GEMM, run in the kernel's accumulator chains, the FP8 decode's S bit
for bit? (issue 40: the tests' "same math by PyTorch" for S from FP8 wgmmas; docs/design.md,
"FP8 cache", Tolerances.)

The chains build's decode (docs/history/2026-12-05-fp8-s-chains.patch) computes S = Q K^T from
q's two e4m3 terms (first, rest) against the e4m3 key: accumulator 0 takes the rest term's
32-column k-blocks, then the first term's first ``chain`` k-blocks; accumulator j > 0 takes
the first term's k-blocks [j chain, (j + 1) chain), each from zero; the accumulators are added
in float32 in order. ``torch._scaled_mm`` (fast accumulation: no promotion) of the same
operands, one GEMM per accumulator with k = its columns, runs the same wgmma k-steps; whether
it rounds as the kernel does is what this measures. A one-key decode returns LSE = scale x S
(fp8_s_probe.py), so 4096 one-key sequences read the kernel's S per (row, key).

    PYTHONPATH=$PWD python benchmarks/experiments/fp8_chain_twin.py --kernels build/fp8full [--out F.json]

Per head dim, consumer (narrow: 4 query heads a KV head, one token; rows: 32 a KV head) and
q's spread: the share of S bitwise equal to the chained GEMMs, the RMS and largest
difference in logits, against the same for one GEMM over [first | rest] (session 37's
twin) and for S rounded to 16 bits (the current tests' twin).
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "experiments")]

import fa4_aot  # noqa: E402
from fp8_s_probe import gemm, one_key_scores, q_terms  # noqa: E402

# the chains build's config (decode/config.py there): first-chain k-blocks by head dim, row-major
# consumer; the transposed (narrow) consumer's chains are one k-block
CHAIN_KBLOCKS = {64: 1, 96: 2, 128: 2, 192: 2, 256: 4}
NARROW_CHAIN_KBLOCKS = 1
NARROW_ROWS = 16  # packed rows a KV head up to which the transposed consumer runs (not where d % 64)


def chained(first, rest, key, chain):
    """S as the kernel's accumulators: [rest | first's first chain] then each further chain
    of first's k-blocks from zero, added in float32 in order."""
    d, c = first.shape[-1], 32 * chain
    s = gemm(torch.cat([rest, first[:, :c]], -1).contiguous(), torch.cat([key, key[:, :c]], -1).contiguous(), True)
    for j in range(c, d, c):
        s = s + gemm(first[:, j:j + c].contiguous(), key[:, j:j + c].contiguous(), True)
    return s


def probe(d, heads_q, heads_kv, dtype, spread, gen):
    q, k8, s_kernel = one_key_scores(d, heads_q, heads_kv, dtype, spread, gen)
    scale = 1.0 / math.sqrt(d)
    first, rest, row_scale = q_terms(q[:, 0])  # (b, heads_q, d)
    group = heads_q // heads_kv
    key = k8[:, 0].repeat_interleave(group, dim=1)  # each query head's KV head
    f, r, kk, rs = first.reshape(-1, d), rest.reshape(-1, d), key.reshape(-1, d), row_scale.reshape(-1).double()
    exact = ((f.double() + r.double()) * kk.double()).sum(-1) * rs
    narrow = group <= NARROW_ROWS and d % 64 == 0  # the chains build's narrow_rows rule
    chain = NARROW_CHAIN_KBLOCKS if narrow else CHAIN_KBLOCKS[d]
    twin = chained(f, r, kk, chain).double() * rs
    one_gemm = gemm(torch.cat([f, r], -1).contiguous(), torch.cat([kk, kk], -1).contiguous(), True).double() * rs
    s16 = (exact * scale).to(dtype).double() / scale
    unit = 1.0 / scale  # one logit

    def diff(x):
        e = ((s_kernel - x) / unit).abs()
        return {"rms": e.square().mean().sqrt().item(), "max": e.max().item(),
                "equal": (s_kernel.float() == x.float()).float().mean().item()}

    return {"head_dim": d, "heads": f"{heads_q}:{heads_kv}", "consumer": "narrow" if narrow else "rows",
            "chain_kblocks": chain, "dtype": str(dtype).split(".")[-1], "q_spread": spread, "rows": int(exact.numel()),
            "kernel_vs_chained_scaled_mm": diff(twin), "kernel_vs_one_scaled_mm": diff(one_gemm),
            "kernel_vs_s16": diff(s16), "kernel_vs_exact": diff(exact),
            "chained_vs_exact_rms": (((twin - exact) / unit).square().mean().sqrt()).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.kernels:
        fa4_aot.set_default_library(fa4_aot.KernelLibrary(Path(args.kernels)))
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for d in (64, 96, 128, 192, 256):
        for heads in ((4, 4), (32, 1)):
            for dtype in (torch.float16, torch.bfloat16):
                for spread in (1.0, 4.0):
                    row = probe(d, *heads, dtype, spread, gen)
                    rows.append(row)
                    c, o = row["kernel_vs_chained_scaled_mm"], row["kernel_vs_one_scaled_mm"]
                    print(f"d{d} {row['heads']} {row['dtype']} x{spread}: chained equal {c['equal']:.3f} "
                          f"rms {c['rms']:.2e} max {c['max']:.2e} | one GEMM equal {o['equal']:.3f} rms {o['rms']:.2e}"
                          f" | s16 rms {row['kernel_vs_s16']['rms']:.2e} | exact rms {row['kernel_vs_exact']['rms']:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
