"""fa4_aot, FA4 upstream (compile.py's exports) and cuDNN timed in one process on the H200:
the baselines grid (bf16, 16384 tokens, heads x head_dim = 2048), forward and backward
(FA4's three backward kernels, and its deterministic mode with its semaphores zeroed per
call as its interface does), interleaved rounds, do_bench 50/200 ms medians. Each cell's
first round also compares FA4's outputs with ours.

    python benchmarks/fa4_upstream/same_run.py DIR ROUNDS OUT_JSON [fwd] [bwd]

Environment: HEAD_DIMS=64,128 keeps those head dims' cells; KERNELS_B=FOLDER times that
build's cubins too ("b" beside "ours", e.g. the previous commit's), in the same rounds;
B_TAIL_SPLIT=0 times as "b" our kernels with the backward's split last wave turned off
(policy.tail_split; same cubins).
"""
import json, math, os, statistics, sys
from pathlib import Path
import torch, triton.testing
sys.path.insert(0, "."); sys.path.insert(0, str(Path(__file__).parent))
from benchmarks.bench_attention import FA4_UPSTREAM_FWD, FA4_UPSTREAM_BWD, flops
import fa4_aot
from fa4_aot.torch import flash_attn_fwd, flash_attn_bwd

D = Path(sys.argv[1]); rounds = int(sys.argv[2]); out_json = sys.argv[3]; what = sys.argv[4:] or ["fwd", "bwd"]
import ffi
spec = ffi.open_dir(D)
ex = ffi.ex
torch.empty(1, device="cuda")

bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
stream = lambda: torch.cuda.current_stream().cuda_stream
cells = [(d, s, c) for d in (64, 128, 256) for s in (1024, 4096, 16384) for c in (False, True)]
if os.environ.get("HEAD_DIMS"):
    cells = [c for c in cells if c[0] in {int(x) for x in os.environ["HEAD_DIMS"].split(",")}]
import fa4_aot.dense as api
import fa4_aot.policy as policy
from fa4_aot.launch.loader import KernelLibrary
lib_a = api.default_library()
lib_b = KernelLibrary(Path(os.environ["KERNELS_B"])) if os.environ.get("KERNELS_B") else None
no_split = os.environ.get("B_TAIL_SPLIT") == "0"
if no_split:
    lib_b = lib_a


def on_b(fn):
    """fn run with KERNELS_B's cubins as the adapters' library (or without the tail split)."""
    split = policy.tail_split

    def run(*args):
        fa4_aot.set_default_library(lib_b)
        if no_split:
            policy.tail_split = lambda *_: (0, 1)
        try:
            return fn(*args)
        finally:
            fa4_aot.set_default_library(lib_a)
            policy.tail_split = split
    return run


def fwd_cell(d, s, causal, r, res):
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o1, o2 = torch.empty_like(q), torch.empty_like(q)
    l1 = torch.empty(b, h, s, device="cuda"); l2 = torch.empty_like(l1)
    fa4 = ex(f"fa4_fwd_d{d}{'_causal' if causal else ''}").launcher(q, k, v, o2, l2, 1 / math.sqrt(d), stream())
    ours = lambda: flash_attn_fwd(q, k, v, causal=causal, out=o1, lse=l1)
    o3, l3 = torch.empty_like(q), torch.empty_like(l1)  # b's own: the loader keeps launch plans by arrays
    ours_b = lambda: flash_attn_fwd(q, k, v, causal=causal, out=o3, lse=l3)
    if r == 0:
        o2.fill_(float("nan")); rc = fa4(); ours(); torch.cuda.synchronize()
        print(f"check fwd d{d} s{s} c{int(causal)}: rc {rc} max|o_fa4-o_ours| {(o2.float() - o1.float()).abs().max().item():.2e}"
              f" max|lse| diff {(l2 - l1).abs().max().item():.2e}", flush=True)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cud = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        order = [("ours", ours), ("fa4", fa4), ("cudnn", cud)]
        if r % 2:
            order = order[1::-1] + order[2:]
        if lib_b is not None:  # first in odd rounds, after ours and FA4 in even ones
            order.insert(0 if r % 2 else 2, ("b", on_b(ours_b)))
        times = {n: bench(fn) for n, fn in order}
    fl = flops(b, h, s, d, causal)
    for n, t in times.items():
        res.setdefault(f"fwd {d} {s} {int(causal)} {n}", []).append(fl / t / 1e9)
    print(f"r{r} fwd d{d} s{s} c{int(causal)}: " + " ".join(f"{n} {fl / t / 1e9:.0f}" for n, t in times.items()), flush=True)


def bwd_cell(d, s, causal, r, res):
    b, h = 16384 // s, 2048 // d
    cfg = spec["bwd_cfg"][str(d)][str(causal)]
    m = cfg["m_block_size"]
    sr = (s + m - 1) // m * m
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = flash_attn_fwd(q, k, v, causal=causal)
    g1 = [torch.empty_like(x) for x in (q, k, v)]
    g2 = [torch.empty_like(x) for x in (q, k, v)]
    dpsum, lse2 = torch.empty(b, h, sr, device="cuda"), torch.empty(b, h, sr, device="cuda")
    dqacc = torch.empty(b, h, sr * d, device="cuda")
    sem = torch.zeros(b, h, sr // m, 1, device="cuda", dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    tag = f"d{d}_m{m}"
    pre = ex(f"fa4_pre_{tag}").launcher(out, dout, dpsum, lse, lse2, dqacc, stream())
    post = ex(f"fa4_post_{tag}").launcher(dqacc, g2[0], scale, stream())
    name = f"fa4_bwd_d{d}{'_causal' if causal else ''}"
    main = ex(name).launcher(q, k, v, dout, lse2, dpsum, dqacc, g2[1], g2[2], scale, stream())
    dets = [False, True] if d <= 128 else [False]
    main_det = ex(name + "_det").launcher(q, k, v, dout, lse2, dpsum, dqacc, g2[1], g2[2], scale, sem, stream()) if d <= 128 else None

    def fa4(det=False):
        pre()
        if det:
            sem.zero_()
            main_det()
        else:
            main()
        post()

    ours = lambda det=False: flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=det,
                                             dq=g1[0], dk=g1[1], dv=g1[2])
    g3 = [torch.empty_like(x) for x in (q, k, v)]  # b's own: the loader keeps launch plans by arrays
    ours_b = lambda det=False: flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=det,
                                               dq=g3[0], dk=g3[1], dv=g3[2])
    if r == 0:
        for det in dets:
            for g in g2:
                g.fill_(float("nan"))
            fa4(det); ours(det); torch.cuda.synchronize()
            diffs = [((a.float() - b_.float()).abs().max() / b_.float().abs().max()).item() for a, b_ in zip(g2, g1)]
            print(f"check bwd d{d} s{s} c{int(causal)} det{int(det)}: rel max diff dq/dk/dv " +
                  " ".join(f"{x:.2e}" for x in diffs), flush=True)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        gq = dout.transpose(1, 2)
        cud = lambda: torch.autograd.grad(o, (qt, kt, vt), gq, retain_graph=True)
        order = [("ours", ours), ("fa4", fa4)]
        if d <= 128:
            order += [("ours_det", lambda: ours(True)), ("fa4_det", lambda: fa4(True))]
        if r % 2:
            order = [(order[i ^ 1]) for i in range(len(order))]
        if lib_b is not None:
            order += [("b", on_b(ours_b))] + ([("b_det", on_b(lambda: ours_b(True)))] if d <= 128 else [])
        order.append(("cudnn", cud))
        times = {n: bench(fn) for n, fn in order}
    fl = 2.5 * flops(b, h, s, d, causal)
    for n, t in times.items():
        res.setdefault(f"bwd {d} {s} {int(causal)} {n}", []).append(fl / t / 1e9)
    print(f"r{r} bwd d{d} s{s} c{int(causal)}: " + " ".join(f"{n} {fl / t / 1e9:.0f}" for n, t in times.items()), flush=True)


def matmul():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b_ = torch.randn_like(a)
    return 2 * 8192 ** 3 / bench(lambda: a @ b_) / 1e9


res = {"matmul": [matmul()]}
print(f"matmul {res['matmul'][0]:.0f}", flush=True)
for r in range(rounds):
    for d, s, c in cells:
        if "fwd" in what:
            fwd_cell(d, s, c, r, res)
        if "bwd" in what:
            bwd_cell(d, s, c, r, res)
res["matmul"].append(matmul())
print(f"matmul {res['matmul'][-1]:.0f}", flush=True)
Path(out_json).write_text(json.dumps(res, indent=1))
med = lambda k: statistics.median(res[k]) if k in res else float("nan")
for kind, base in (("fwd", FA4_UPSTREAM_FWD), ("bwd", FA4_UPSTREAM_BWD)):
    if kind not in what:
        continue
    print(f"\n{kind}: | head_dim | seqlen | causal | fa4_aot | FA4 same run | ours/FA4 | FA4 file | FA4 same/file | cuDNN | ours det | FA4 det | det ratio |")
    for d, s, c in cells:
        p = f"{kind} {d} {s} {int(c)} "
        o, f4, cu = med(p + "ours"), med(p + "fa4"), med(p + "cudnn")
        od, fd = med(p + "ours_det"), med(p + "fa4_det")
        bf = base[(d, s, c)]
        extra = f" b {med(p + 'b'):.0f} b_det {med(p + 'b_det'):.0f} |" if lib_b is not None else ""
        print(f"| {d} | {s} | {'yes' if c else 'no'} | {o:.0f} | {f4:.0f} | {o / f4:.3f} | {bf} | {f4 / bf:.3f} | {cu:.0f} | "
              f"{od:.0f} | {fd:.0f} | {od / fd:.3f} |{extra}")
