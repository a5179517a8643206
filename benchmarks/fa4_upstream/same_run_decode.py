"""fa4_aot's decode (forward_kvcache) beside FA4 upstream's sm90 forward against a KV
cache (compile.py's ``decode`` exports), timed in one process on the H200: bench_decode.py's
ISSUE shapes (GQA 32:8, head_dim 128 bf16, full caches, not causal), their dense cache and
paged forms (page sizes 128, 256, 64, 16: FA4 loads pages of tile_n = 128 keys by TMA, any
other size by cp.async, its paged_kv_non_tma), interleaved rounds (the order turns each
round), do_bench 50/200 ms medians, TB/s of K + V bytes read (bench_decode's kv_bytes), and
the same run's device-to-device copy for scale. The first round compares FA4's out and
LSE with ours. A cell that fails prints its error and the run goes on.

    PYTHONPATH=$PWD python benchmarks/fa4_upstream/same_run_decode.py DIR ROUNDS OUT_JSON [dense] [paged]

Ours: forward_kvcache on DeviceArrays made once, as bench_decode.py keeps them (a repeated
call re-launches its packed kernels), its split count by its heuristic. FA4: one split
(its interface asserts split-KV unsupported on sm90), pack_gqa, seqused_k = the cache
lengths, its LSE written. Environment: PAGES=128,16 keeps those page sizes.
"""
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, "."); sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

import ffi  # noqa: E402
from rounds import finish, note, run_rounds, summary, time_round  # noqa: E402

DEV = "cuda"
PAGES = (128, 256, 64, 16)
TILE_N = 128  # FA4's sm90 tile_n at head_dim 128 (spec.json's fwd_cfg): pages of this size go by TMA


def stream():
    return torch.cuda.current_stream().cuda_stream if DEV == "cuda" else 0


def setup(batch, sq, hq, hkv, d, keys, page, seed=0):
    """The shape's tensors: q, the cache (paged through a random page table when ``page``),
    the lengths, ours' outputs and FA4's."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, keys, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, keys, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    lengths = torch.full((batch,), keys, dtype=torch.int32, device=DEV)
    table = None
    if page:
        pages = keys // page
        perm = torch.randperm(batch * pages, device=DEV, generator=g)
        table = perm.view(batch, pages).to(torch.int32).contiguous()
        kc = torch.empty(batch * pages, page, hkv, d, device=DEV, dtype=torch.bfloat16)
        vc = torch.empty_like(kc)
        kc[perm] = k.view(batch * pages, page, hkv, d)
        vc[perm] = v.view(batch * pages, page, hkv, d)
        k, v = kc, vc
    t = dict(q=q, k=k, v=v, lengths=lengths, table=table)
    for who in ("ours", "fa4"):
        t[f"out_{who}"] = torch.empty_like(q)
        t[f"lse_{who}"] = torch.empty(batch, hq, sq, device=DEV)
    return t


def fa4_name(d, hq, hkv, page, cpasync=False):
    base = f"fa4_decode_d{d}{f'_g{hq // hkv}' if hq != hkv else ''}"
    if not page:
        return base
    return f"{base}_paged_{'tma' if page == TILE_N and not cpasync else 'cpasync'}"


def fa4_launch(t, page, cpasync=False):
    q, k = t["q"], t["k"]
    name = fa4_name(q.shape[3], q.shape[2], k.shape[2], page, cpasync)
    args = [q, k, t["v"], t["out_fa4"], t["lse_fa4"], 1 / math.sqrt(q.shape[3]), t["lengths"]]
    if page:
        args.append(t["table"])
    go = ffi.ex(name).launcher(*args, stream())
    go.name = name
    return go


def ours_launch(t):
    import fa4_aot
    from fa4_aot.torch import as_device_array

    q, k, hq, hkv = t["q"], t["k"], t["q"].shape[2], t["k"].shape[2]
    batch, sq, d = q.shape[0], q.shape[1], q.shape[3]
    keys = int(t["lengths"][0])
    need = fa4_aot.forward_kvcache_workspace_bytes(batch, sq, hq, hkv, d, keys)
    space = torch.empty(max(need, 1), dtype=torch.uint8, device=DEV)
    arrays = [as_device_array(x) for x in (q, k, t["v"], t["out_ours"], t["lse_ours"], t["lengths"])]
    space_a = as_device_array(space) if need else None
    table_a = as_device_array(t["table"]) if t["table"] is not None else None
    s = stream()

    def ours():
        fa4_aot.forward_kvcache(*arrays, space_a, page_table=table_a, stream=s)
    ours.keep = (space, arrays, space_a, table_a)
    return ours


def copy_bandwidth(bench):
    """Bytes read plus written per second of torch's copy_ of 2 GiB (bench_decode's scale)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench(lambda: dst.copy_(src)) * 1e-3)


def kv_bytes(batch, heads_kv, head_dim, keys):
    return batch * keys * heads_kv * head_dim * 2 * 2


def cell(shape, page, r, res, bench):
    name, batch, sq, hq, hkv, d, keys, _ = shape
    key = f"{name}|{page or 'dense'}"
    t = setup(batch, sq, hq, hkv, d, keys, page)
    peers = {"ours": ours_launch(t)}
    fa4s = [("fa4", False)] + ([("fa4_cpasync", True)] if page == TILE_N else [])
    for label, cp in fa4s:
        try:
            go = fa4_launch(t, page, cp)
            if r == 0:
                t["out_fa4"].fill_(float("nan"))
                rc = go(); torch.cuda.synchronize()
                if rc:
                    raise RuntimeError(f"{go.name}: launch returned {rc}")
            peers[label] = go
        except Exception as e:  # noqa: BLE001 (FA4's column of this cell is missing; ours still timed)
            note(res, f"{key}|{label}", e)
            continue
        if r == 0:
            try:
                peers["ours"](); torch.cuda.synchronize()
                do = (t["out_fa4"].float() - t["out_ours"].float()).abs().max().item()
                dl = (t["lse_fa4"] - t["lse_ours"]).abs().max().item()
                res["checks"][f"{key}|{label}"] = {"max_abs_o": do, "max_abs_lse": dl}
                print(f"check {key} {label}: max|o_fa4-o_ours| {do:.2e} max|lse| diff {dl:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001
                note(res, f"{key}|{label}|check", e)
    nbytes = kv_bytes(batch, hkv, d, keys)
    figures = time_round(key, peers, r, res, bench, ("bytes_per_s", lambda ms: nbytes / (ms * 1e-3)))
    print(f"r{r} {key}: " + " ".join(f"{name} {x / 1e12:.2f}" for name, x in figures.items()) + " TB/s", flush=True)


def table(res, cells):
    b = res["bytes_per_s"]
    copy = statistics.median(res["copy_bytes_per_s"]) / 1e12 if res["copy_bytes_per_s"] else float("nan")
    lines = [f"K+V read, TB/s (median over rounds, range in brackets); device-to-device copy {copy:.2f} TB/s", "",
             "| shape | cache | fa4_aot | FA4 upstream | ours / FA4 | FA4 cp.async |", "|---|---|---|---|---|---|"]
    for key in cells:
        name, page = key.split("|")
        (o, o_range), (f, f_range), (c, c_range) = (summary(b, f"{key}|{peer}", 1e12, 2)
                                                    for peer in ("ours", "fa4", "fa4_cpasync"))
        extra = f"{c:.2f}{c_range}" if f"{key}|fa4_cpasync" in b else "-"
        lines.append(f"| {name} | {page if page == 'dense' else 'paged ' + page} | {o:.2f}{o_range} | "
                     f"{f:.2f}{f_range} | {o / f:.3f} | {extra} |")
    return "\n".join(lines)


def main(argv):
    import triton.testing
    from benchmarks.bench_decode import ISSUE

    folder, rounds, out_json = Path(argv[0]), int(argv[1]), argv[2]
    forms = [f for f in ("dense", "paged") if f in argv[3:]] or ["dense", "paged"]
    pages = [int(x) for x in os.environ.get("PAGES", "").split(",") if x] or list(PAGES)
    spec = ffi.open_dir(folder)
    torch.empty(1, device="cuda")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
    res = {"bytes_per_s": {}, "copy_bytes_per_s": [], "checks": {}, "errors": {}, "fa4": spec.get("sources", ""),
           "fa4_refused": spec.get("refused", {}), "gpu": torch.cuda.get_device_name()}
    cells = [(shape, None) for shape in ISSUE if "dense" in forms]
    cells += [(shape, p) for shape in ISSUE for p in pages if "paged" in forms]
    def copy_round(r):
        try:
            res["copy_bytes_per_s"].append(copy_bandwidth(bench))
        except Exception as e:  # noqa: BLE001
            note(res, "copy", e)

    run_rounds(res, out_json, rounds, cells, lambda c, r: cell(*c, r, res, bench),
               lambda c: f"{c[0][0]}|{c[1] or 'dense'}", copy_round)
    finish(res, out_json, table(res, [f"{s[0]}|{p or 'dense'}" for s, p in cells]))


if __name__ == "__main__":
    main(sys.argv[1:])
