"""head_dim 192 with head_dim_v 128 (DeepSeek V3's prefill and training shape), bf16, MHA
(16 heads): fa4_aot, FA4 upstream (compile.py's ``dv`` exports) and cuDNN (SDPA) timed in
one process, forward and backward (FA4's preprocess, main kernel and dQ postprocess),
interleaved rounds, do_bench 50/200 ms medians; each cell's first round compares FA4's
outputs and gradients with ours. GQA cells (16 query heads on 4 KV heads, "g4"): fa4_aot
and cuDNN only (FA4's sm90 backward asserts for GQA where head_dim != head_dim_v). TFLOP/s count 2 B H S^2 (192 + 128) for the forward
(half where causal), 2.5x that for the backward.

    python benchmarks/fa4_upstream/same_run_dv.py DIR ROUNDS OUT_JSON [NAME=KERNELS ...]

Each NAME=KERNELS adds fa4_aot from that build folder as peers "ours@NAME" (an A/B of
builds in the same rounds; a folder trimmed to backward rows takes the package's others:
``swap_in.whole_library``); "ours" is the package's cubins.
"""
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).parent))
import ffi  # noqa: E402
from benchmarks.experiments.swap_in import whole_library  # noqa: E402
import fa4_aot  # noqa: E402
from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd  # noqa: E402

LIBRARIES = {}  # "ours" and each "ours@NAME": the KernelLibrary its calls launch from


def _timed(fn, library=None):
    """``fn``'s median time, launched from ``library`` where given: the adapters' default
    library is switched before the timing, not inside the timed calls (where it would add
    host time to ours alone)."""
    if library is not None:
        fa4_aot.set_default_library(library)
    return bench(fn)

D, DV, H = 192, 128, 16
CELLS = [(b, s, c, H) for b, s in ((4, 4096), (1, 16384)) for c in (False, True)] + [
    (4, 4096, c, 4) for c in (False, True)]
bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731


def flops(b, s, causal):
    f = 2 * b * H * s * s * (D + DV)
    return f / 2 if causal else f


def _tag(b, s, causal, hkv):
    return f"{b}x{s} c{int(causal)}" + ("" if hkv == H else f" g{H // hkv}")


def cell(b, s, causal, hkv, r, res, spec, ex):
    tag = _tag(b, s, causal, hkv)
    mha = hkv == H
    fa4_aot.set_default_library(LIBRARIES["ours"])  # the checks' calls
    q = torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, DV, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, s, H, DV, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    o1, o2 = torch.empty_like(dout), torch.empty_like(dout)
    l1, l2 = torch.empty(b, H, s, device="cuda"), torch.empty(b, H, s, device="cuda")
    name = f"d{D}v{DV}{'_causal' if causal else ''}"
    fa4_fwd = ex(f"fa4_fwd_{name}").launcher(q, k, v, o2, l2, scale, stream()) if mha else None
    ours_fwd = lambda: flash_attn_fwd(q, k, v, causal=causal, out=o1, lse=l1)  # noqa: E731
    m = spec["bwd_cfg"][f"{D}v{DV}"][str(causal)]["m_block_size"]
    sr = (s + m - 1) // m * m
    g1 = [torch.empty_like(x) for x in (q, k, v)]
    g2 = [torch.empty_like(x) for x in (q, k, v)]
    dpsum, lse2 = torch.empty(b, H, sr, device="cuda"), torch.empty(b, H, sr, device="cuda")
    dqacc = torch.empty(b, H, sr * D, device="cuda")
    ours_fwd()
    if mha:
        pre = ex(f"fa4_pre_d{D}v{DV}_m{m}").launcher(o1, dout, dpsum, l1, lse2, dqacc, stream())
        main = ex(f"fa4_bwd_{name}").launcher(q, k, v, dout, lse2, dpsum, dqacc, g2[1], g2[2], scale, stream())
        post = ex(f"fa4_post_d{D}v{DV}_m{m}").launcher(dqacc, g2[0], scale, stream())

    def fa4_bwd():
        pre()
        main()
        post()

    ours_bwd = lambda: flash_attn_bwd(q, k, v, o1, dout, l1, causal=causal, dq=g1[0], dk=g1[1], dv=g1[2])  # noqa: E731
    if r == 0 and mha:
        o2.fill_(float("nan"))
        for g in g2:
            g.fill_(float("nan"))
        rc = fa4_fwd()
        ours_fwd()
        fa4_bwd()
        ours_bwd()
        torch.cuda.synchronize()
        rel = [((a.float() - c.float()).abs().max() / c.float().abs().max()).item() for a, c in zip(g2, g1)]
        res.setdefault("checks", {})[tag] = {
            "fwd_rc": rc, "max_abs_out_diff": (o2.float() - o1.float()).abs().max().item(),
            "max_lse_diff": (l2 - l1).abs().max().item(), "rel_max_diff_dq_dk_dv": rel}
        print(f"check {tag}: out {res['checks'][tag]['max_abs_out_diff']:.2e} lse "
              f"{res['checks'][tag]['max_lse_diff']:.2e} dq/dk/dv {' '.join(f'{x:.2e}' for x in rel)}", flush=True)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cud_fwd = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            qt, kt, vt, is_causal=causal, enable_gqa=not mha)
        o = cud_fwd()
        gq = dout.transpose(1, 2)
        cud_bwd = lambda: torch.autograd.grad(o, (qt, kt, vt), gq, retain_graph=True)  # noqa: E731
        order = [(f"fwd {n}", ours_fwd, lib) for n, lib in LIBRARIES.items()] + [
            ("fwd fa4", fa4_fwd, None), ("fwd cudnn", cud_fwd, None)] + [
            (f"bwd {n}", ours_bwd, lib) for n, lib in LIBRARIES.items()] + [
            ("bwd fa4", fa4_bwd, None), ("bwd cudnn", cud_bwd, None)]
        if r % 2:
            order.reverse()
        times = {n: _timed(fn, lib) for n, fn, lib in order if mha or "fa4" not in n}
    for n, t in times.items():
        fl = flops(b, s, causal) * (2.5 if n.startswith("bwd") else 1)
        res.setdefault(f"{tag} {n}", []).append(fl / t / 1e9)
    print(f"r{r} {tag}: " + " ".join(f"{n} {res[f'{tag} {n}'][-1]:.0f}" for n in times), flush=True)


def main():
    folder, rounds, out_json = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    LIBRARIES["ours"] = fa4_aot.KernelLibrary()
    for arg in sys.argv[4:]:
        name, kernels = arg.split("=", 1)
        LIBRARIES[f"ours@{name}"] = fa4_aot.KernelLibrary(whole_library(Path(kernels)))
    fa4_aot.set_default_library(LIBRARIES["ours"])
    spec = ffi.open_dir(folder)
    torch.empty(1, device="cuda")
    res = {"gpu": torch.cuda.get_device_name(), "head_dim": D, "head_dim_v": DV, "heads": H}
    for r in range(rounds):
        for b, s, c, hkv in CELLS:
            cell(b, s, c, hkv, r, res, spec, ffi.ex)
    Path(out_json).write_text(json.dumps(res, indent=1))
    med = statistics.median
    print("\n| batch x seqlen | heads q/kv | causal | pass | fa4_aot | TFLOP/s | FA4 | ours/FA4 | cuDNN | ours/cuDNN |")
    for b, s, c, hkv in CELLS:
        tag = _tag(b, s, c, hkv)
        for p in ("fwd", "bwd"):
            f4, cu = (med(res.get(f"{tag} {p} {n}", [float("nan")])) for n in ("fa4", "cudnn"))
            for ours in LIBRARIES:
                runs = res[f"{tag} {p} {ours}"]
                o = med(runs)
                print(f"| {b} x {s} | {H}/{hkv} | {'yes' if c else 'no'} | {p} | {ours} | {o:.0f} ({min(runs):.0f}-"
                      f"{max(runs):.0f}) | {f4:.0f} | {o / f4:.2f} | {cu:.0f} | {o / cu:.2f} |")

if __name__ == "__main__":
    main()
