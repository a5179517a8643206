"""GQA prefill forwards beside FA4 upstream's (compile.py's ``gqa`` and ``varlen`` exports,
GQA packed as its interface does) and cuDNN (torch SDPA, dense cells, ``enable_gqa``), timed
in one process on the H200 (issue 38: "GQA prefill at least FA4 upstream on every GQA
mix"): dense cells at head_dim 128 (32:8 and 32:4 query : KV heads) and 64 (64:8), 16k
tokens a batch at 1k, 4k and 16k a sequence; varlen mixes at head_dim 128 (issue 38's seven
sequences of 1 to 32k tokens at 32:4, bench_varlen's 256 prompts at 32:8 and at 32:4);
causal and not. Interleaved rounds (the peers' order reversed every other round), do_bench
50/200 ms medians, TFLOP/s of the keys each query sees (causal: s(s+1)/2 pairs a
sequence). The first round compares FA4's and cuDNN's outputs with ours.

    PYTHONPATH=$PWD python benchmarks/fa4_upstream/same_run_gqa.py DIR ROUNDS OUT_JSON [dense] [varlen]
"""
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, "."); sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

import ffi  # noqa: E402
from rounds import finish, note, run_rounds, summary, time_round  # noqa: E402

TOKENS = 16384


def dense_cells():
    """(label, (d, hq, hkv, batch, seqlen))."""
    cells = {}
    for d, hq, hkv in ((128, 32, 8), (128, 32, 4), (64, 64, 8)):
        for s in (1024, 4096, 16384):
            cells[f"d{d} {hq}:{hkv} {TOKENS // s}x{s}"] = (d, hq, hkv, TOKENS // s, s)
    return cells


def varlen_mixes():
    """(label, (lengths, hq, hkv)) at head_dim 128: issue 38's mix (seven sequences from 1 to
    32k tokens at GQA 32:4; the issue gives no lengths: these spread over the range, none
    but the last a multiple of a tile) and bench_varlen's serving prompts (256 of 16-1024
    tokens) at 32:8 and 32:4."""
    seven = [1, 300, 1000, 3000, 8000, 16000, 32768]
    serving = random.Random(1)
    prompts = [serving.randint(16, 1024) for _ in range(256)]
    return {"7 seqs 1-32k GQA 32:4": (seven, 32, 4),
            "256 prompts GQA 32:8": (prompts, 32, 8),
            "256 prompts GQA 32:4": (prompts, 32, 4)}


def flops(lengths, hq, d, causal):
    return sum(4 * (s * (s + 1) // 2 if causal else s * s) * d * hq for s in lengths)


def stream():
    return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else 0


def gtag(hq, hkv):
    return f"_g{hq // hkv}" if hq != hkv else ""


def _launch(name, *args):
    """FA4's export ``name`` bound to ``args``: a no-argument launch that raises on an error."""
    go = ffi.ex(name).launcher(*args)

    def launch():
        rc = go()
        if rc:
            raise RuntimeError(f"{name}: launch returned {rc}")
    launch.keep = go
    return launch


def fa4_dense(q, k, v, causal):
    """FA4's dense GQA forward: (launch, out, lse (b, h, s))."""
    b, s, hq, d = q.shape
    o, lse = torch.empty_like(q), torch.empty(b, hq, s, device=q.device)
    name = f"fa4_fwd_d{d}{'_causal' if causal else ''}{gtag(hq, k.shape[2])}"
    return _launch(name, q, k, v, o, lse, 1 / math.sqrt(d), stream()), o, lse


def fa4_varlen(q, k, v, cu, causal):
    """FA4's varlen GQA forward on cu_seqlens: (launch, out, lse (h, total))."""
    total, hq, d = q.shape
    o, lse = torch.empty_like(q), torch.empty(hq, total, device=q.device)
    name = f"fa4_vfwd_d{d}{'_causal' if causal else ''}{gtag(hq, k.shape[1])}"
    return _launch(name, q, k, v, o, lse, 1 / math.sqrt(d), cu, cu, stream()), o, lse


def check(res, key, name, ours, peer):
    """Records and prints max |peer - ours| of (out, lse) (lse where the peer gives one)."""
    (o1, l1), (o2, l2) = ours, peer
    found = {"max_abs_o": (o2.float() - o1.float()).abs().max().item()}
    if l2 is not None:
        found["max_abs_lse"] = (l2.float() - l1.float()).abs().max().item()
    res["checks"][f"{key}|{name}"] = found
    print(f"check {key} {name}: " + " ".join(f"{n} {x:.2e}" for n, x in found.items()), flush=True)


def dense_cell(label, shape, causal, r, res, bench):
    from fa4_aot.torch import flash_attn_fwd
    d, hq, hkv, b, s = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    o1, l1 = torch.empty_like(q), torch.empty(b, hq, s, device="cuda")
    peers = {"ours": lambda: flash_attn_fwd(q, k, v, causal=causal, out=o1, lse=l1)}
    key = f"dense|{label}|{int(causal)}"
    try:
        peers["fa4"], o2, l2 = fa4_dense(q, k, v, causal)
    except Exception as e:  # noqa: BLE001 (FA4's column of this cell is missing; ours still timed)
        note(res, key + "|fa4", e)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    peers["cudnn"] = cudnn
    if r == 0:
        o1.fill_(float("nan"))
        peers["ours"]()
        if "fa4" in peers:
            o2.fill_(float("nan"))
            try:
                peers["fa4"](); torch.cuda.synchronize()
                check(res, key, "fa4", (o1, l1), (o2, l2))
            except Exception as e:  # noqa: BLE001
                note(res, key + "|fa4", e); peers.pop("fa4")
        try:
            o3 = cudnn().transpose(1, 2); torch.cuda.synchronize()
            check(res, key, "cudnn", (o1, l1), (o3, None))
        except Exception as e:  # noqa: BLE001 (this torch's cuDNN lacks the shape)
            note(res, key + "|cudnn", e); peers.pop("cudnn")
    timed(key, peers, r, res, flops([s] * b, hq, d, causal), bench)


def varlen_cell(label, mix, causal, r, res, bench):
    from fa4_aot.torch import flash_attn_varlen_fwd
    lengths, hq, hkv = mix
    d = 128
    g = torch.Generator(device="cuda").manual_seed(0)
    total, longest = sum(lengths), max(lengths)
    q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    o1, l1 = torch.empty_like(q), torch.empty(hq, total, device="cuda")
    peers = {"ours": lambda: flash_attn_varlen_fwd(q, k, v, cu, cu, longest, longest, causal=causal, out=o1,
                                                   lse=l1)}
    key = f"varlen|{label}|{int(causal)}"
    try:
        fa4, o2, l2 = fa4_varlen(q, k, v, cu, causal)
        peers["fa4"] = fa4
        if r == 0:
            o1.fill_(float("nan")); o2.fill_(float("nan"))
            peers["ours"](); fa4(); torch.cuda.synchronize()
            check(res, key, "fa4", (o1, l1), (o2, l2))
    except Exception as e:  # noqa: BLE001
        note(res, key + "|fa4", e); peers.pop("fa4", None)
    timed(key, peers, r, res, flops(lengths, hq, d, causal), bench)


def timed(key, peers, r, res, work, bench):
    figures = time_round(key, peers, r, res, bench, ("tflops", lambda ms: work / ms / 1e9))
    print(f"r{r} {key}: " + " ".join(f"{name} {x:.0f}" for name, x in figures.items()), flush=True)


def table(res, kinds):
    lines = []
    for kind, labels in kinds:
        lines += ["", f"{kind} forward (TFLOP/s, median over rounds, range in brackets)", "",
                  "| cell | causal | fa4_aot | FA4 upstream | cuDNN | ours / FA4 | ours / cuDNN |",
                  "|---|---|---|---|---|---|---|"]
        for label in labels:
            for causal in (False, True):
                p = f"{kind}|{label}|{int(causal)}|"
                (o, o_r), (f, f_r), (c, c_r) = (summary(res["tflops"], p + n) for n in ("ours", "fa4", "cudnn"))
                lines.append(f"| {label} | {'yes' if causal else 'no'} | {o:.0f}{o_r} | {f:.0f}{f_r} | {c:.0f}{c_r} | "
                             f"{o / f:.3f} | {o / c:.3f} |")
    return "\n".join(lines)


def main(argv):
    import triton.testing
    folder, rounds, out_json = Path(argv[0]), int(argv[1]), argv[2]
    kinds = [k for k in ("dense", "varlen") if k in argv[3:]] or ["dense", "varlen"]
    spec = ffi.open_dir(folder)
    torch.empty(1, device="cuda")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
    res = {"tflops": {}, "checks": {}, "errors": {}, "fa4": spec.get("sources", ""),
           "fa4_refused": spec.get("refused", {}), "gpu": torch.cuda.get_device_name(),
           "varlen_lengths": {label: mix[0] for label, mix in varlen_mixes().items()}}
    dense, mixes = dense_cells(), varlen_mixes()
    cells = [("dense", label, shape, causal) for label, shape in dense.items() for causal in (False, True)
             if "dense" in kinds]
    cells += [("varlen", label, mix, causal) for label, mix in mixes.items() for causal in (False, True)
              if "varlen" in kinds]

    def run(c, r):
        kind, label, shape, causal = c
        (dense_cell if kind == "dense" else varlen_cell)(label, shape, causal, r, res, bench)

    run_rounds(res, out_json, rounds, cells, run, lambda c: f"{c[0]}|{c[1]}|{int(c[3])}")
    finish(res, out_json, table(res, [(k, list(dense if k == "dense" else mixes)) for k in kinds]))


if __name__ == "__main__":
    main(sys.argv[1:])
