"""fa4_aot's varlen forward and backward beside FA4 upstream's (compile.py's ``varlen``
exports), timed in one process on the H200: bench_varlen.py's mixes (head_dim 128 bf16,
causal and not), interleaved rounds (the order of the two turns each round), do_bench
50/200 ms medians, TFLOP/s with bench_varlen's FLOP model (the backward 2.5x). The first
round compares FA4's outputs with ours. A cell that fails prints its error and the run
goes on.

    PYTHONPATH=$PWD python benchmarks/fa4_upstream/same_run_varlen.py DIR ROUNDS OUT_JSON [fwd] [bwd]

FA4's calls are those its interface makes for these inputs on sm90: the forward on
cu_seqlens_q/k (GQA with pack_gqa); the backward as preprocess (dPsum, LSE * log2 e, dQ
accumulator cleared) + main kernel + dQ postprocess, its accumulators laid at padded
offsets (each sequence from a tile-aligned row: (total + (batch + 1) * tile - 1) // tile
* tile rows), and for GQA the float32 dK / dV accumulators zeroed each call (its interface
allocates them with torch.zeros) and two more postprocess calls. Ours: the same calls as
bench_varlen (outputs and workspace given).
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, "."); sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

import ffi  # noqa: E402
from rounds import finish, note, run_rounds, summary, time_round  # noqa: E402

DEV = "cuda"
D = 128


def stream():
    return torch.cuda.current_stream().cuda_stream if DEV == "cuda" else 0


def inputs(lengths, hq, hkv, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, hq, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(total, hkv, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(lengths, device=DEV).cumsum(0)
    return q, k, v, cu


def tag(causal, hq, hkv):
    return f"{'_causal' if causal else ''}{f'_g{hq // hkv}' if hq != hkv else ''}"


def check_rc(rc, name):
    if rc:
        raise RuntimeError(f"{name}: launch returned {rc}")


def fa4_fwd(q, k, v, cu, causal):
    """FA4's varlen forward: (launch, out, lse)."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], device=DEV)
    name = f"fa4_vfwd_d{D}{tag(causal, q.shape[1], k.shape[1])}"
    go = ffi.ex(name).launcher(q, k, v, o, lse, 1 / math.sqrt(D), cu, cu, stream())

    def launch():
        check_rc(go(), name)
    launch.keep = go
    return launch, o, lse


def padded_rows(total, batch, tile):
    return (total + (batch + 1) * tile - 1) // tile * tile


def fa4_bwd(spec, q, k, v, out, dout, lse, cu, causal):
    """FA4's varlen backward: (launch, dq, dk, dv)."""
    cfg = spec["bwd_cfg"][str(D)][str(causal)]
    m, n = cfg["m_block_size"], cfg["n_block_size"]
    total, hq = q.shape[:2]
    hkv, batch = k.shape[1], cu.shape[0] - 1
    gqa = hq != hkv
    scale = 1 / math.sqrt(D)
    rows = padded_rows(total, batch, m)
    dpsum, lse2 = torch.empty(hq, rows, device=DEV), torch.empty(hq, rows, device=DEV)
    dqacc = torch.empty(hq, rows * D, device=DEV)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    s = stream()
    calls = [ffi.ex(f"fa4_vpre_d{D}_m{m}").launcher(out, dout, dpsum, lse, lse2, dqacc, cu, s)]
    main = f"fa4_vbwd_d{D}{tag(causal, hq, hkv)}"
    zero = []
    if gqa:
        krows = padded_rows(k.shape[0], batch, n)
        dkacc, dvacc = torch.zeros(hkv, krows * D, device=DEV), torch.zeros(hkv, krows * D, device=DEV)
        zero = [dkacc, dvacc]
        calls.append(ffi.ex(main).launcher(q, k, v, dout, lse2, dpsum, dqacc, dkacc, dvacc, scale, cu, cu, s))
    else:
        calls.append(ffi.ex(main).launcher(q, k, v, dout, lse2, dpsum, dqacc, dk, dv, scale, cu, cu, s))
    calls.append(ffi.ex(f"fa4_vpost_d{D}_m{m}").launcher(dqacc, dq, scale, cu, s))
    if gqa:
        post = ffi.ex(f"fa4_vpostkv_d{D}_n{n}")
        calls += [post.launcher(dkacc, dk, scale, cu, s), post.launcher(dvacc, dv, 1.0, cu, s)]

    def launch():
        calls[0]()  # the preprocess; then the accumulators zeroed as torch.zeros would
        for t in zero:
            t.zero_()
        for c in calls[1:]:
            c()
    launch.calls, launch.keep = calls, (dpsum, lse2, dqacc, zero)

    def checked():
        calls[0]()
        for t in zero:
            t.zero_()
        for c in calls[1:]:
            check_rc(c(), "fa4 varlen bwd")
    launch.checked = checked
    return launch, dq, dk, dv


def fwd_cell(label, lengths, hq, hkv, causal, r, res, bench, flops):
    from fa4_aot.torch import flash_attn_varlen_fwd
    q, k, v, cu = inputs(lengths, hq, hkv)
    longest = max(lengths)
    o1, l1 = torch.empty_like(q), torch.empty(hq, q.shape[0], device=DEV)
    peers = {"ours": lambda: flash_attn_varlen_fwd(q, k, v, cu, cu, longest, longest, causal=causal, out=o1,
                                                   lse=l1)}
    key = f"fwd|{label}|{int(causal)}"
    try:
        fa4, o2, l2 = fa4_fwd(q, k, v, cu, causal)
        if r == 0:
            o2.fill_(float("nan"))
            fa4(); torch.cuda.synchronize()
        peers["fa4"] = fa4
    except Exception as e:  # noqa: BLE001 (FA4's column of this cell is missing; ours still timed)
        note(res, key + "|fa4", e)
    if r == 0 and "fa4" in peers:
        try:
            peers["ours"](); torch.cuda.synchronize()
            do, dl = (o2.float() - o1.float()).abs().max().item(), (l2 - l1).abs().max().item()
            res["checks"][key] = {"max_abs_o": do, "max_abs_lse": dl}
            print(f"check {key}: max|o_fa4-o_ours| {do:.2e} max|lse| diff {dl:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            note(res, key + "|check", e)
    timed(key, peers, r, res, flops(lengths, hq, causal), bench)


def bwd_cell(label, lengths, hq, hkv, causal, r, res, bench, flops, spec):
    import fa4_aot
    from fa4_aot.torch import flash_attn_varlen_bwd, flash_attn_varlen_fwd
    q, k, v, cu = inputs(lengths, hq, hkv)
    total, longest = q.shape[0], max(lengths)
    out, lse = flash_attn_varlen_fwd(q, k, v, cu, cu, longest, longest, causal=causal)
    dout = torch.randn_like(q)
    g1 = [torch.empty_like(x) for x in (q, k, v)]
    size = fa4_aot.backward_varlen_workspace_bytes(total, len(lengths), hq, D, causal=causal)
    space = torch.empty(size, dtype=torch.uint8, device=DEV)
    peers = {"ours": lambda: flash_attn_varlen_bwd(q, k, v, out, dout, lse, cu, cu, longest, longest, causal=causal,
                                                   dq=g1[0], dk=g1[1], dv=g1[2], workspace=space)}
    key = f"bwd|{label}|{int(causal)}"
    try:
        fa4, *g2 = fa4_bwd(spec, q, k, v, out, dout, lse, cu, causal)
        if r == 0:
            for g in g2:
                g.fill_(float("nan"))
            fa4.checked(); torch.cuda.synchronize()
        peers["fa4"] = fa4
    except Exception as e:  # noqa: BLE001
        note(res, key + "|fa4", e)
    if r == 0 and "fa4" in peers:
        try:
            peers["ours"](); torch.cuda.synchronize()
            diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(g2, g1)]
            res["checks"][key] = dict(zip(("dq", "dk", "dv"), diffs))
            print(f"check {key}: rel max diff dq/dk/dv " + " ".join(f"{x:.2e}" for x in diffs), flush=True)
        except Exception as e:  # noqa: BLE001
            note(res, key + "|check", e)
    timed(key, peers, r, res, 2.5 * flops(lengths, hq, causal), bench)


def timed(key, peers, r, res, work, bench):
    figures = time_round(key, peers, r, res, bench, ("tflops", lambda ms: work / ms / 1e9))
    print(f"r{r} {key}: " + " ".join(f"{name} {x:.0f}" for name, x in figures.items()), flush=True)


def table(res, kinds, mixes):
    lines = []
    for kind in kinds:
        lines += ["", f"{kind} (TFLOP/s, median over rounds, range in brackets)", "",
                  "| mix | causal | fa4_aot | FA4 upstream | ours / FA4 |", "|---|---|---|---|---|"]
        for label in mixes:
            for causal in (False, True):
                p = f"{kind}|{label}|{int(causal)}|"
                (o, o_range), (f, f_range) = (summary(res["tflops"], p + peer) for peer in ("ours", "fa4"))
                lines.append(f"| {label} | {'yes' if causal else 'no'} | {o:.0f}{o_range} | {f:.0f}{f_range} | "
                             f"{o / f:.3f} |")
    return "\n".join(lines)


def main(argv):
    import triton.testing
    from benchmarks.bench_varlen import flops, mixes

    folder, rounds, out_json = Path(argv[0]), int(argv[1]), argv[2]
    kinds = [k for k in ("fwd", "bwd") if k in argv[3:]] or ["fwd", "bwd"]
    spec = ffi.open_dir(folder)
    torch.empty(1, device="cuda")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
    res = {"tflops": {}, "checks": {}, "errors": {}, "fa4": spec.get("sources", ""),
           "fa4_refused": spec.get("refused", {}), "gpu": torch.cuda.get_device_name()}
    cells = [(kind, label, mix, causal) for label, mix in mixes().items() for causal in (False, True)
             for kind in kinds]

    def run(c, r):
        kind, label, (lengths, hq, hkv), causal = c
        if kind == "fwd":
            fwd_cell(label, lengths, hq, hkv, causal, r, res, bench, flops)
        else:
            bwd_cell(label, lengths, hq, hkv, causal, r, res, bench, flops, spec)

    run_rounds(res, out_json, rounds, cells, run, lambda c: f"{c[0]}|{c[1]}|{int(c[3])}")
    finish(res, out_json, table(res, kinds, list(mixes())))


if __name__ == "__main__":
    main(sys.argv[1:])
