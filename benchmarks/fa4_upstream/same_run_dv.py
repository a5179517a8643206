"""head_dim 192 with head_dim_v 128 (DeepSeek V3's prefill and training shape), bf16, MHA
(16 heads): fa4_aot, FA4 upstream (compile.py's ``dv`` exports) and cuDNN (SDPA) timed in
one process, forward and backward (FA4's preprocess, main kernel and dQ postprocess),
interleaved rounds, do_bench 50/200 ms medians; each cell's first round compares FA4's
outputs and gradients with ours. TFLOP/s count 2 B H S^2 (192 + 128) for the forward
(half where causal), 2.5x that for the backward.

    python benchmarks/fa4_upstream/same_run_dv.py DIR ROUNDS OUT_JSON
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
from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd  # noqa: E402

D, DV, H = 192, 128, 16
CELLS = [(b, s, c) for b, s in ((4, 4096), (1, 16384)) for c in (False, True)]
bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731


def flops(b, s, causal):
    f = 2 * b * H * s * s * (D + DV)
    return f / 2 if causal else f


def cell(b, s, causal, r, res, spec, ex):
    tag = f"{b}x{s} c{int(causal)}"
    q = torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, H, DV, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, s, H, DV, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    o1, o2 = torch.empty_like(dout), torch.empty_like(dout)
    l1, l2 = torch.empty(b, H, s, device="cuda"), torch.empty(b, H, s, device="cuda")
    name = f"d{D}v{DV}{'_causal' if causal else ''}"
    fa4_fwd = ex(f"fa4_fwd_{name}").launcher(q, k, v, o2, l2, scale, stream())
    ours_fwd = lambda: flash_attn_fwd(q, k, v, causal=causal, out=o1, lse=l1)  # noqa: E731
    m = spec["bwd_cfg"][f"{D}v{DV}"][str(causal)]["m_block_size"]
    sr = (s + m - 1) // m * m
    g1 = [torch.empty_like(x) for x in (q, k, v)]
    g2 = [torch.empty_like(x) for x in (q, k, v)]
    dpsum, lse2 = torch.empty(b, H, sr, device="cuda"), torch.empty(b, H, sr, device="cuda")
    dqacc = torch.empty(b, H, sr * D, device="cuda")
    ours_fwd()
    pre = ex(f"fa4_pre_d{D}v{DV}_m{m}").launcher(o1, dout, dpsum, l1, lse2, dqacc, stream())
    main = ex(f"fa4_bwd_{name}").launcher(q, k, v, dout, lse2, dpsum, dqacc, g2[1], g2[2], scale, stream())
    post = ex(f"fa4_post_d{D}v{DV}_m{m}").launcher(dqacc, g2[0], scale, stream())

    def fa4_bwd():
        pre()
        main()
        post()

    ours_bwd = lambda: flash_attn_bwd(q, k, v, o1, dout, l1, causal=causal, dq=g1[0], dk=g1[1], dv=g1[2])  # noqa: E731
    if r == 0:
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
        cud_fwd = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
        o = cud_fwd()
        gq = dout.transpose(1, 2)
        cud_bwd = lambda: torch.autograd.grad(o, (qt, kt, vt), gq, retain_graph=True)  # noqa: E731
        order = [("fwd ours", ours_fwd), ("fwd fa4", fa4_fwd), ("fwd cudnn", cud_fwd),
                 ("bwd ours", ours_bwd), ("bwd fa4", fa4_bwd), ("bwd cudnn", cud_bwd)]
        if r % 2:
            order = order[1::-1] + order[2:3] + order[4:2:-1] + order[5:]
        times = {n: bench(fn) for n, fn in order}
    for n, t in times.items():
        fl = flops(b, s, causal) * (2.5 if n.startswith("bwd") else 1)
        res.setdefault(f"{tag} {n}", []).append(fl / t / 1e9)
    print(f"r{r} {tag}: " + " ".join(f"{n} {res[f'{tag} {n}'][-1]:.0f}" for n in times), flush=True)


def main():
    folder, rounds, out_json = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    spec = ffi.open_dir(folder)
    torch.empty(1, device="cuda")
    res = {"gpu": torch.cuda.get_device_name(), "head_dim": D, "head_dim_v": DV, "heads": H}
    for r in range(rounds):
        for b, s, c in CELLS:
            cell(b, s, c, r, res, spec, ffi.ex)
    Path(out_json).write_text(json.dumps(res, indent=1))
    med = statistics.median
    print("\n| batch x seqlen | causal | pass | fa4_aot TFLOP/s | FA4 | ours/FA4 | cuDNN | ours/cuDNN |")
    for b, s, c in CELLS:
        tag = f"{b}x{s} c{int(c)}"
        for p in ("fwd", "bwd"):
            o, f4, cu = (med(res[f"{tag} {p} {n}"]) for n in ("ours", "fa4", "cudnn"))
            print(f"| {b} x {s} | {'yes' if c else 'no'} | {p} | {o:.0f} ({min(res[f'{tag} {p} ours']):.0f}-"
                  f"{max(res[f'{tag} {p} ours']):.0f}) | {f4:.0f} | {o / f4:.2f} | {cu:.0f} | {o / cu:.2f} |")


if __name__ == "__main__":
    main()
