"""Where an FP8 decode's scores S lose precision, on the GPU (docs/design.md, "FP8 cache").

A decode over a cache of one key returns LSE = scale * S exactly (one key: the row's sum is
1, its log 0), so a batch of one-key sequences reads the kernel's S for any (q row, key):
this compares it, in logit units, with the exact S of q's two e4m3 terms and the key
(float64), with torch._scaled_mm's FP8 GEMM of the same terms (fast accumulation and not),
with the FP8 GEMM done as fresh accumulators per 32 columns summed in float32, and with the
16-bit rounding of S that a 16-bit twin adds; first, cuBLAS's FP8 GEMM alone in the tests'
twin shapes (``twin_shapes``: both term orders, fast accumulation and not).

    PYTHONPATH=$PWD python benchmarks/experiments/fp8_s_probe.py [--kernels DIR] [--out F.json]
"""

import argparse
import json
import math

import torch

import fa4_aot

E4M3 = torch.float8_e4m3fn


def q_terms(q, cuda_division=False):
    """q's rows as the FP8 kernels take them: fp16 values scaled to +-448, two e4m3 terms.
    ``cuda_division``: the row's scale as torch on CUDA computed ``amax / 448`` (a multiply
    by fl(1/448)), the tests' terms before session 38."""
    # the kernel's float32 steps exactly (amax / 448, 1 / scale, x * inv, each rounded once):
    # in float64 rounded to float32 after each; on CUDA, torch's division by a Python number
    # is a multiply by its rounded reciprocal, a bit off in half the rows (tests/reference.py)
    x = q.to(torch.float16).float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = (amax.double() * float(torch.tensor(1 / 448.0))) if cuda_division else amax.double() / 448.0
    rs = torch.where(amax > 0, scale.float(), torch.ones_like(amax))
    x = (x.double() * (1.0 / rs.double()).float().double()).float()
    first = x.to(E4M3)
    return first, (x - first.float()).to(E4M3), rs


def gemm(x, y, fast):
    """Row-wise dot products of e4m3 x (n, k) and y (n, k) through torch._scaled_mm, one
    (16 x k) @ (k x 16) GEMM per 16 rows (the diagonal kept)."""
    n, k = x.shape
    pad = -n % 16
    x = torch.nn.functional.pad(x.view(torch.uint8), (0, 0, 0, pad)).view(E4M3).view(-1, 16, k)
    y = torch.nn.functional.pad(y.view(torch.uint8), (0, 0, 0, pad)).view(E4M3).view(-1, 16, k)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    out = []
    for a, b in zip(x, y):
        c = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        out.append(c.diagonal())
    return torch.cat(out)[:n]


def stats(err, unit):
    e = (err / unit).abs()
    return {"rms": e.square().mean().sqrt().item(), "max": e.max().item(), "p99": e.quantile(0.99).item()}


def one_key_scores(d, heads_q, heads_kv, dtype, spread, gen):
    """(q (b, 1, h_q, d), k8 (b, 1, h_kv, d) e4m3, the kernel's S (b * h_q,) float64) of
    4096 rows: fresh q (randn times ``spread``, in ``dtype``) and one e4m3 key per sequence,
    S read back from a one-key decode's LSE (LSE = scale x S)."""
    b = 4096 // heads_q
    q = (torch.randn(b, 1, heads_q, d, device="cuda", generator=gen) * spread).to(dtype)
    k8 = torch.randn(b, 1, heads_kv, d, device="cuda", generator=gen).to(E4M3)
    v8 = torch.randn(b, 1, heads_kv, d, device="cuda", generator=gen).to(E4M3)
    out = torch.full((b, 1, heads_q, d), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((b, heads_q, 1), float("nan"), device="cuda")
    lengths = torch.ones(b, dtype=torch.int32, device="cuda")
    need = fa4_aot.forward_kvcache_workspace_bytes(b, 1, heads_q, heads_kv, d, 1, num_splits=1)
    space = torch.zeros(max(need, 1), dtype=torch.uint8, device="cuda")
    fa4_aot.forward_kvcache(q, k8, v8, out, lse, lengths, space if need else None, num_splits=1,
                            stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return q, k8, (lse[:, :, 0].double() / (1.0 / math.sqrt(d))).reshape(-1)


def probe(d, heads, dtype, spread, gen):
    q, k8, s_kernel = one_key_scores(d, heads, heads, dtype, spread, gen)
    scale = 1.0 / math.sqrt(d)
    first, rest, row_scale = q_terms(q[:, 0])  # (b, heads, d)
    rs = row_scale.reshape(-1).double()
    f, r, kk = first.reshape(-1, d), rest.reshape(-1, d), k8[:, 0].reshape(-1, d)
    exact = ((f.double() + r.double()) * kk.double()).sum(-1) * rs
    both = torch.cat([f, r], -1)
    kk2 = torch.cat([kk, kk], -1)
    fast = gemm(both, kk2, True).double() * rs
    slow = gemm(both, kk2, False).double() * rs
    chunks = sum(gemm(both[:, i:i + 32].contiguous(), kk2[:, i:i + 32].contiguous(), True).double()
                 for i in range(0, 2 * d, 32)) * rs
    first_only = gemm(f.contiguous(), kk.contiguous(), True).double() * rs
    terms_apart = first_only + gemm(r.contiguous(), kk.contiguous(), True).double() * rs
    rest_first = gemm(torch.cat([r, f], -1), kk2, True).double() * rs
    s16 = (exact * scale).to(dtype).double() / scale  # S rounded to the 16-bit dtype (the twin's rounding)
    # the unit: one logit (S * scale)
    unit = 1.0 / scale
    return {
        "head_dim": d, "heads": heads, "dtype": str(dtype).split(".")[-1], "q_spread": spread,
        "rows": int(exact.numel()), "exact_S_logit_rms": (exact / unit).square().mean().sqrt().item(),
        "kernel_vs_exact": stats(s_kernel - exact, unit),
        "scaled_mm_fast_vs_exact": stats(fast - exact, unit),
        "scaled_mm_slow_vs_exact": stats(slow - exact, unit),
        "chunks32_vs_exact": stats(chunks - exact, unit),
        "first_term_only_vs_exact": stats(first_only - exact, unit),
        "terms_apart_vs_exact": stats(terms_apart - exact, unit),
        "rest_first_vs_exact": stats(rest_first - exact, unit),
        "s16_rounding_vs_exact": stats(s16 - exact, unit),
        "kernel_vs_scaled_mm_fast": stats(s_kernel - fast, unit),
        "kernel_equals_fast_frac": (s_kernel.float() == fast.float()).float().mean().item(),
    }


def twin_shapes(gen):
    """The tests' twin GEMM shapes: (s_q rows, padded to 16) x 2d @ 2d x n keys through
    torch._scaled_mm, both term orders, fast accumulation and not, against float64."""
    rows = []
    for d in (64, 128, 256):
        for s_q, n in ((1, 640), (4, 640), (16, 300), (64, 2048)):
            q = torch.randn(s_q, d, device="cuda", generator=gen).to(torch.float16)
            k8 = torch.randn(n, d, device="cuda", generator=gen).to(E4M3)
            first, rest, rs = q_terms(q)
            exact = ((first.double() + rest.double()) @ k8.double().t()) * rs.double()
            unit = math.sqrt(d)
            row = {"head_dim": d, "s_q": s_q, "keys": n}
            for name, a in (("first_rest", torch.cat([first, rest], -1)), ("rest_first", torch.cat([rest, first], -1))):
                for fast in (True, False):
                    m_pad = -s_q % 16
                    x = torch.nn.functional.pad(a.view(torch.uint8), (0, 0, 0, m_pad)).view(E4M3)
                    one = torch.ones((), dtype=torch.float32, device="cuda")
                    y = torch.nn.functional.pad(torch.cat([k8, k8], -1).view(torch.uint8), (0, 0, 0, -n % 16)).view(E4M3)
                    c = torch._scaled_mm(x, y.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                         use_fast_accum=fast)[:s_q, :n].double() * rs.double()
                    row[f"{name}_{'fast' if fast else 'slow'}"] = stats(c - exact, unit)["rms"]
            s16 = (exact / unit).to(torch.float16).double() * unit
            row["s16_rounding"] = stats(s16 - exact, unit)["rms"]
            rows.append(row)
            print(json.dumps(row))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.kernels:
        from pathlib import Path
        fa4_aot.set_default_library(fa4_aot.KernelLibrary(Path(args.kernels)))
    gen = torch.Generator(device="cuda").manual_seed(1)
    twin = twin_shapes(gen)
    rows = []
    for d in (64, 128, 256):
        for dtype in (torch.float16, torch.bfloat16):
            for spread in (1.0, 4.0):
                row = probe(d, 8, dtype, spread, gen)
                rows.append(row)
                print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "twin_shapes": twin}, f, indent=1)


if __name__ == "__main__":
    main()
