"""The error that rounding q to e4m3 (each row scaled to +-448, as the FP8-S decode patch
does: docs/history/2026-12-04-fp8-s-wgmma.patch) adds, on the CPU in float32: against
the same cache with q exact, and against the unquantized cache beside the FP8 cache's own
error. Random q, k with logits of the given spread, 64 rows.

    python benchmarks/experiments/fp8_q_error.py
"""
import torch
torch.manual_seed(0)
def attn(q, k, v, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s, -1) @ v
def quant_rows(q):
    x = q.half().float()
    amax = x.abs().amax(-1, keepdim=True)
    sc = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / sc).to(torch.float8_e4m3fn).float() * sc
for d, keys, logit_std in [(128, 8192, 1.0), (128, 8192, 3.0), (64, 8192, 2.0), (256, 4096, 2.0)]:
    rows = 64
    q = torch.randn(rows, d) * (logit_std ** 0.5)
    k = (torch.randn(keys, d) * (logit_std ** 0.5)).to(torch.float8_e4m3fn).float()
    v = torch.randn(keys, d).to(torch.float8_e4m3fn).float()
    scale = d ** -0.5
    ref = attn(q, k, v, scale)
    o_q8 = attn(quant_rows(q), k, v, scale)
    o_bf = attn(q.bfloat16().float(), k, v, scale)  # q rounded to bf16 only
    # a 16-bit pipeline's own rounding (P and O in bf16) as the yardstick
    s = (q.bfloat16().float() @ k.t()) * scale
    p = torch.softmax(s, -1).bfloat16().float()
    o_lowp = (p @ v).bfloat16().float()
    rel = lambda o: ((o - ref).norm() / ref.norm()).item()
    mx = lambda o: (o - ref).abs().max().item()
    print(f"d{d} keys{keys} logit_std{logit_std}: q8 rel {rel(o_q8):.2e} max {mx(o_q8):.2e} | "
          f"bf16 pipeline rel {rel(o_lowp):.2e} max {mx(o_lowp):.2e}")
print("-- against the unquantized cache (what the model computed in bf16):")
for d, keys, logit_std in [(128, 8192, 1.0), (128, 8192, 3.0), (64, 8192, 2.0)]:
    q = torch.randn(64, d) * (logit_std ** 0.5)
    k0 = torch.randn(keys, d) * (logit_std ** 0.5)
    v0 = torch.randn(keys, d)
    ks = k0.abs().amax() / 448; vs = v0.abs().amax() / 448
    k8 = (k0 / ks).to(torch.float8_e4m3fn).float() * ks
    v8 = (v0 / vs).to(torch.float8_e4m3fn).float() * vs
    scale = d ** -0.5
    ref = attn(q, k0, v0, scale)
    rel = lambda o: ((o - ref).norm() / ref.norm()).item()
    print(f"d{d} logit_std{logit_std}: fp8 cache only {rel(attn(q, k8, v8, scale)):.2e}, "
          f"fp8 cache + q8 {rel(attn(quant_rows(q), k8, v8, scale)):.2e}")
