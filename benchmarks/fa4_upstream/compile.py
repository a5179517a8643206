"""Compile FA4 upstream's Hopper kernels (flash_attn/cute) for sm_90a on a CPU machine and
export each to C, so the H200 can run them next to ours with no CuTe DSL there
(benchmark-only: nothing of FA4 enters the package or its tests).

    FA4_PATH=<dirs with flash_attn/, quack/, torch/, einops/> CUTE_DSL_ARCH=sm_90a \
        python benchmarks/fa4_upstream/compile.py OUT [fwd] [bwd]
    benchmarks/fa4_upstream/link.sh OUT      # -> OUT/libfa4.so, carried to the device

FA4_PATH is a colon-separated list put first on sys.path (FA4's source tree and the
packages it imports: quack-kernels, a CPU torch, einops). Writes OUT/<name>.h, .o and
spec.json (per export: its entry symbol, argument kinds and tensor field counts), which
ffi.py reads on the device. Each export wraps FA4's own __call__ in a jit function of
tensors and scalars only (its AuxData argument cannot be exported), with the tile
configuration FA4's interface picks for sm90 (_tile_size_fwd_sm90, _tile_size_bwd_sm90).
"""
import json
import os
import re
import sys
import time

sys.path[:0] = [p for p in os.environ.get("FA4_PATH", "").split(":") if p]
import cutlass  # noqa: E402 (after FA4_PATH)
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32
import cuda.bindings.driver as cuda
from quack.compile_utils import make_fake_tensor as fake
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.flash_bwd_preprocess import FlashAttentionBackwardPreprocess
from flash_attn.cute.flash_bwd_postprocess import FlashAttentionBackwardPostprocess
from flash_attn.cute.interface import _tile_size_fwd_sm90, _tile_size_bwd_sm90
from flash_attn.cute.utils import AuxData

BF16 = cutlass.BFloat16
OUT = sys.argv[1] if __name__ == "__main__" else None
spec = {}


def export(name, fn, *args, kinds):
    t0 = time.time()
    c = cute.compile(fn, *args, options="--gpu-arch sm_90a")
    c.export_to_c(OUT, name)
    header = open(f"{OUT}/{name}.h").read()
    entry = re.search(r"void (_mlir_" + name + r"__mlir_ciface_\w+)\(void \*\*args", header).group(1)
    structs = re.findall(r"typedef struct \{\s*void \*data;\s*(?:int32_t dynamic_shapes\[(\d+)\];)?\s*(?:int64_t dynamic_strides\[(\d+)\];)?\s*\} " + name + r"_Tensor_(\w+)_t;", header)
    spec[name] = {"entry": entry, "args": kinds, "tensors": {n: [int(a or 0), int(b or 0)] for a, b, n in structs}}
    print(name, f"{time.time() - t0:.1f}s", spec[name]["tensors"], flush=True)


def fwd(d, causal):
    cfg = _tile_size_fwd_sm90(d, d, causal, False)
    fa = FlashAttentionForwardSm90(BF16, d, d, 1, is_causal=causal, is_local=False, pack_gqa=False,
                                   tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, num_stages=2,
                                   num_threads=(cfg.m_block_size // 64 + 1) * 128, Q_in_regs=False,
                                   intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)
    b, s, sk, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    q, o = fake(BF16, (b, s, h, d), 8), fake(BF16, (b, s, h, d), 8)
    k, v = fake(BF16, (b, sk, h, d), 8), fake(BF16, (b, sk, h, d), 8)
    lse = fake(Float32, (b, h, s), 1)

    @cute.jit
    def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, scale: Float32,
              stream: cuda.CUstream):
        fa(q, k, v, o, lse, scale, None, None, None, None, None, None, None, None, None,
           AuxData(None, None), None, None, stream)

    export(f"fa4_fwd_d{d}{'_causal' if causal else ''}", entry, q, k, v, o, lse, Float32(0.125),
           cuda.CUstream(0), kinds=["t:q", "t:k", "t:v", "t:o", "t:lse", "f32", "stream"])


def bwd(d, causal, det):
    cfg = _tile_size_bwd_sm90(d, d, causal, False)
    tag = f"d{d}{'_causal' if causal else ''}{'_det' if det else ''}"
    fa = FlashAttentionBackwardSm90(
        BF16, d, d, 1, causal, is_local=False, deterministic=det, tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO,
        PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB,
        dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV,
        AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False,
        q_subtile_factor=2, dQ_single_wg=cfg.dQ_single_wg)
    b, s, sk, h, sqr, sqdr = [cute.sym_int() for _ in range(6)]
    q, do = fake(BF16, (b, s, h, d), 8), fake(BF16, (b, s, h, d), 8)
    k, v, dk, dv = [fake(BF16, (b, sk, h, d), 8) for _ in range(4)]
    lse2, dpsum = fake(Float32, (b, h, sqr), 4), fake(Float32, (b, h, sqr), 4)
    dqacc = fake(Float32, (b, h, sqdr), 4)
    kinds = ["t:q", "t:k", "t:v", "t:do", "t:lse2", "t:dpsum", "t:dqacc", "t:dk", "t:dv", "f32"]
    if det:
        sem = fake(Int32, (b, h, cute.sym_int(), 1), 1, leading_dim=3)

        @cute.jit
        def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, do: cute.Tensor, lse2: cute.Tensor,
                  dpsum: cute.Tensor, dqacc: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, scale: Float32,
                  sem: cute.Tensor, stream: cuda.CUstream):
            fa(q, k, v, do, lse2, dpsum, dqacc, dk, dv, scale, None, None, None, None, None, None, sem, None,
               None, AuxData(None, None), None, None, stream)

        export(f"fa4_bwd_{tag}", entry, q, k, v, do, lse2, dpsum, dqacc, dk, dv, Float32(0.125), sem,
               cuda.CUstream(0), kinds=kinds + ["t:sem", "stream"])
    else:
        @cute.jit
        def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, do: cute.Tensor, lse2: cute.Tensor,
                  dpsum: cute.Tensor, dqacc: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, scale: Float32,
                  stream: cuda.CUstream):
            fa(q, k, v, do, lse2, dpsum, dqacc, dk, dv, scale, None, None, None, None, None, None, None, None,
               None, AuxData(None, None), None, None, stream)

        export(f"fa4_bwd_{tag}", entry, q, k, v, do, lse2, dpsum, dqacc, dk, dv, Float32(0.125),
               cuda.CUstream(0), kinds=kinds + ["stream"])


def bwd_rows(d, causal):
    """Pre- and postprocess of the (d, causal) config (tile_m and the dQ layout)."""
    cfg = _tile_size_bwd_sm90(d, d, causal, False)
    tag = f"d{d}_m{cfg.m_block_size}"
    if f"fa4_pre_{tag}" in spec:
        return
    pre = FlashAttentionBackwardPreprocess(BF16, d, d, cfg.m_block_size)
    b, s, h, sqr, sqdr = [cute.sym_int() for _ in range(5)]
    o, do = fake(BF16, (b, s, h, d), 8), fake(BF16, (b, s, h, d), 8)
    dpsum, lse2 = fake(Float32, (b, h, sqr), 4), fake(Float32, (b, h, sqr), 4)
    lse = fake(Float32, (b, h, s), 1)
    dqacc = fake(Float32, (b, h, sqdr), 4)

    @cute.jit
    def entry_pre(o: cute.Tensor, do: cute.Tensor, dpsum: cute.Tensor, lse: cute.Tensor, lse2: cute.Tensor,
                  dqacc: cute.Tensor, stream: cuda.CUstream):
        pre(o, do, dpsum, lse, lse2, dqacc, None, None, None, None, None, Float32(1.0), None, stream)

    export(f"fa4_pre_{tag}", entry_pre, o, do, dpsum, lse, lse2, dqacc, cuda.CUstream(0),
           kinds=["t:o", "t:do", "t:dpsum", "t:lse", "t:lse2", "t:dqacc", "stream"])
    threads = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
    post = FlashAttentionBackwardPostprocess(BF16, d, 90, cfg.m_block_size, threads, cfg.AtomLayoutMdQ,
                                             cfg.dQ_swapAB, use_2cta_instrs=False, cluster_size=1)
    dq = fake(BF16, (b, s, h, d), 8)

    @cute.jit
    def entry_post(dqacc: cute.Tensor, dq: cute.Tensor, scale: Float32, stream: cuda.CUstream):
        post(dqacc, dq, scale, None, None, None, None, stream)

    export(f"fa4_post_{tag}", entry_post, dqacc, dq, Float32(0.125), cuda.CUstream(0),
           kinds=["t:dqacc", "t:dq", "f32", "stream"])


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    what = sys.argv[2:] or ["fwd", "bwd"]
    for d in (64, 128, 256):
        for causal in (False, True):
            if "fwd" in what:
                fwd(d, causal)
            if "bwd" in what:
                bwd_rows(d, causal)
                bwd(d, causal, False)
                if d <= 128:
                    bwd(d, causal, True)
    cfgs = {d: {c: _tile_size_bwd_sm90(d, d, c, False).__dict__ for c in (False, True)} for d in (64, 128, 256)}
    json.dump({"exports": spec, "bwd_cfg": {str(d): {str(c): v for c, v in x.items()} for d, x in cfgs.items()}},
              open(f"{OUT}/spec.json", "w"), indent=1)
