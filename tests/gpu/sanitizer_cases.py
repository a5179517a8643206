"""Launches for compute-sanitizer (tests/gpu/test_sanitizer.py runs this file under it):
the forward and both backward modes of every bf16 head dim, causal and not, on shapes
with partial tiles each way, MQA/GQA and seqlen_q != seqlen_k.

python -m tests.gpu.sanitizer_cases [KERNELS_DIR]  (default: the package's cubins)"""

import sys
from pathlib import Path

import torch

from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd
from fa4_aot.variants import MATRIX

SHAPES = [(3, 17, 17, 2, 1), (2, 333, 200, 4, 2), (1, 200, 333, 3, 1)]  # (b, s_q, s_k, h_q, h_kv)


def main():
    dims = sorted({v.head_dim for v in MATRIX if v.kind == "bwd" and v.arch == "sm90a"})
    for d in dims:
        for causal in (False, True):
            for b, sq, sk, hq, hkv in SHAPES:
                q, do = (torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                out, lse = flash_attn_fwd(q, k, v, causal=causal)
                for deterministic in (False, True):
                    flash_attn_bwd(do, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    torch.cuda.synchronize()
    print(f"sanitizer cases done: head dims {dims}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        import fa4_aot.api as api
        from fa4_aot.loader import KernelLibrary

        api._default_library = KernelLibrary(Path(sys.argv[1]))
    main()
