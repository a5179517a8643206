"""Launches for compute-sanitizer (tests/gpu/test_sanitizer.py runs this file under it):
the forward and both backward modes of every bf16 head dim, causal and not (and the
backward's two-tile kernels where a variant has them), on shapes with partial tiles each
way, MQA/GQA and seqlen_q != seqlen_k; the varlen forward and backward with lying
metadata (varlen_cases); and the backward's split last wave
(policy.tail_split) on a multiprocessor count taken as 4, since these shapes are too
small to leave a partial wave on a whole device. The backward's workspace is the
exact size the problem needs (the torch adapter's), and test_sanitizer.py turns torch's
caching allocator off, so every array is its own allocation and memcheck sees any access
past its end.

python -m tests.gpu.sanitizer_cases [KERNELS_DIR]  (default: the package's cubins)"""

import itertools
import sys
from pathlib import Path

import torch

import fa4_aot

from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd
from fa4_aot.variants import MATRIX

SHAPES = [(3, 17, 17, 2, 1), (2, 333, 200, 4, 2), (1, 200, 333, 3, 1)]  # (b, s_q, s_k, h_q, h_kv)
# on 4 SMs: 9 key tiles, the last in 4 ragged pieces; 18 items, the last 2 in 2 pieces each
SPLIT_SHAPES = [(1, 700, 1100, 1, 1), (2, 1000, 300, 3, 3)]
SPLIT_SM_COUNT = 4


def main():
    dims = sorted({v.head_dim for v in MATRIX if v.kind == "bwd" and v.arch == "sm90a"})
    for d in dims:
        for causal in (False, True):
            for b, sq, sk, hq, hkv in SHAPES:
                q, do = (torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                out, lse = flash_attn_fwd(q, k, v, causal=causal)
                for deterministic in (False, True):
                    flash_attn_bwd(q, k, v, out, do, lse, causal=causal, deterministic=deterministic)
                if two_tiles(d, causal):  # the variant's other kernel (picked for longer keys)
                    flash_attn_bwd(q, k, v, out, do, lse, causal=causal, q_tiles=2)
    split_dims = split_tail_cases()
    varlen_cases()
    decode_cases()
    torch.cuda.synchronize()
    print(f"sanitizer cases done: head dims {dims}, split last wave at {split_dims}")


def two_tiles(head_dim, causal):
    """Whether the not-deterministic backward variant also has a two-tile kernel (q_tiles 2)."""
    import fa4_aot.dense as api

    return api.default_library().manifest.built(kind="bwd", arch="sm90a", dtype="bf16", head_dim=head_dim,
                                                 causal=causal, deterministic=False, q_tiles=2)


def split_tail_cases():
    """The split last wave of every head dim that takes it, on SPLIT_SM_COUNT SMs (the
    library's count replaced, as tests/gpu/test_bwd.py does). Returns those head dims."""
    import fa4_aot.dense as api
    import fa4_aot.policy as policy

    library = api.default_library()
    library.sm_count = lambda device: SPLIT_SM_COUNT
    library.launch_again = lambda key, waits=(), aliases=(): False  # launch plans are kept by arrays, not SM counts
    rows = {v.head_dim: library.manifest.row(v) for v in MATRIX
            if v.kind == "bwd" and v.arch == "sm90a" and v.dtype == "bf16" and not v.causal and not v.deterministic
            and not v.varlen}
    dims = sorted(d for d, row in rows.items() if row["config"]["tail_split"])
    for d in dims:
        config, most = rows[d]["config"], rows[d]["workspace"]["constants"]["tail_max_tiles"]
        for b, sq, sk, hq, hkv in SPLIT_SHAPES:
            sizes = {"batch": b, "seqlen_q": sq, "seqlen_k": sk, "heads_q": hq, "heads_kv": hkv, "head_dim": d}
            assert policy.backward_tail_split(sizes, config, most, SPLIT_SM_COUNT)[0] > 0, "the case does not split"
            q, do = (torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            out, lse = flash_attn_fwd(q, k, v)
            flash_attn_bwd(q, k, v, out, do, lse)
    return dims


def varlen_cases():
    """The varlen forward of every bf16 head dim, causal and not: a mix with empty, one-row
    and ragged sequences, and metadata that lies (cu_seqlens decreasing and past the
    totals, a max_seqlen_q too small): every access must stay inside the tensors."""
    from fa4_aot.torch import flash_attn_varlen_fwd

    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    for v in (v for v in MATRIX if v.kind == "fwd" and v.varlen and v.dtype == "bf16"):
        d = v.head_dim
        q = torch.randn(333, 4, d, device="cuda", dtype=torch.bfloat16)
        k, val = (torch.randn(200, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for cu_q, cu_k, max_q in (([0, 1, 1, 200, 333], [0, 0, 77, 150, 200], 199),
                                  ([0, 300, 40, 9999, 2], [-5, 150, 2**30, 3, 200], 64)):
            for order in ("plain", "lpt"):
                flash_attn_varlen_fwd(q, k, val, as_i32(cu_q), as_i32(cu_k), max_q, 1 << 20, causal=v.causal,
                                      order=order)
    varlen_backward_cases()


def varlen_backward_cases():
    """The varlen backward of every bf16 head dim, causal and not, deterministic and not: the
    same mixes and lying metadata as the forward's, and seqused past the packed rows (two
    sequences then share workspace tiles; in the last case 16 sequences overlap so far
    that their tiles pass every grid's bound, and the launch must still end), in both
    sequence orders; the workspace is the exact size the adapter allocates."""
    from fa4_aot.torch import flash_attn_varlen_bwd

    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    cases = (([0, 1, 1, 200, 333], [0, 0, 77, 150, 200], 199, {}),
             ([0, 300, 40, 9999, 2], [-5, 150, 2**30, 3, 200], 64, {}),
             ([0, 100, 333], [0, 120, 200], 8, {"seqused_q": [300, 2**30], "seqused_k": [199, 5]}),
             (list(range(17)), list(range(17)), 8, {"seqused_q": [333] * 16, "seqused_k": [200] * 16}))
    for v in (v for v in MATRIX if v.kind == "bwd" and v.varlen and v.dtype == "bf16"):
        d = v.head_dim
        q, do = (torch.randn(333, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, val = (torch.randn(200, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = torch.randn_like(q)
        lse = torch.randn(4, 333, device="cuda")
        for (cu_q, cu_k, max_q, used), order in itertools.product(cases, ("plain", "lpt")):
            flash_attn_varlen_bwd(q, k, val, out, do, lse, as_i32(cu_q), as_i32(cu_k), max_q, 1 << 20,
                                  causal=v.causal, deterministic=v.deterministic, order=order,
                                  **{n: as_i32(x) for n, x in used.items()})


def decode_cases():
    """Decode of every bf16 head dim, causal and not, contiguous and paged (pages of 48
    keys: pieces of 16), one split and three, with metadata that lies: cache lengths
    negative and past the cache, page numbers negative and past the pages."""
    from fa4_aot.torch import flash_attn_with_kvcache

    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    for v in (v for v in MATRIX if v.kind == "decode" and v.dtype == "bf16"):
        d = v.head_dim
        q = torch.randn(3, 5, 8, d, device="cuda", dtype=torch.bfloat16)
        k, val = (torch.randn(3, 200, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pk, pv = (torch.randn(7, 48, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = as_i32([[0, 1, 2, 3], [-4, 6, 2**30, 5], [6, 5, 4, 3]])
        for lengths in ([0, 1, 200], [-7, 2**30, 150]):
            for splits in (1, 3):
                flash_attn_with_kvcache(q, k, val, cache_seqlens=as_i32(lengths), causal=v.causal, num_splits=splits)
                flash_attn_with_kvcache(q, pk, pv, cache_seqlens=as_i32(lengths), page_table=table, causal=v.causal,
                                        num_splits=splits)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        from fa4_aot.launch.loader import KernelLibrary

        fa4_aot.set_default_library(KernelLibrary(Path(sys.argv[1])))
    main()
