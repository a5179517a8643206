"""One FP8-cache decode against the bf16 decode of the dequantized cache (a first look:
the full checks are tests/gpu/test_fp8_cache.py)."""
import sys

import torch

import fa4_aot

if len(sys.argv) > 1:
    fa4_aot.set_default_library(fa4_aot.KernelLibrary(sys.argv[1]))
from fa4_aot.torch import flash_attn_with_kvcache

torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    for d in (64, 96, 128, 192, 256):
        q = torch.randn(2, 1, 16, d, device="cuda", dtype=dtype)
        k8 = (2 * torch.randn(2, 1000, 4, d, device="cuda")).to(torch.float8_e4m3fn)
        v8 = (2 * torch.randn(2, 1000, 4, d, device="cuda")).to(torch.float8_e4m3fn)
        ks, vs = torch.full((2, 4), 0.5, device="cuda"), torch.full((2, 4), 0.25, device="cuda")
        lengths = torch.tensor([1000, 333], dtype=torch.int32, device="cuda")
        out = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lengths, k_descale=ks, v_descale=vs)
        ref = flash_attn_with_kvcache(q, (k8.float() * 0.5).to(dtype), (v8.float() * 0.25).to(dtype),
                                      cache_seqlens=lengths)
        torch.cuda.synchronize()
        print(dtype, d, "max diff", (out.float() - ref.float()).abs().max().item(), "max", ref.abs().max().item(),
              flush=True)
