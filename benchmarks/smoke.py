#!/usr/bin/env python3
"""A quick sign of life before the suite: one small forward and backward per head dim,
compared loosely with the reference. Run it under `timeout`: a hang shows here first."""

import sys

import torch

from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd

sys.path.insert(0, ".")
from tests.reference import attention_ref  # noqa: E402

for d in (64, 96, 128, 192, 256):
    for causal in (False, True):
        q, k, v, dout = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = flash_attn_fwd(q, k, v, causal=causal)
        torch.cuda.synchronize()
        ref, lse_ref = attention_ref(q, k, v, causal)
        line = f"d{d} causal={causal}: fwd max|err|={(out.float() - ref.float()).abs().max().item():.2e}"
        for det in (False, True):
            dq, dk, dv = flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=det)
            torch.cuda.synchronize()
            line += f" bwd(det={det}) finite={all(torch.isfinite(g).all().item() for g in (dq, dk, dv))}"
        print(line, flush=True)
