"""Compile FA4 upstream's Hopper kernels (flash_attn/cute) for sm_90a on a CPU machine and
export each to C, so the H200 can run them next to ours with no CuTe DSL there
(benchmark-only: nothing of FA4 enters the package or its tests).

    FA4_PATH=<dirs with flash_attn/, quack/, torch/, einops/> CUTE_DSL_ARCH=sm_90a \
        python benchmarks/fa4_upstream/compile.py OUT [fwd] [bwd] [varlen] [gqa] [decode] [local] [local_bwd] [dv]
    benchmarks/fa4_upstream/link.sh OUT      # -> OUT/libfa4.so, carried to the device
    benchmarks/fa4_upstream/setup.sh GIT_DIR # both, every kind, from a flash-attention git dir

FA4_PATH is a colon-separated list put first on sys.path (FA4's source tree and the
packages it imports: quack-kernels, a CPU torch, einops), as setup.sh sets it up (its
pinned flash-attention commit by ``git archive`` into one folder, ``pip install --target
DEPS --no-deps`` of quack-kernels and what it imports at import time into another;
FA4_SOURCES, recorded in spec.json's "sources"). Writes OUT/<name>.h, .o and
spec.json (per export: its entry symbol, argument kinds and tensor field counts), which
ffi.py reads on the device. Each export wraps FA4's own __call__ in a jit function of
tensors and scalars only (its AuxData argument cannot be exported), with the tile
configuration FA4's interface picks for sm90 (_tile_size_fwd_sm90, _tile_size_bwd_sm90).
With no kinds named it compiles fwd and bwd (the dense grid). spec.json is merged with an
OUT/spec.json already there, so kinds compiled in separate runs share one folder.

``varlen`` (same_run_varlen.py): head_dim 128 bf16, causal and not, for MHA and GQA 4:1
(bench_varlen's mixes): the forward on cu_seqlens_q/k (GQA packed, pack_gqa, as its
interface does for qhead_per_kvhead > 1), the backward's three kernels on cu_seqlens (its
interface turns pack_gqa off in the backward; GQA accumulates dK/dV in float32 and adds
two postprocess calls, one kernel for both since head_dim == head_dim_v), no batch-lookup
aid (its interface adds one only above 256 sequences; bench_varlen's largest mix has 256).

``dv`` (same_run_dv.py): head_dim 192 with head_dim_v 128, bf16, MHA, causal and not: the
forward, and the backward's three kernels (FA4's sm90 backward asserts for GQA when the
head dims differ), exports named ``..._d192v128...``.

``gqa`` (same_run_gqa.py): the forward with GQA packed (pack_gqa, FA4's interface's choice
for qhead_per_kvhead > 1), bf16, causal and not: dense at head_dim 128 with 4 and 8 query
heads per KV head and at 64 with 8 (``fa4_fwd_d{d}[_causal]_g{n}``), varlen at 128 with 8
(with ``varlen``'s 4: the GQA mixes of bench_varlen and issue 38).

``decode`` (same_run_decode.py): FA4's sm90 forward against a KV cache, head_dim 128 bf16,
GQA 32:8 (qhead_per_kvhead 4, pack_gqa), not causal, with seqused_k as the cache lengths:
dense cache (b, s_k, h_k, d); paged by its page table with TMA (page size == tile_n 128)
and with cp.async (any other page size, its paged_kv_non_tma). One split only: its
interface asserts split-KV unsupported on sm90. Its LSE is written (ours writes one).
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
    missing = {k[2:] for k in kinds if k.startswith("t:")} - set(spec[name]["tensors"])
    assert not missing, (name, "tensor structs not found in the header", missing)
    print(name, f"{time.time() - t0:.1f}s", spec[name]["tensors"], flush=True)


def _dv_tag(d, dv):
    return "" if dv == d else f"v{dv}"


def fwd(d, causal, dv=None, qhpk=1):
    """The dense forward; with qhpk > 1 query heads per KV head, GQA packed (pack_gqa) as
    FA4's interface does for qhead_per_kvhead > 1 (``..._g{qhpk}``)."""
    dv = dv or d
    cfg = _tile_size_fwd_sm90(d, dv, causal, False)
    fa = FlashAttentionForwardSm90(BF16, d, dv, qhpk, is_causal=causal, is_local=False, pack_gqa=qhpk > 1,
                                   tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, num_stages=2,
                                   num_threads=(cfg.m_block_size // 64 + 1) * 128, Q_in_regs=False,
                                   intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)
    b, s, sk, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    hk = cute.sym_int() if qhpk > 1 else h
    q, o = fake(BF16, (b, s, h, d), 8), fake(BF16, (b, s, h, dv), 8)
    k, v = fake(BF16, (b, sk, hk, d), 8), fake(BF16, (b, sk, hk, dv), 8)
    lse = fake(Float32, (b, h, s), 1)

    @cute.jit
    def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, scale: Float32,
              stream: cuda.CUstream):
        fa(q, k, v, o, lse, scale, None, None, None, None, None, None, None, None, None,
           AuxData(None, None), None, None, stream)

    export(f"fa4_fwd_d{d}{_dv_tag(d, dv)}{'_causal' if causal else ''}{gqa_tag(qhpk)}", entry, q, k, v, o, lse, Float32(0.125),
           cuda.CUstream(0), kinds=["t:q", "t:k", "t:v", "t:o", "t:lse", "f32", "stream"])


def bwd(d, causal, det, d_v=None):
    d_v = d_v or d
    cfg = _tile_size_bwd_sm90(d, d_v, causal, False)
    tag = f"d{d}{_dv_tag(d, d_v)}{'_causal' if causal else ''}{'_det' if det else ''}"
    fa = FlashAttentionBackwardSm90(
        BF16, d, d_v, 1, causal, is_local=False, deterministic=det, tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO,
        PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB,
        dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV,
        AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False,
        q_subtile_factor=2, dQ_single_wg=cfg.dQ_single_wg)
    b, s, sk, h, sqr, sqdr = [cute.sym_int() for _ in range(6)]
    q, do = fake(BF16, (b, s, h, d), 8), fake(BF16, (b, s, h, d_v), 8)
    k, dk = [fake(BF16, (b, sk, h, d), 8) for _ in range(2)]
    v, dv = [fake(BF16, (b, sk, h, d_v), 8) for _ in range(2)]
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


def bwd_rows(d, causal, dv=None):
    """Pre- and postprocess of the (d, causal) config (tile_m and the dQ layout)."""
    pre_post(_tile_size_bwd_sm90(d, dv or d, causal, False), d, dv=dv)


def pre_post(cfg, d, sinks_too=False, dv=None):
    """The backward's preprocess and dQ postprocess for ``cfg``'s tile_m (fa4_pre_ and
    fa4_post_ d{d}_m{tile_m}); ``sinks_too``: also the dQ postprocess that reduces the
    sinks' gradient (fa4_spost_: one CTA per head, as FA4's interface launches it with
    learnable_sink). Each export skipped where the spec has it."""
    dv = dv or d
    tag = f"d{d}{_dv_tag(d, dv)}_m{cfg.m_block_size}"
    b, s, h, sqr, sqdr = [cute.sym_int() for _ in range(5)]
    dqacc = fake(Float32, (b, h, sqdr), 4)
    dpsum, lse = fake(Float32, (b, h, sqr), 4), fake(Float32, (b, h, s), 1)
    if f"fa4_pre_{tag}" not in spec:
        pre = FlashAttentionBackwardPreprocess(BF16, d, dv, cfg.m_block_size)
        o, do = fake(BF16, (b, s, h, dv), 8), fake(BF16, (b, s, h, dv), 8)
        lse2 = fake(Float32, (b, h, sqr), 4)

        @cute.jit
        def entry_pre(o: cute.Tensor, do: cute.Tensor, dpsum: cute.Tensor, lse: cute.Tensor, lse2: cute.Tensor,
                      dqacc: cute.Tensor, stream: cuda.CUstream):
            pre(o, do, dpsum, lse, lse2, dqacc, None, None, None, None, None, Float32(1.0), None, stream)

        export(f"fa4_pre_{tag}", entry_pre, o, do, dpsum, lse, lse2, dqacc, cuda.CUstream(0),
               kinds=["t:o", "t:do", "t:dpsum", "t:lse", "t:lse2", "t:dqacc", "stream"])
    threads = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
    dq = fake(BF16, (b, s, h, d), 8)
    for sinks in (False, True) if sinks_too else (False,):
        name = f"fa4_{'s' if sinks else ''}post_{tag}"
        if name in spec:
            continue
        post = FlashAttentionBackwardPostprocess(BF16, d, 90, cfg.m_block_size, threads, cfg.AtomLayoutMdQ,
                                                 cfg.dQ_swapAB, use_2cta_instrs=False, cluster_size=1)
        if sinks:
            from flash_attn.cute.flash_bwd_postprocess import LearnableSinkBwdTensors

            sink, dsink = fake(Float32, (h,), 1), fake(Float32, (h,), 1)

            @cute.jit
            def entry_spost(dqacc: cute.Tensor, dq: cute.Tensor, scale: Float32, dpsum: cute.Tensor,
                            lse: cute.Tensor, sink: cute.Tensor, dsink: cute.Tensor, stream: cuda.CUstream):
                post(dqacc, dq, scale, None, None, LearnableSinkBwdTensors(dpsum, lse, sink, dsink), None, stream)

            export(name, entry_spost, dqacc, dq, Float32(0.125), dpsum, lse, sink, dsink, cuda.CUstream(0),
                   kinds=["t:dqacc", "t:dq", "f32", "t:dpsum", "t:lse", "t:sink", "t:dsink", "stream"])
        else:
            @cute.jit
            def entry_post(dqacc: cute.Tensor, dq: cute.Tensor, scale: Float32, stream: cuda.CUstream):
                post(dqacc, dq, scale, None, None, None, None, stream)

            export(name, entry_post, dqacc, dq, Float32(0.125), cuda.CUstream(0),
                   kinds=["t:dqacc", "t:dq", "f32", "stream"])


def gqa_tag(qhpk):
    return f"_g{qhpk}" if qhpk > 1 else ""


def varlen_fwd(d, causal, qhpk):
    """Forward on cu_seqlens_q / cu_seqlens_k: q, o (total_q, h, d), k, v (total_k, h_k, d),
    lse (h, total_q); GQA packed (pack_gqa) as FA4's interface does for qhead_per_kvhead > 1."""
    cfg = _tile_size_fwd_sm90(d, d, causal, False)
    fa = FlashAttentionForwardSm90(BF16, d, d, qhpk, is_causal=causal, is_local=False, pack_gqa=qhpk > 1,
                                   tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, num_stages=2,
                                   num_threads=(cfg.m_block_size // 64 + 1) * 128, Q_in_regs=False,
                                   intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)
    tq, tk, h, bq, bk = [cute.sym_int() for _ in range(5)]
    hk = cute.sym_int() if qhpk > 1 else h
    q, o = fake(BF16, (tq, h, d), 8), fake(BF16, (tq, h, d), 8)
    k, v = fake(BF16, (tk, hk, d), 8), fake(BF16, (tk, hk, d), 8)
    lse = fake(Float32, (h, tq), 1)
    cuq, cuk = fake(Int32, (bq,), 1), fake(Int32, (bk,), 1)

    @cute.jit
    def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, scale: Float32,
              cuq: cute.Tensor, cuk: cute.Tensor, stream: cuda.CUstream):
        fa(q, k, v, o, lse, scale, cuq, cuk, None, None, None, None, None, None, None,
           AuxData(None, None), None, None, stream)

    export(f"fa4_vfwd_d{d}{'_causal' if causal else ''}{gqa_tag(qhpk)}", entry, q, k, v, o, lse, Float32(0.125),
           cuq, cuk, cuda.CUstream(0), kinds=["t:q", "t:k", "t:v", "t:o", "t:lse", "f32", "t:cuq", "t:cuk", "stream"])


def varlen_bwd(d, causal, qhpk):
    """The backward's main kernel on cu_seqlens (not deterministic): lse2, dpsum (h, total_q
    padded), dqacc (h, total_q padded * d), each sequence starting at a tile-aligned row
    (FA4's padded offsets); dk, dv (total_k, h_k, d) direct for MHA, (h_k, total_k padded * d)
    float32 accumulators for GQA (zeroed per call, as its interface allocates them)."""
    cfg = _tile_size_bwd_sm90(d, d, causal, False)
    fa = FlashAttentionBackwardSm90(
        BF16, d, d, qhpk, causal, is_local=False, deterministic=False, tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO,
        PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB,
        dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV,
        AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False,
        q_subtile_factor=2, dQ_single_wg=cfg.dQ_single_wg)
    tq, tk, h, bq, bk, tqr, tqdr = [cute.sym_int() for _ in range(7)]
    hk = cute.sym_int() if qhpk > 1 else h
    q, do = fake(BF16, (tq, h, d), 8), fake(BF16, (tq, h, d), 8)
    k, v = fake(BF16, (tk, hk, d), 8), fake(BF16, (tk, hk, d), 8)
    if qhpk > 1:
        dk, dv = fake(Float32, (hk, cute.sym_int()), 4), fake(Float32, (hk, cute.sym_int()), 4)
    else:
        dk, dv = fake(BF16, (tk, hk, d), 8), fake(BF16, (tk, hk, d), 8)
    lse2, dpsum = fake(Float32, (h, tqr), 4), fake(Float32, (h, tqr), 4)
    dqacc = fake(Float32, (h, tqdr), 4)
    cuq, cuk = fake(Int32, (bq,), 1), fake(Int32, (bk,), 1)

    @cute.jit
    def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, do: cute.Tensor, lse2: cute.Tensor,
              dpsum: cute.Tensor, dqacc: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, scale: Float32,
              cuq: cute.Tensor, cuk: cute.Tensor, stream: cuda.CUstream):
        fa(q, k, v, do, lse2, dpsum, dqacc, dk, dv, scale, cuq, cuk, None, None, None, None, None, None,
           None, AuxData(None, None), None, None, stream)

    export(f"fa4_vbwd_d{d}{'_causal' if causal else ''}{gqa_tag(qhpk)}", entry, q, k, v, do, lse2, dpsum, dqacc,
           dk, dv, Float32(0.125), cuq, cuk, cuda.CUstream(0),
           kinds=["t:q", "t:k", "t:v", "t:do", "t:lse2", "t:dpsum", "t:dqacc", "t:dk", "t:dv", "f32", "t:cuq",
                  "t:cuk", "stream"])


def varlen_rows(d, causal):
    """Varlen pre- and postprocess of the (d, causal) config, and (once per d) the GQA
    dK / dV postprocess (tile_n rows per block, the dKV atom layout)."""
    cfg = _tile_size_bwd_sm90(d, d, causal, False)
    tag = f"d{d}_m{cfg.m_block_size}"
    tq, h, b1, tqr, tqdr = [cute.sym_int() for _ in range(5)]
    cuq = fake(Int32, (b1,), 1)
    dqacc = fake(Float32, (h, tqdr), 4)
    if f"fa4_vpre_{tag}" not in spec:
        pre = FlashAttentionBackwardPreprocess(BF16, d, d, cfg.m_block_size)
        o, do = fake(BF16, (tq, h, d), 8), fake(BF16, (tq, h, d), 8)
        dpsum, lse2 = fake(Float32, (h, tqr), 4), fake(Float32, (h, tqr), 4)
        lse = fake(Float32, (h, tq), 1)

        @cute.jit
        def entry_pre(o: cute.Tensor, do: cute.Tensor, dpsum: cute.Tensor, lse: cute.Tensor, lse2: cute.Tensor,
                      dqacc: cute.Tensor, cuq: cute.Tensor, stream: cuda.CUstream):
            pre(o, do, dpsum, lse, lse2, dqacc, cuq, None, None, None, None, Float32(1.0), None, stream)

        export(f"fa4_vpre_{tag}", entry_pre, o, do, dpsum, lse, lse2, dqacc, cuq, cuda.CUstream(0),
               kinds=["t:o", "t:do", "t:dpsum", "t:lse", "t:lse2", "t:dqacc", "t:cuq", "stream"])
    if f"fa4_vpost_{tag}" not in spec:
        threads = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
        post = FlashAttentionBackwardPostprocess(BF16, d, 90, cfg.m_block_size, threads, cfg.AtomLayoutMdQ,
                                                 cfg.dQ_swapAB, use_2cta_instrs=False, cluster_size=1)
        dq = fake(BF16, (tq, h, d), 8)

        @cute.jit
        def entry_post(dqacc: cute.Tensor, dq: cute.Tensor, scale: Float32, cuq: cute.Tensor,
                       stream: cuda.CUstream):
            post(dqacc, dq, scale, cuq, None, None, None, stream)

        export(f"fa4_vpost_{tag}", entry_post, dqacc, dq, Float32(0.125), cuq, cuda.CUstream(0),
               kinds=["t:dqacc", "t:dq", "f32", "t:cuq", "stream"])
    kvtag = f"d{d}_n{cfg.n_block_size}"
    if f"fa4_vpostkv_{kvtag}" not in spec:
        post = FlashAttentionBackwardPostprocess(BF16, d, 90, cfg.n_block_size, cfg.num_wg * 128, cfg.AtomLayoutNdKV,
                                                 cfg.dKV_swapAB, use_2cta_instrs=False, cluster_size=1)
        tk, hk, bk1 = cute.sym_int(), cute.sym_int(), cute.sym_int()
        acc, dx, cuk = fake(Float32, (hk, cute.sym_int()), 4), fake(BF16, (tk, hk, d), 8), fake(Int32, (bk1,), 1)

        @cute.jit
        def entry_postkv(acc: cute.Tensor, dx: cute.Tensor, scale: Float32, cuk: cute.Tensor,
                         stream: cuda.CUstream):
            post(acc, dx, scale, cuk, None, None, None, stream)

        export(f"fa4_vpostkv_{kvtag}", entry_postkv, acc, dx, Float32(0.125), cuk, cuda.CUstream(0),
               kinds=["t:acc", "t:dx", "f32", "t:cuk", "stream"])


def decode(d, qhpk, paged):
    """FA4's sm90 forward against a KV cache: q, o (b, s_q, h, d), lse (b, h, s_q), seqused_k
    (b,) the cache lengths; k, v (b, s_k, h_k, d), or with ``paged`` ("tma": page size ==
    tile_n; "cpasync": any other) (pages, page_size, h_k, d) and page_table (b, pages per
    sequence), int32. pack_gqa, not causal, one split."""
    cfg = _tile_size_fwd_sm90(d, d, False, False)
    fa = FlashAttentionForwardSm90(BF16, d, d, qhpk, is_causal=False, is_local=False, pack_gqa=qhpk > 1,
                                   tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, num_stages=2,
                                   num_threads=(cfg.m_block_size // 64 + 1) * 128, Q_in_regs=False,
                                   intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs,
                                   paged_kv_non_tma=paged == "cpasync")
    b, s, h, bk, sk, hk = [cute.sym_int() for _ in range(6)]
    q, o = fake(BF16, (b, s, h, d), 8), fake(BF16, (b, s, h, d), 8)
    k, v = fake(BF16, (bk, sk, hk, d), 8), fake(BF16, (bk, sk, hk, d), 8)
    lse = fake(Float32, (b, h, s), 1)
    used = fake(Int32, (b,), 1)
    kinds = ["t:q", "t:k", "t:v", "t:o", "t:lse", "f32", "t:used"]
    name = f"fa4_decode_d{d}{gqa_tag(qhpk)}"
    if paged:
        table = fake(Int32, (b, cute.sym_int()), 1)

        @cute.jit
        def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, scale: Float32,
                  used: cute.Tensor, table: cute.Tensor, stream: cuda.CUstream):
            fa(q, k, v, o, lse, scale, None, None, None, used, table, None, None, None, None,
               AuxData(None, None), None, None, stream)

        export(f"{name}_paged_{paged}", entry, q, k, v, o, lse, Float32(0.125), used, table, cuda.CUstream(0),
               kinds=kinds + ["t:table", "stream"])
    else:
        @cute.jit
        def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, scale: Float32,
                  used: cute.Tensor, stream: cuda.CUstream):
            fa(q, k, v, o, lse, scale, None, None, None, used, None, None, None, None, None,
               AuxData(None, None), None, None, stream)

        export(name, entry, q, k, v, o, lse, Float32(0.125), used, cuda.CUstream(0), kinds=kinds + ["stream"])


def local_fwd(d, qhpk, softcap):
    """``local`` (same_run_local.py): the sm90 forward with a sliding window (left and right
    at run time, as int32), learnable sinks (h_q,) float32 and, where ``softcap``, FA4's
    softcap score_mod (the cap compile-time, as its interface makes it), dense (b, s, h, d),
    GQA packed (pack_gqa) for qhead_per_kvhead > 1, with its interface's local tiles."""
    from flash_attn.cute import utils

    cfg = _tile_size_fwd_sm90(d, d, False, True)
    fa = FlashAttentionForwardSm90(BF16, d, d, qhpk, is_causal=False, is_local=True, pack_gqa=qhpk > 1,
                                   tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, num_stages=2,
                                   num_threads=(cfg.m_block_size // 64 + 1) * 128, Q_in_regs=False,
                                   intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs,
                                   score_mod=utils.create_softcap_scoremod(softcap) if softcap else None)
    b, s, sk, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    hk = cute.sym_int() if qhpk > 1 else h
    q, o = fake(BF16, (b, s, h, d), 8), fake(BF16, (b, s, h, d), 8)
    k, v = fake(BF16, (b, sk, hk, d), 8), fake(BF16, (b, sk, hk, d), 8)
    lse = fake(Float32, (b, h, s), 1)
    sink = fake(Float32, (h,), 1)

    @cute.jit
    def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, scale: Float32,
              left: Int32, right: Int32, sink: cute.Tensor, stream: cuda.CUstream):
        fa(q, k, v, o, lse, scale, None, None, None, None, None, left, right, sink, None,
           AuxData(None, None), None, None, stream)

    name = f"fa4_lfwd_d{d}{gqa_tag(qhpk)}{f'_cap{int(softcap)}' if softcap else ''}"
    export(name, entry, q, k, v, o, lse, Float32(0.125), Int32(128), Int32(0), sink, cuda.CUstream(0),
           kinds=["t:q", "t:k", "t:v", "t:o", "t:lse", "f32", "i32", "i32", "t:sink", "stream"])


def local_bwd(d, qhpk, softcap=0.0):
    """``local`` (same_run_local_bwd.py): the sm90 backward's main kernel with a sliding
    window (left, right int32 at run time), not deterministic, its interface's local tiles,
    and where ``softcap`` its softcap score_mod and score_mod_bwd (the cap compile-time);
    GQA (qhead_per_kvhead > 1): dK, dV into float32 accumulators (b, h_k, s_k padded * d),
    which its interface zeroes per call and converts with two postprocess calls."""
    from flash_attn.cute import utils

    cfg = _tile_size_bwd_sm90(d, d, False, True)
    fa = FlashAttentionBackwardSm90(
        BF16, d, d, qhpk, False, is_local=True, deterministic=False, tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO,
        PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB,
        dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV,
        AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False,
        q_subtile_factor=2, dQ_single_wg=cfg.dQ_single_wg,
        **(dict(score_mod=utils.create_softcap_scoremod(softcap), score_mod_bwd=utils.create_softcap_scoremod_bwd(softcap))
           if softcap else {}))
    b, s, sk, h, sqr, sqdr = [cute.sym_int() for _ in range(6)]
    hk = cute.sym_int() if qhpk > 1 else h
    q, do = fake(BF16, (b, s, h, d), 8), fake(BF16, (b, s, h, d), 8)
    k, v = fake(BF16, (b, sk, hk, d), 8), fake(BF16, (b, sk, hk, d), 8)
    if qhpk > 1:
        dk, dv = fake(Float32, (b, hk, cute.sym_int()), 4), fake(Float32, (b, hk, cute.sym_int()), 4)
    else:
        dk, dv = fake(BF16, (b, sk, hk, d), 8), fake(BF16, (b, sk, hk, d), 8)
    lse2, dpsum = fake(Float32, (b, h, sqr), 4), fake(Float32, (b, h, sqr), 4)
    dqacc = fake(Float32, (b, h, sqdr), 4)

    @cute.jit
    def entry(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, do: cute.Tensor, lse2: cute.Tensor,
              dpsum: cute.Tensor, dqacc: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, scale: Float32,
              left: Int32, right: Int32, stream: cuda.CUstream):
        fa(q, k, v, do, lse2, dpsum, dqacc, dk, dv, scale, None, None, None, None, left, right, None, None,
           None, AuxData(None, None), None, None, stream)

    export(f"fa4_lbwd_d{d}{gqa_tag(qhpk)}{f'_cap{int(softcap)}' if softcap else ''}", entry, q, k, v, do, lse2, dpsum, dqacc, dk, dv, Float32(0.125),
           Int32(128), Int32(0), cuda.CUstream(0),
           kinds=["t:q", "t:k", "t:v", "t:do", "t:lse2", "t:dpsum", "t:dqacc", "t:dk", "t:dv", "f32", "i32", "i32",
                  "stream"])


def local_rows(d):
    """The local backward's pre- and postprocess (its tile_m, pre_post with the sinks'
    dQ postprocess) and the dense GQA dK / dV postprocess (tile_n rows, the dKV layout)."""
    cfg = _tile_size_bwd_sm90(d, d, False, True)
    pre_post(cfg, d, sinks_too=True)
    b = cute.sym_int()
    kvtag = f"d{d}_n{cfg.n_block_size}"
    if f"fa4_postkv_{kvtag}" not in spec:
        post = FlashAttentionBackwardPostprocess(BF16, d, 90, cfg.n_block_size, cfg.num_wg * 128, cfg.AtomLayoutNdKV,
                                                 cfg.dKV_swapAB, use_2cta_instrs=False, cluster_size=1)
        sk, hk = cute.sym_int(), cute.sym_int()
        acc, dx = fake(Float32, (b, hk, cute.sym_int()), 4), fake(BF16, (b, sk, hk, d), 8)

        @cute.jit
        def entry_postkv(acc: cute.Tensor, dx: cute.Tensor, scale: Float32, stream: cuda.CUstream):
            post(acc, dx, scale, None, None, None, None, stream)

        export(f"fa4_postkv_{kvtag}", entry_postkv, acc, dx, Float32(0.125), cuda.CUstream(0),
               kinds=["t:acc", "t:dx", "f32", "stream"])


def attempt(fn, *args):
    """fn(*args), an FA4 refusal (an assert or an error of its compile) recorded in spec's
    "refused" instead of ending the run."""
    key = f"{fn.__name__}{args}"
    try:
        fn(*args)
        refused.pop(key, None)
    except Exception as e:  # noqa: BLE001 (any refusal is the finding)
        refused[key] = f"{type(e).__name__}: {str(e)[:600]}"
        print("REFUSED", key, refused[key], flush=True)


refused = {}


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    what = sys.argv[2:] or ["fwd", "bwd"]
    old = json.load(open(f"{OUT}/spec.json")) if os.path.exists(f"{OUT}/spec.json") else {}
    spec.update(old.get("exports", {}))
    refused.update(old.get("refused", {}))
    dense = [d for d in (64, 128, 256) if "fwd" in what or "bwd" in what]
    for d in dense:
        for causal in (False, True):
            if "fwd" in what:
                fwd(d, causal)
            if "bwd" in what:
                bwd_rows(d, causal)
                bwd(d, causal, False)
                if d <= 128:
                    bwd(d, causal, True)
    if "varlen" in what:
        for causal in (False, True):
            for qhpk in (1, 4):
                attempt(varlen_fwd, 128, causal, qhpk)
            attempt(varlen_rows, 128, causal)
            for qhpk in (1, 4):
                attempt(varlen_bwd, 128, causal, qhpk)
    if "local" in what:  # gpt-oss-like (d64, GQA 8:1) and Gemma-like (d128, d256, GQA 2:1, softcap 50)
        attempt(local_fwd, 64, 8, 0.0)
        attempt(local_fwd, 128, 2, 50.0)
        attempt(local_fwd, 256, 2, 50.0)
    if "local_bwd" in what:  # the same layers' backward (no softcap: fa4_aot builds none)
        for d, qhpk in ((64, 8), (128, 2), (256, 2)):
            attempt(local_rows, d)
            attempt(local_bwd, d, qhpk)
            if d > 64:
                attempt(local_bwd, d, qhpk, 50.0)
    if "gqa" in what:  # same_run_gqa.py: GQA packed forwards, dense and varlen (issue 38's GQA prefill)
        for causal in (False, True):
            for d, qhpk in ((128, 4), (128, 8), (64, 8)):
                attempt(fwd, d, causal, None, qhpk)
            attempt(varlen_fwd, 128, causal, 8)
    if "decode" in what:
        for paged in (None, "tma", "cpasync"):
            attempt(decode, 128, 4, paged)
    if "dv" in what:  # head_dim 192 with head_dim_v 128 (DeepSeek V3), MHA (FA4's sm90 backward asserts for GQA)
        for causal in (False, True):
            attempt(fwd, 192, causal, 128)
            attempt(bwd_rows, 192, causal, 128)
            attempt(bwd, 192, causal, False, 128)
    cfgs = {d: {c: _tile_size_bwd_sm90(d, d, c, False).__dict__ for c in (False, True)} for d in (64, 128, 256)}
    cfgs["192v128"] = {c: _tile_size_bwd_sm90(192, 128, c, False).__dict__ for c in (False, True)}
    fwd_cfgs = {d: {c: _tile_size_fwd_sm90(d, d, c, False).__dict__ for c in (False, True)} for d in (64, 128, 256)}
    json.dump({"exports": spec, "bwd_cfg": {str(d): {str(c): v for c, v in x.items()} for d, x in cfgs.items()},
               "fwd_cfg": {str(d): {str(c): v for c, v in x.items()} for d, x in fwd_cfgs.items()},
               "refused": refused, "sources": os.environ.get("FA4_SOURCES", "")},
              open(f"{OUT}/spec.json", "w"), indent=1)
