"""One FP8-cache decode call, repeated (for ncu): 8 x 1 query token x 32k keys, GQA 32:8,
d128 (bench_decode's first shape); argv: kernels folder, "fp8" or "bf16"."""
import sys

import torch

import fa4_aot

fa4_aot.set_default_library(fa4_aot.KernelLibrary(sys.argv[1]))
fp8 = sys.argv[2] == "fp8"
b, hq, hkv, d, keys = 8, 32, 8, 128, 32768
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
scales = {}
if fp8:
    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    scales = {n: torch.ones(b, hkv, device="cuda") for n in ("k_descale", "v_descale")}
out = torch.empty_like(q)
lse = torch.empty(b, hq, 1, device="cuda")
lengths = torch.full((b,), keys, dtype=torch.int32, device="cuda")
for _ in range(3):
    fa4_aot.forward_kvcache(q, k, v, out, lse, lengths, num_splits=1, stream=torch.cuda.current_stream().cuda_stream,
                            **scales)
torch.cuda.synchronize()
