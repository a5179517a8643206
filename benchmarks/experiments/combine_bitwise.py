#!/usr/bin/env python3
"""A built library's decode and combine against the package's, bitwise: out and lse of
every decode benchmark shape (bench_decode's ISSUE, MORE, SPLIT and KEYS, and 8 x 32k in
pages of 16), bf16 and FP8 caches, at the policy's splits and at forced ones (2, 3, 5, 16,
37, 128 for bf16; 4, 33 for FP8) where the keys allow. Outputs are NaN-filled before each
call. A change that must not move a bit (session 58's combine) passes when every call is
equal; a call a library refuses is printed and skipped.

    PYTHONPATH=$PWD python benchmarks/experiments/combine_bitwise.py DIR   # DIR: build_kernels.py --out
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa4_aot  # noqa: E402
from bench_decode import ISSUE, KEYS, MORE, SPLIT, setup  # noqa: E402


def main():
    lib = fa4_aot.KernelLibrary(Path(sys.argv[1]))
    bad = total = 0
    for name, batch, sq, hq, hkv, d, keys, page in ISSUE + MORE + SPLIT + KEYS + [("p16", 8, 1, 32, 8, 128, 32768, 16)]:
        for fp8 in (False, True):
            splits = (None, 2, 3, 5, 16, 37, 128) if not fp8 else (None, 4, 33)
            ours, _, keep = setup(batch, sq, hq, hkv, d, keys, page, split_counts=splits[1:], fp8=fp8)
            out, lse = keep[3], keep[4]
            for n in splits:
                if n is not None and n > keys // 64:
                    continue
                results = []
                try:
                    for library in (None, lib):
                        out.fill_(float("nan"))
                        lse.fill_(float("nan"))
                        ours(n, library=library)
                        torch.cuda.synchronize()
                        results.append((out.clone(), lse.clone()))
                except fa4_aot.Fa4AotError as e:
                    print(f"refused {name} splits={n}: {str(e)[:80]}")
                    continue
                (o0, l0), (o1, l1) = results
                same = (torch.equal(o0.view(torch.int16), o1.view(torch.int16))
                        and torch.equal(l0.view(torch.int32), l1.view(torch.int32)))
                finite = bool(torch.isfinite(o1).all())
                total += 1
                bad += not (same and finite)
                if not (same and finite):
                    print(f"DIFFER {name} fp8={fp8} splits={n}: max {(o0.float() - o1.float()).abs().max().item():.3e} "
                          f"finite {finite}")
            del keep, ours
            torch.cuda.empty_cache()
    print(f"combine bitwise: {total - bad} of {total} calls equal")


if __name__ == "__main__":
    main()
