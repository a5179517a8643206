"""Backward of several kernel folders on the same inputs, interleaved (the order rotated each
round): bf16, head_dim 64 and 128 (or DIMS=192,256), 4k and 16k tokens, causal and not,
TFLOP/s per round; a folder trimmed to backward rows takes the package's others
(``swap_in.whole_library``; ``fa4_aot`` names the package's own). On the H200 from the
repository root:
    [DIMS=D,...] bwd_ab_folders.py ROUNDS DETERMINISTIC(0/1) FOLDER..."""
import os
import sys
from pathlib import Path
import torch
sys.path.insert(0, ".")
import fa4_aot
from fa4_aot.launch.loader import KernelLibrary
from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd
from benchmarks.bench_attention import bench, flops
from benchmarks.experiments.swap_in import whole_library
rounds, det, folders = int(sys.argv[1]), bool(int(sys.argv[2])), sys.argv[3:]
libs = [KernelLibrary(whole_library(Path(f))) for f in folders]
for d in (int(x) for x in os.environ.get("DIMS", "64,128").split(",")):
    for s in (4096, 16384):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            out, lse = flash_attn_fwd(q, k, v, causal=causal)
            grads = [[torch.empty_like(x) for x in (q, k, v)] for _ in libs]
            res = [[] for _ in libs]
            for r in range(rounds):
                order = list(range(len(libs)))
                order = order[r % len(order):] + order[:r % len(order)]
                for i in order:
                    fa4_aot.set_default_library(libs[i])
                    g = grads[i]
                    res[i].append(bench(lambda: flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=det,
                                                               dq=g[0], dk=g[1], dv=g[2])))
            fl = 2.5 * flops(b, h, s, d, causal)
            print(f"bwd det{int(det)} d{d} s{s} c{int(causal)}: " + "  ".join(
                f"{f.split('/')[-1]} " + "/".join(f"{fl / t / 1e9:.0f}" for t in ts) for f, ts in zip(folders, res)), flush=True)
