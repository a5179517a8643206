"""The FP8 decode's scores S row by row, for analysis off the GPU (docs/design.md, "FP8 cache").

Two reads of the kernel's S through one-key decodes (LSE = scale * S exactly):
- ``readback``: keys that are basis vectors (e4m3 1.0 at column j), so S is q's j-th value
  as the kernel took it (its two e4m3 terms summed, times the row's scale), every product
  but one zero: the kernel's quantization of q, element by element;
- ``scores``: random keys, as fp8_s_probe.py, with every input and the kernel's S saved;
and the tensor cores' FP8 accumulation itself, through ``torch._scaled_mm`` (16 x 16 x K
GEMMs, fast accumulation and not: ``hw``): crafted dot products (one large product and one
small one in the same 32-column k-block, in the next, or before it: what the small one
keeps) and random ones shaped as the kernel's (Q's scaled terms against K), so that a model
of the accumulation can be fitted off the GPU and checked against the kernel's S.
Writes one torch file of CPU tensors.

    PYTHONPATH=$PWD python benchmarks/experiments/fp8_s_dump.py --kernels DIR --out F.pt   (GPU)
    PYTHONPATH=$PWD python benchmarks/experiments/fp8_s_dump.py --analyze F.pt            (anywhere)
"""

import argparse
import math
from pathlib import Path

import torch

import fa4_aot
from fp8_accum_model import first_chain_columns, read_back
from fp8_s_probe import q_terms  # q's terms as the kernel takes them

E4M3 = torch.float8_e4m3fn


def one_key_scores(q, k8):
    """S (b, hq) of q (b, hq, d) against one key a sequence, k8 (b, hkv, d) e4m3, by LSE / scale."""
    b, hq, d = q.shape
    hkv = k8.shape[1]
    qq = q[:, None].contiguous()
    kk = k8[:, None].contiguous()
    vv = torch.zeros_like(kk)
    out = torch.full((b, 1, hq, d), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((b, hq, 1), float("nan"), device="cuda")
    lengths = torch.ones(b, dtype=torch.int32, device="cuda")
    need = fa4_aot.forward_kvcache_workspace_bytes(b, 1, hq, hkv, d, 1, num_splits=1)
    space = torch.zeros(max(need, 1), dtype=torch.uint8, device="cuda")
    fa4_aot.forward_kvcache(qq, kk, vv, out, lse, lengths, space if need else None, num_splits=1,
                            stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return lse[:, :, 0].double() * math.sqrt(d)


def readback(d, hq, hkv, dtype, rows_q, gen):
    """q (rows_q sequences' worth, (r, hq, d)) as the kernel took it: (r, hq, d) float64."""
    q = torch.randn(rows_q, hq, d, device="cuda", generator=gen).to(dtype)
    basis = torch.eye(d, device="cuda").to(E4M3)  # (d, d): row j the j-th basis vector
    qb = q[:, None].expand(rows_q, d, hq, d).reshape(rows_q * d, hq, d)
    kb = basis[None, :, None].expand(rows_q, d, hkv, d).reshape(rows_q * d, hkv, d)
    s = one_key_scores(qb.contiguous(), kb.contiguous())  # (rows_q * d, hq)
    taken = s.view(rows_q, d, hq).permute(0, 2, 1)  # (r, hq, d): column j from key e_j
    return {"q": q.cpu(), "taken": taken.cpu()}


def scores(d, hq, hkv, dtype, rows, gen):
    b = rows // hq
    q = torch.randn(b, hq, d, device="cuda", generator=gen).to(dtype)
    k8 = torch.randn(b, hkv, d, device="cuda", generator=gen).to(E4M3)
    s = one_key_scores(q, k8)
    return {"q": q.cpu(), "k8": k8.view(torch.uint8).cpu(), "s": s.cpu()}


E4M3_VALUES = torch.arange(127, dtype=torch.uint8).view(E4M3).float()  # every finite e4m3 >= 0


def gemms(a, b):
    """a (g, 16, K), b (g, 16, K) e4m3 (CUDA): each a[i] @ b[i]^T through torch._scaled_mm,
    float32 out, fast accumulation and not: (g, 16, 16) twice."""
    one = torch.ones((), dtype=torch.float32, device="cuda")
    outs = {True: [], False: []}
    for x, y in zip(a, b):
        for fast in (True, False):
            outs[fast].append(torch._scaled_mm(x.contiguous(), y.contiguous().t(), scale_a=one, scale_b=one,
                                               out_dtype=torch.float32, use_fast_accum=fast))
    return torch.stack(outs[True]), torch.stack(outs[False])


def crafted(k_dim):
    """Dot products of one large product (A*B at column 0) and one small one (x*1 at column
    ``at``: 1 the same k-block, 32 the next; or the small one first at 0 and the large at 32):
    (g, 16, K) a and b, each row of a a case, b's rows all the same pair of columns' ones."""
    cases = []
    smalls = torch.cat([E4M3_VALUES[1:], -E4M3_VALUES[1:]])  # 252 values
    for big in (448.0 * 448.0, 448.0 * 3.5, -448.0 * 3.5, 448.0, 96.0, 1.0):
        for where in ("same", "next", "before"):
            for x in smalls.tolist():
                cases.append((big, where, x))
    n = -(-len(cases) // 16) * 16
    a = torch.zeros(n, k_dim)
    b = torch.zeros(n, k_dim)
    for i, (big, where, x) in enumerate(cases):
        hi, lo = (0, 1) if where == "same" else ((0, 32) if where == "next" else (32, 0))
        A, B = {448.0 * 448.0: (448.0, 448.0), 448.0 * 3.5: (448.0, 3.5), -448.0 * 3.5: (-448.0, 3.5),
                448.0: (448.0, 1.0), 96.0: (96.0, 1.0), 1.0: (1.0, 1.0)}[big]
        a[i, hi], b[i, hi] = A, B
        a[i, lo], b[i, lo] = x, 1.0
    # b's rows: every case's row of b is its own; the GEMM's 16 x 16 keeps the diagonal useful
    return a.view(-1, 16, k_dim).to(E4M3), b.view(-1, 16, k_dim).to(E4M3), cases


def hardware(gen):
    res = {}
    a, b, cases = crafted(64)
    fast, slow = gemms(a.cuda(), b.cuda())
    res["crafted"] = {"a": a.view(torch.uint8), "b": b.view(torch.uint8), "fast": fast.cpu(), "slow": slow.cpu(),
                      "cases": cases}
    for k_dim in (32, 64, 128, 256):
        # as the kernel's S: a = Q's first term (rows scaled to +-448) or the remainder, b = K
        q = torch.randn(64, 16, k_dim, device="cuda", generator=gen)
        amax = q.abs().amax(-1, keepdim=True)
        x = q * (448.0 / amax)
        first = x.to(E4M3)
        rest = (x - first.float()).to(E4M3)
        kk = torch.randn(64, 16, k_dim, device="cuda", generator=gen).to(E4M3)
        for name, t in (("first", first), ("rest", rest)):
            f, s = gemms(t, kk)
            res[f"random_{name}_k{k_dim}"] = {"a": t.view(torch.uint8).cpu(), "b": kk.view(torch.uint8).cpu(),
                                             "fast": f.cpu(), "slow": s.cpu()}
    return res


def analyze(path):
    res = torch.load(path)
    print("device:", res["device"])
    print("== readback: q as the kernel took it, against tests/reference.py's terms as the wgmma adds them")
    for key, r in res["readback"].items():
        f, rr, rs = q_terms(r["q"])
        hq, hkv = (int(x) for x in key.split("_")[1][1:].split("x"))
        columns = first_chain_columns(hq // hkv, r["q"].shape[-1])
        want = read_back(f.double(), rr.double(), columns) * rs.double()
        rel = (r["taken"] - want).abs() / want.abs().amax(-1, keepdim=True)
        bad = rel > 1e-6
        line = f"{key}: largest difference {rel.max().item():.2e} of the row's amax, {bad.sum().item()} of {bad.numel()} off"
        if bad.any():
            line += " e.g. " + ", ".join(f"{tuple(i)} q {r['q'][tuple(i)].item():+.5f} want {want[tuple(i)].item():+.6f} "
                                         f"got {r['taken'][tuple(i)].item():+.6f}" for i in bad.nonzero()[:4].tolist())
        print(line)
    print("== scores: the kernel's S against exact S of the same terms (logits)")
    for key, r in res["scores"].items():
        q, k8, s = r["q"], r["k8"].view(E4M3), r["s"]
        b, hq, d = q.shape
        kk = k8.double().repeat_interleave(hq // k8.shape[1], dim=1)
        f, rr, rs = q_terms(q)
        pf, pr = f.double() * kk * rs.double(), rr.double() * kk * rs.double()
        exact = (pf + pr).sum(-1)
        err = ((s - exact) / math.sqrt(d)).flatten()
        e = err.abs()
        print(f"{key}: rms {e.square().mean().sqrt():.2e} p99 {e.quantile(0.99):.2e} p99.9 {e.quantile(0.999):.2e} "
              f"max {e.max():.2e}")
        for i in e.argsort(descending=True)[:4].tolist():
            bi, hi = divmod(i, hq)
            blocks = lambda t: [round(v, 3) for v in t[bi, hi].view(-1, 32).sum(-1).tolist()]  # noqa: E731
            print(f"   b{bi} h{hi}: S {exact[bi, hi]:+.4f} off {s[bi, hi] - exact[bi, hi]:+.3e} (scale {rs[bi, hi].item():.3e});"
                  f" first's k-blocks {blocks(pf / rs.double())}, rest's {blocks(pr / rs.double())}")
    print("== hw: torch._scaled_mm (fast accumulation / not) against exact")
    hw = res["hw"]
    c = hw["crafted"]
    a, b = c["a"].view(E4M3).double(), c["b"].view(E4M3).double()
    exact = a @ b.transpose(1, 2)
    diag = lambda t: t.diagonal(dim1=1, dim2=2).reshape(-1)  # noqa: E731
    for fast in ("fast", "slow"):
        got = diag(c[fast].double())
        want = diag(exact)
        groups = {}
        for i, (big, where, x) in enumerate(c["cases"]):
            groups.setdefault((big, where), []).append((x, got[i].item() - want[i].item()))
        for (big, where), rows in groups.items():
            kept = [x for x, off in rows if off == 0]
            lost = [(x, off) for x, off in rows if off != 0]
            smallest = min((abs(x) for x in kept), default=None)
            print(f"{fast} big {big:g} small {where}: exact for {len(kept)} of {len(rows)}; smallest exact |x| {smallest};"
                  f" e.g. off {[(x, round(o, 6)) for x, o in lost[:3]]}")
    for key in [k for k in hw if k.startswith("random")]:
        r = hw[key]
        exact = r["a"].view(E4M3).double() @ r["b"].view(E4M3).double().transpose(1, 2)
        mag = exact.abs().clamp_min(1e-30)
        for fast in ("fast", "slow"):
            off = (r[fast].double() - exact)
            print(f"{key} {fast}: rms {off.square().mean().sqrt():.3e}, max {off.abs().max():.3e},"
                  f" mean {off.mean():+.3e} (bias), max relative {(off.abs() / mag).max():.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--analyze", default=None, help="a file this script wrote: summarize it (no GPU needed)")
    args = ap.parse_args()
    if args.analyze:
        analyze(args.analyze)
        return
    if args.kernels:
        fa4_aot.set_default_library(fa4_aot.KernelLibrary(Path(args.kernels)))
    gen = torch.Generator(device="cuda").manual_seed(2)
    res = {"device": torch.cuda.get_device_name(), "readback": {}, "scores": {}, "hw": hardware(gen)}
    for d in (64, 128, 256):
        for hq, hkv in ((8, 8), (16, 1), (32, 1)):
            for dtype in (torch.float16, torch.bfloat16):
                key = f"d{d}_h{hq}x{hkv}_{str(dtype).split('.')[-1]}"
                res["readback"][key] = readback(d, hq, hkv, dtype, 4, gen)
                if dtype == torch.float16 or (d, hq) == (128, 8):
                    res["scores"][key] = scores(d, hq, hkv, dtype, 2048, gen)
                print(key, flush=True)
    torch.save(res, args.out)


if __name__ == "__main__":
    main()
