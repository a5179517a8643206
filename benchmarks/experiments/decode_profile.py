"""One decode shape launched a few times, for ncu (the decode kernel of the last call):

    ncu --kernel-name regex:decode --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/experiments/decode_profile.py BATCH SEQLEN_Q KEYS [NUM_SPLITS] [--kernels DIR]

GQA 32:8, head_dim 128, bf16, a full contiguous cache.
"""
import sys
from pathlib import Path

import torch

import fa4_aot

args = [a for a in sys.argv[1:] if not a.startswith("--")]
if "--kernels" in sys.argv:
    fa4_aot.set_default_library(fa4_aot.KernelLibrary(Path(sys.argv[sys.argv.index("--kernels") + 1])))
    args.remove(sys.argv[sys.argv.index("--kernels") + 1])
batch, sq, keys = (int(x) for x in args[:3])
splits = int(args[3]) if len(args) > 3 else None
q = torch.randn(batch, sq, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(batch, keys, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
out, lse = torch.empty_like(q), torch.empty(batch, 32, sq, device="cuda")
lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
need = fa4_aot.forward_kvcache_workspace_bytes(batch, sq, 32, 8, 128, keys, num_splits=splits)
space = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
for _ in range(4):
    fa4_aot.forward_kvcache(q, k, v, out, lse, lengths, space if need else None, num_splits=splits,
                            stream=torch.cuda.current_stream().cuda_stream)
torch.cuda.synchronize()
