"""Launches for compute-sanitizer (tests/gpu/test_sanitizer.py runs this file under it):
every cubin of the build at least once (main asserts it), on shapes with partial tiles
each way, MQA/GQA and seqlen_q != seqlen_k: the forward with one and two query tiles,
the backward in every mode (and its two-tile kernels); the varlen forward and backward
with lying metadata (cu_seqlens decreasing, past the totals, not starting at 0; seqused
negative and past the packed rows; a max_seqlen too small); decode with more than one
row tile and with lying cache lengths and page numbers, split and not (the combine); and
the backward's split last wave (policy.tail_split) on a multiprocessor count taken as 4,
since these shapes are too small to leave a partial wave on a whole device. The
backward's workspace is the exact size the problem needs (the torch adapter's), and
test_sanitizer.py turns torch's caching allocator off, so every array is its own
allocation and memcheck sees any access past its end.

python -m tests.gpu.sanitizer_cases [KERNELS_DIR]  (default: the package's cubins)"""

import itertools
import sys
from pathlib import Path

import torch

import fa4_aot

from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd
from fa4_aot.variants import MATRIX

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(3, 17, 17, 2, 1), (2, 333, 200, 4, 2), (1, 200, 333, 3, 1)]  # (b, s_q, s_k, h_q, h_kv)
# on 4 SMs: 9 key tiles, the last in 4 ragged pieces; 18 items, the last 2 in 2 pieces each
SPLIT_SHAPES = [(1, 700, 1100, 1, 1), (2, 1000, 300, 3, 3)]
SPLIT_SM_COUNT = 4
# the local kernels' windows: both edges off the tiles, a single key, and past int32 when
# added to a row (the kernel clamps a window to the sequence)
WINDOWS = [(37, 5), (0, 0), (2**31 - 1, 2**31 - 1)]


def main():
    library = fa4_aot.default_library()
    dense_cases()
    varlen_cases()
    decode_cases()
    split_dims = split_tail_cases()
    torch.cuda.synchronize()
    built = {v.name for v in MATRIX} & set(library.manifest.rows)
    launched = {name for _, name in library._functions}
    assert launched == built, f"cubins never launched here: {sorted(built - launched)}"
    print(f"sanitizer cases done: all {len(built)} cubins launched; split last wave at {split_dims}")


def dense_cases():
    """Every dense forward (one and two query tiles) and backward (every mode, and the
    two-tile kernels) of every dtype and head dim, causal and not, on SHAPES."""
    for v in (v for v in MATRIX if v.kind == "fwd" and not v.varlen):
        for (b, sq, sk, hq, hkv), window in itertools.product(SHAPES, WINDOWS if v.local else [None]):
            q, k, val = _bshd(b, sq, hq, v), _bshd(b, sk, hkv, v), _bshd(b, sk, hkv, v, _dv(v))
            flash_attn_fwd(q, k, val, causal=v.causal, q_tiles=v.q_tiles, **_mods(v, hq, window))
    for v in (v for v in MATRIX if v.kind == "bwd" and not v.varlen):
        for (b, sq, sk, hq, hkv), window in itertools.product(SHAPES, WINDOWS if v.local else [None]):
            q, do = _bshd(b, sq, hq, v), _bshd(b, sq, hq, v, _dv(v))
            k, val = _bshd(b, sk, hkv, v), _bshd(b, sk, hkv, v, _dv(v))
            mods = _mods(v, hq, window)  # local: a window and sinks, their gradient too
            out, lse = flash_attn_fwd(q, k, val, causal=v.causal, q_tiles=1, **mods)
            flash_attn_bwd(q, k, val, out, do, lse, causal=v.causal, deterministic=v.deterministic,
                           q_tiles=v.q_tiles, **mods)


def _mods(v, heads_q, window):
    """A local variant's options: ``window``, sinks, and a cap where softcap; {} otherwise
    (a backward's: softcap 0, as its forward's)."""
    if not v.local:
        return {}
    return {"window_size": window, "softcap": 5.0 if v.softcap else 0.0,
            "learnable_sink": torch.randn(heads_q, device="cuda")}


def _bshd(b, s, h, v, d=None):
    return torch.randn(b, s, h, d or v.head_dim, device="cuda", dtype=DTYPES[v.dtype])


def _dv(v):
    """v's head dim for variant ``v`` (its own where the variant has one: 192/128)."""
    return v.head_dim_v or v.head_dim


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
            and not v.varlen and not v.head_dim_v}
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
    """The varlen forward of every variant: a mix with empty, one-row and ragged sequences,
    and metadata that lies (cu_seqlens decreasing, past the totals, not starting at 0;
    seqused past the packed rows and negative; a max_seqlen_q too small), in both
    sequence orders: every access must stay inside the tensors."""
    from fa4_aot.torch import flash_attn_varlen_fwd

    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    cases = (([0, 1, 1, 200, 333], [0, 0, 77, 150, 200], 199, {}),
             ([0, 300, 40, 9999, 2], [-5, 150, 2**30, 3, 200], 64, {}),
             ([7, 100, 333], [3, 120, 200], 8, {}),  # cu_seqlens not starting at 0
             ([0, 100, 333], [0, 120, 200], 8, {"seqused_q": [300, 2**30], "seqused_k": [199, 5]}),
             ([0, 100, 333], [0, 120, 200], 8, {"seqused_q": [-5, 40], "seqused_k": [-1, 2**31 - 1]}))
    for v in (v for v in MATRIX if v.kind == "fwd" and v.varlen):
        dtype, d = DTYPES[v.dtype], v.head_dim
        q = torch.randn(333, 4, d, device="cuda", dtype=dtype)
        k, val = (torch.randn(200, 2, w, device="cuda", dtype=dtype) for w in (d, _dv(v)))
        mods = _mods(v, 4, WINDOWS[0])
        for (cu_q, cu_k, max_q, used), order in itertools.product(cases, ("plain", "lpt")):
            flash_attn_varlen_fwd(q, k, val, as_i32(cu_q), as_i32(cu_k), max_q, 1 << 20, causal=v.causal,
                                  order=order, **{n: as_i32(x) for n, x in used.items()}, **mods)
    varlen_backward_cases()


def varlen_backward_cases():
    """The varlen backward of every variant (cu_seqlens not starting at 0 and negative
    seqused too): the
    same mixes and lying metadata as the forward's, and seqused past the packed rows (two
    sequences then share workspace tiles; in the last case 16 sequences overlap so far
    that their tiles pass every grid's bound, and the launch must still end), in both
    sequence orders; the workspace is the exact size the adapter allocates."""
    from fa4_aot.torch import flash_attn_varlen_bwd

    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    cases = (([0, 1, 1, 200, 333], [0, 0, 77, 150, 200], 199, {}),
             ([0, 300, 40, 9999, 2], [-5, 150, 2**30, 3, 200], 64, {}),
             ([0, 100, 333], [0, 120, 200], 8, {"seqused_q": [300, 2**30], "seqused_k": [199, 5]}),
             (list(range(17)), list(range(17)), 8, {"seqused_q": [333] * 16, "seqused_k": [200] * 16}),
             ([7, 100, 333], [3, 120, 200], 8, {"seqused_q": [-5, 40], "seqused_k": [-1, 150]}))
    for v in (v for v in MATRIX if v.kind == "bwd" and v.varlen):
        dtype, d = DTYPES[v.dtype], v.head_dim
        q, do = (torch.randn(333, 4, w, device="cuda", dtype=dtype) for w in (d, _dv(v)))
        k, val = (torch.randn(200, 2, w, device="cuda", dtype=dtype) for w in (d, _dv(v)))
        out = torch.randn_like(do)
        lse = torch.randn(4, 333, device="cuda")
        mods = _mods(v, 4, WINDOWS[0])  # local: a window, sinks and their gradient
        for (cu_q, cu_k, max_q, used), order in itertools.product(cases, ("plain", "lpt")):
            flash_attn_varlen_bwd(q, k, val, out, do, lse, as_i32(cu_q), as_i32(cu_k), max_q, 1 << 20,
                                  causal=v.causal, deterministic=v.deterministic, order=order,
                                  **{n: as_i32(x) for n, x in used.items()}, **mods)


def decode_cases():
    """Decode of every variant (an FP8 cache's with scales; the local d128 ones also reading
    64-column heads in pairs), contiguous and paged (pages of 48 keys: pieces of 16), one
    split and three (the combine), one row tile per KV head and two (4 query heads x 5
    tokens = 20 rows; 8 x 16 = 128), with metadata that lies: cache lengths negative and
    past the cache, page numbers negative and past the pages."""
    from fa4_aot import policy
    from fa4_aot.torch import flash_attn_with_kvcache

    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    span_policy, pair_keys = policy.decode_narrow, policy.DECODE_LOCAL_PAIR_MIN_KEYS
    for v in (v for v in MATRIX if v.kind == "decode"):
        policy.decode_narrow = lambda *_, narrow=v.span == "narrow": narrow  # the window on each span's kernel
        dtype, d = DTYPES[v.dtype], v.head_dim
        cache = torch.float8_e4m3fn if v.kv_dtype == "e4m3" else dtype  # FP8: with scales per (sequence, head)
        k, val = (torch.randn(3, 200, 2, d, device="cuda", dtype=dtype).to(cache) for _ in range(2))
        pk, pv = (torch.randn(7, 48, 2, d, device="cuda", dtype=dtype).to(cache) for _ in range(2))
        scales = {n: torch.rand(3, 2, device="cuda") for n in ("k_descale", "v_descale")} if cache != dtype else {}
        table = as_i32([[0, 1, 2, 3], [-4, 6, 2**30, 5], [6, 5, 4, 3]])
        for tokens, heads_q in ((5, 8), (16, 16)):
            q = torch.randn(3, tokens, heads_q, d, device="cuda", dtype=dtype)
            mods = _mods(v, heads_q, WINDOWS[0])  # local: a window, sinks (a cap)
            for lengths in ([0, 1, 200], [-7, 2**30, 150]):
                for splits in (1, 3):
                    flash_attn_with_kvcache(q, k, val, cache_seqlens=as_i32(lengths), causal=v.causal,
                                            num_splits=splits, **mods, **scales)
                    flash_attn_with_kvcache(q, pk, pv, cache_seqlens=as_i32(lengths), page_table=table,
                                            causal=v.causal, num_splits=splits, **mods, **scales)
        if v.local and not v.softcap and v.kv_dtype == "same" and d == 128:  # 64-column heads in pairs, sinks only
            policy.DECODE_LOCAL_PAIR_MIN_KEYS = 0  # pairs on these short caches too
            q = torch.randn(3, 5, 8, 64, device="cuda", dtype=dtype)
            half = [x[..., :64].contiguous() for x in (k, val, pk, pv)]
            sinks = torch.randn(8, device="cuda")
            for lengths, splits in itertools.product(([0, 1, 200], [-7, 2**30, 150]), (1, 3)):
                flash_attn_with_kvcache(q, half[0], half[1], cache_seqlens=as_i32(lengths), num_splits=splits,
                                        learnable_sink=sinks)
                flash_attn_with_kvcache(q, half[2], half[3], cache_seqlens=as_i32(lengths), page_table=table,
                                        num_splits=splits, learnable_sink=sinks)
    policy.decode_narrow, policy.DECODE_LOCAL_PAIR_MIN_KEYS = span_policy, pair_keys


if __name__ == "__main__":
    if len(sys.argv) > 1:
        from fa4_aot.launch.loader import KernelLibrary

        fa4_aot.set_default_library(KernelLibrary(Path(sys.argv[1])))
    main()
