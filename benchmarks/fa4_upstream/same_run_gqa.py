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
import local_cells  # noqa: E402
from rounds import finish, run_rounds  # noqa: E402

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


def _differences(ours, peer):
    """max |peer - ours| of (out, lse) (lse where the peer gives one)."""
    (o1, l1), (o2, l2) = ours, peer
    found = {"max_abs_o": (o2.float() - o1.float()).abs().max().item()}
    if l2 is not None:
        found["max_abs_lse"] = (l2.float() - l1.float()).abs().max().item()
    return found


def _cell(key, ours, make_fa4, cudnn, work, r, res, bench):
    """One cell's round (local_cells.cell): ``ours`` () -> its (out, lse) launch and the
    two arrays, ``make_fa4`` () -> FA4's (launch, out, lse), ``cudnn`` a launch or None;
    the first round compares FA4's outputs (and cuDNN's) with ours."""
    launch, o1, l1 = ours
    fa4 = {}

    def fa4_launch():
        go, fa4["o"], fa4["lse"] = make_fa4()
        return go
    makers = {"ours": lambda: launch, "fa4": fa4_launch}
    if cudnn is not None:
        makers["cudnn"] = lambda: cudnn

    def check(peers):
        o1.fill_(float("nan")); fa4["o"].fill_(float("nan"))
        peers["ours"](); peers["fa4"](); torch.cuda.synchronize()
        found = {f"fa4 {n}": x for n, x in _differences((o1, l1), (fa4["o"], fa4["lse"])).items()}
        if cudnn is not None:
            found["cudnn max_abs_o"] = _differences((o1, l1), (cudnn().transpose(1, 2), None))["max_abs_o"]
        return found
    local_cells.cell(key, makers, check, work, r, res, bench)


def dense_cell(label, shape, causal, r, res, bench):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa4_aot.torch import flash_attn_fwd
    d, hq, hkv, b, s = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    o1, l1 = torch.empty_like(q), torch.empty(b, hq, s, device="cuda")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    ours = (lambda: flash_attn_fwd(q, k, v, causal=causal, out=o1, lse=l1), o1, l1)
    _cell(f"dense|{label}|{CAUSAL[causal]}", ours, lambda: fa4_dense(q, k, v, causal), cudnn,
          flops([s] * b, hq, d, causal), r, res, bench)


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
    ours = (lambda: flash_attn_varlen_fwd(q, k, v, cu, cu, longest, longest, causal=causal, out=o1, lse=l1), o1, l1)
    _cell(f"varlen|{label}|{CAUSAL[causal]}", ours, lambda: fa4_varlen(q, k, v, cu, causal), None,
          flops(lengths, hq, d, causal), r, res, bench)


CAUSAL = {False: "no", True: "yes"}
PEERS = {"ours": "fa4_aot", "fa4": "FA4 upstream", "cudnn": "cuDNN"}


def main(argv):
    import triton.testing
    folder, rounds, out_json = Path(argv[0]), int(argv[1]), argv[2]
    kinds = [k for k in ("dense", "varlen") if k in argv[3:]] or ["dense", "varlen"]
    spec = ffi.open_dir(folder)
    torch.empty(1, device="cuda")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
    res = {"flops_per_s": {}, "checks": {}, "errors": {}, "fa4": spec.get("sources", ""),
           "fa4_refused": spec.get("refused", {}), "gpu": torch.cuda.get_device_name(),
           "varlen_lengths": {label: mix[0] for label, mix in varlen_mixes().items()}}
    cells = [("dense", label, shape, causal) for label, shape in dense_cells().items() for causal in (False, True)]
    cells += [("varlen", label, mix, causal) for label, mix in varlen_mixes().items() for causal in (False, True)]
    cells = [c for c in cells if c[0] in kinds]

    def run(c, r):
        kind, label, shape, causal = c
        (dense_cell if kind == "dense" else varlen_cell)(label, shape, causal, r, res, bench)

    key = lambda c: f"{c[0]}|{c[1]}|{CAUSAL[c[3]]}"  # noqa: E731
    run_rounds(res, out_json, rounds, cells, run, key)
    finish(res, out_json, local_cells.table(res, [key(c) for c in cells], "GQA prefill forward, TFLOP/s", PEERS,
                                            ("kind", "cell", "causal")))


if __name__ == "__main__":
    main(sys.argv[1:])
