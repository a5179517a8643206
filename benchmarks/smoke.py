#!/usr/bin/env python3
"""One small launch per head dim, checked loosely: a quick sign of life before the suite."""

import sys

import torch

from fa4_aot.torch import flash_attn_fwd
sys.path.insert(0, ".")
from tests.reference import attention_ref  # noqa: E402

for d in (64, 96, 128, 192, 256):
    for causal in (False, True):
        q, k, v = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = flash_attn_fwd(q, k, v, causal=causal)
        torch.cuda.synchronize()
        ref, lse_ref = attention_ref(q, k, v, causal)
        print(f"d{d} causal={causal}: max|out-ref|={(out.float() - ref.float()).abs().max().item():.3e} "
              f"max|lse-ref|={(lse - lse_ref).abs().max().item():.3e} nan={out.isnan().any().item()}", flush=True)
