"""The cells that fall short of their issues' bars, one call each, for ncu
(ncu_shortfalls.sh): each case makes its inputs as its benchmark does and calls the
package ``--calls`` times, then synchronizes.

    PYTHONPATH=$PWD python benchmarks/experiments/shortfalls.py CASE [--calls 4] [--kernels DIR]
    PYTHONPATH=$PWD python benchmarks/experiments/shortfalls.py --list

Cases (the figure measured last, the bar, the benchmark whose setup it takes):
  decode-d64-split  32 x 1 x 16k, GQA 16:2, d64, num_splits 2: 0.75 of the copy, bar 0.85
                    (issue 38; bench_decode.SPLIT)
  decode-d64-split-policy  the same with the splits the policy picks
  decode-d64        8 x 1 x 32k, GQA 32:8, d64: 0.90 of the copy (the contrast to the above)
  decode-d512-mqa   32 x 1 x 4k, MQA 8:1, d512, 64-key pages: 0.75, bar 0.85 (issue 39; bench_d512)
  decode-fp8        8 x 1 x 32k, GQA 32:8, d128, e4m3 cache: 0.70-0.78, bar 0.85 (issue 40)
  decode-gpt-oss    256 x 1 x 32k, d64, GQA 64:8, window 128, sinks: 0.31, bar 0.85 (issue 42;
                    bench_decode_local)
  fwd-gpt-oss       16 x 8k, d64, GQA 64:8, window 128, sinks: 1.14-1.16x FA4, bar 1.3x (issue 42)
  fwd-d512          1 x 8192, 8:8 heads, d512, causal and not: 0.63-0.68 of matmul, bar 0.70 (issue 39)
  bwd-gpt-oss       8 x 16k, d64, GQA 64:8, window 128, sinks and their gradient: 1.20x FA4 at 16k
                    (133 TFLOP/s at 4k a sequence, 121 at 16k), bar 1.3x (issue 42; same_run_local_bwd)
  bwd-d192v128      4 x 4096, 16 heads, q/k 192 and v 128, not causal: 0.96x FA4, bar 1.0 (issue 39;
                    same_run_dv)
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import fa4_aot  # noqa: E402


def _decode(shape, splits=None, fp8=False):
    from bench_decode import setup
    ours = setup(*shape, split_counts=(splits,) if splits else (), fp8=fp8)[0]
    return lambda: ours(splits)


def _decode_d512():
    from fa4_aot.torch import flash_attn_with_kvcache
    b, n, hq, hkv, page, d = 32, 4096, 8, 1, 64, 512
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    pages = b * n // page
    k, v = (torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, n // page)
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, page_table=table)


def _decode_local():
    from bench_decode_local import LAYERS, setup
    ours_with = setup(LAYERS[0], 32768, False)[0]
    return ours_with(None)


def _fwd(b, s, hq, hkv, d, causal, window=None, sinks=False):
    from fa4_aot.torch import flash_attn_fwd
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = torch.empty_like(q), torch.empty(b, hq, s, device="cuda")
    mods = {}
    if window is not None:
        mods["window_size"] = (window, 0)
    if sinks:
        mods["learnable_sink"] = torch.randn(hq, device="cuda")
    return lambda: flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse, **mods)


def _bwd(b, s, hq, hkv, d, causal, window=None, sinks=False, head_dim_v=None):
    """The backward's launches on its forward's out and lse, gradients and workspace given."""
    from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd
    mk = lambda h, width=d: torch.randn(b, s, h, width, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv, head_dim_v or d), mk(hq, head_dim_v or d)
    mods = {}
    if window is not None:
        mods["window_size"] = (window, 0)
    if sinks:
        mods["learnable_sink"] = torch.randn(hq, device="cuda")
    out, lse = flash_attn_fwd(q, k, v, causal=causal, **mods)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    size = fa4_aot.backward_workspace_bytes(b, s, hq, d, causal=causal, heads_kv=hkv, local=bool(mods),
                                            head_dim_v=head_dim_v)
    ws = torch.empty(size, dtype=torch.uint8, device="cuda")
    if sinks:
        mods["dsink"] = torch.empty(hq, device="cuda")
    return lambda: flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, dq=dq, dk=dk, dv=dv, workspace=ws, **mods)


CASES = {
    "decode-d64-split": lambda: _decode((32, 1, 16, 2, 64, 16384, None), splits=2),
    "decode-d64-split-policy": lambda: _decode((32, 1, 16, 2, 64, 16384, None)),
    "decode-d64": lambda: _decode((8, 1, 32, 8, 64, 32768, None)),
    "decode-d512-mqa": _decode_d512,
    "decode-fp8": lambda: _decode((8, 1, 32, 8, 128, 32768, None), fp8=True),
    "decode-gpt-oss": _decode_local,
    "fwd-gpt-oss": lambda: _fwd(16, 8192, 64, 8, 64, False, window=128, sinks=True),
    "fwd-d512": lambda: _fwd(1, 8192, 8, 8, 512, False),
    "fwd-d512-causal": lambda: _fwd(1, 8192, 8, 8, 512, True),
    "bwd-gpt-oss": lambda: _bwd(8, 16384, 64, 8, 64, False, window=128, sinks=True),
    "bwd-d192v128": lambda: _bwd(4, 4096, 16, 16, 192, False, head_dim_v=128),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case", nargs="?", choices=sorted(CASES))
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--kernels", help="a build folder to take the cubins from instead of the package's")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    args = ap.parse_args(argv)
    if args.list or args.case is None:
        print("\n".join(sorted(CASES)))
        return
    if args.kernels:
        fa4_aot.set_default_library(fa4_aot.KernelLibrary(Path(args.kernels)))
    call = CASES[args.case]()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"{args.case}: {args.calls} calls done", flush=True)


if __name__ == "__main__":
    main()
