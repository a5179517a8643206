"""One cell of one implementation, four calls (for ncu):
    [KERNELS=build/x] one.py DIR ours|fa4 fwd|bwd HEAD_DIM SEQLEN CAUSAL(0|1) [DET(0|1)]"""
import math
import os
import sys
from pathlib import Path
import torch
sys.path.insert(0, "."); sys.path.insert(0, str(Path(__file__).parent))
import ffi
import fa4_aot
from fa4_aot.torch import flash_attn_fwd, flash_attn_bwd

spec = ffi.open_dir(sys.argv[1])
if os.environ.get("KERNELS"):  # ours from another build folder (as --kernels elsewhere)
    from fa4_aot.launch.loader import KernelLibrary

    fa4_aot.set_default_library(KernelLibrary(Path(os.environ["KERNELS"])))
impl, kind, d, s, causal = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
det = len(sys.argv) > 7 and sys.argv[7] == "1"
b, h = 16384 // s, 2048 // d
stream = torch.cuda.current_stream().cuda_stream
q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
scale = 1 / math.sqrt(d)
c = "_causal" if causal else ""
if kind == "fwd":
    o = torch.empty_like(q); lse = torch.empty(b, h, s, device="cuda")
    if impl == "fa4":
        fn = ffi.ex(f"fa4_fwd_d{d}{c}").launcher(q, k, v, o, lse, scale, stream)
    else:
        fn = lambda: flash_attn_fwd(q, k, v, causal=causal, out=o, lse=lse)
else:
    out, lse = flash_attn_fwd(q, k, v, causal=causal)
    g = [torch.empty_like(x) for x in (q, k, v)]
    if impl == "fa4":
        m = spec["bwd_cfg"][str(d)][str(causal)]["m_block_size"]
        sr = (s + m - 1) // m * m
        dpsum, lse2, dqacc = torch.empty(b, h, sr, device="cuda"), torch.empty(b, h, sr, device="cuda"), torch.empty(b, h, sr * d, device="cuda")
        sem = torch.zeros(b, h, sr // m, 1, device="cuda", dtype=torch.int32)
        pre = ffi.ex(f"fa4_pre_d{d}_m{m}").launcher(out, dout, dpsum, lse, lse2, dqacc, stream)
        post = ffi.ex(f"fa4_post_d{d}_m{m}").launcher(dqacc, g[0], scale, stream)
        args = [q, k, v, dout, lse2, dpsum, dqacc, g[1], g[2], scale] + ([sem] if det else []) + [stream]
        main = ffi.ex(f"fa4_bwd_d{d}{c}{'_det' if det else ''}").launcher(*args)
        def fn():
            pre()
            if det:
                sem.zero_()
            main(); post()
    else:
        fn = lambda: flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=det, dq=g[0], dk=g[1], dv=g[2])
for _ in range(4):
    fn()
torch.cuda.synchronize()
print("done", impl, kind, d, s, causal, det)
