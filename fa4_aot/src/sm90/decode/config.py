"""Every compile-time knob of one sm_90a decode variant (attention of a few query tokens
against a KV cache), derived once from its ``Variant``. Pure Python: no DSL import.

Decode reads each K and V byte once per KV head and does little arithmetic on it, so the
shape is chosen for bytes in flight, not for tensor-core throughput: one consumer
warpgroup of 64 packed rows (the query heads that share a KV head, times the query
tokens), key tiles as deep as 227 KB of shared memory allows, and a split of the key
range over CTAs chosen at run time (docs/design.md, "Decode").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...common.registers import check_roles, launch_registers

WARPGROUP = 128
ROWS = 64  # packed (query token, query head) rows per CTA: one consumer warpgroup
# (tile_n keys per step, K/V stages) per head dim: 2 x stages x tile_n x head_dim x 2 bytes
# of K/V plus the 64-row Q tile within 227 KB (one CTA per SM; 192-224 KB in flight).
TILES = {64: (128, 4), 96: (128, 3), 128: (128, 3), 192: (64, 4), 256: (64, 3)}
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # setmaxnreg: two warpgroups within 64K registers
# Head dims whose O does not fit one warpgroup's registers (64 rows x 512 fp32 is 256 a
# thread): two consumer warpgroups share the 64 packed rows, each owning half the head dim,
# S's halves summed through shared memory (as the forward's head_split.py). (tile_n, stages):
# Q 64 KB, two stages of 32-key K and V (128 KB in flight), S's halves 16 KB: 208 KB.
TILES_HEAD_SPLIT = {512: (32, 2)}
HEAD_SPLIT_REGS = (24, 240)  # producer, each consumer: three warpgroups within 64K
# Local at head_dim 64, span any (gpt-oss's full layers: sinks over the whole cache;
# windows wider than policy.DECODE_NARROW_MAX_SPAN): 64-key tiles, 2 stages, three CTAs per
# SM. The full layers, 8 x 32k: 2748 GB/s; 32-key tiles at four CTAs 2680; the plain
# decode's 128-key tiles at one CTA 2661 (128k: 2779, 2769, 2830). A CTA is one consumer
# warpgroup and one producer warp (``producer_warp``, as the span-narrow kernels below:
# 113 registers, 128 capped, no spills), not two warpgroups at 40 + 120: H100, gpt-oss's
# window at batch 16 +3-13% (paged +5-8%), its full layers within 0.4%; at four CTAs (96
# registers) no gain (docs/design.md, "Local attention, sinks, softcap": windowed decode).
# (tile_n, stages, CTAs per SM)
LOCAL_TILES = {64: (64, 2, 3)}
# The span-narrow kernels (a bounded window, policy.decode_narrow): 32-key tiles, 4 stages,
# four CTAs per SM: gpt-oss's window 128 at batch 256 1493 -> 1702-1734 GB/s, windows
# 256-8192 +2.5-7%; its full layers (8 x 32k, sinks) 2748 -> 2680, and windows at batch
# 8-16 (split) -4 to -27%, hence a kernel of its own. A CTA is one consumer warpgroup and
# one producer warp (160 threads, ``producer_warp``: 85 registers a thread, no spills), not
# two warpgroups of which the producer's used one warp (256 threads at 24 + 104 registers):
# H100, window 32 +7-8%, batch 64 +6-9%, window 128 +0.5-2% (five CTAs an SM: 72
# registers with spills, half the speed) (docs/design.md, "Local attention, sinks,
# softcap": windowed decode).
# (tile_n, stages, CTAs per SM)
NARROW_SPAN = {64: (32, 4, 4)}
# Local with a cap at head_dim 128 (Gemma 2's d128 window): the consumer's tanh over a KV
# head's rows bounds it on the H200 (one warp holds both rows of a head at GQA 16:8), so two
# CTAs an SM, each at 32-key tiles and 4 stages ((40 + 216) x 128 = 128 registers a thread
# of 256; three CTAs do not fit a wgmma's 94): H200 window 4096 at 16 x 32k 3052 -> 3677
# GB/s (0.72 -> 0.86 of the copy), paged +19%; the uncapped window 1-3% slower this way,
# the H100 within 2% (docs/design.md, "Local attention, sinks, softcap": windowed decode).
LOCAL_CAPPED_TILES = {128: (32, 4, 2, 40, 216)}
# The 16-bit local kernels load K and V in TMA pieces of this many keys, and not the pieces
# wholly outside the keys a CTA's rows see (a window's edges fall mid-tile:
# kernel._piece_place). H100, in one process: gpt-oss's window 128 +2.9% (paged +0.4%),
# window 512 +1.5-2.3%, window 32 within 1%, Gemma d256 window 1024 +3.7%; pieces of 8
# keys: the paged window -4% (docs/design.md, "Local attention, sinks, softcap": windowed decode).
LOCAL_PIECE_ROWS = 16
# An FP8 (e4m3) cache: TMA brings e4m3 tiles (half the bytes of a 16-bit one), a third
# warpgroup widens each into one 16-bit K and one V buffer that the consumer's wgmmas read
# (docs/design.md, "Decode": FP8 cache). (tile_n, e4m3 stages) per head dim: the stages
# take what 227 KB leaves beside the Q tile and the two 16-bit buffers (96-128 KB in flight).
TILES_E4M3 = {64: (128, 6), 96: (128, 5), 128: (128, 4), 192: (64, 5), 256: (64, 3)}
# the widener's registers: at 56 it spilled addresses and loaded one 16-byte chunk at a time
# (2.29-2.71 TB/s of FP8 bytes); at 96, 2.51-2.96 (docs/design.md, "FP8 cache")
WIDENER_REGS = 96
# Head dims whose kernels also read two adjacent KV heads of half the width as one head
# (run-time ``pair_heads``): a cache of head dim <= 64 has 128-byte rows a head, and a CTA
# reading one head's half of every 256 bytes leaves the rest of each DRAM burst to another
# CTA at another time (issue 38's 32 x 16k GQA 16:2 d64 case at 0.73-0.75 of the copy,
# cuDNN 0.80; the d128 shapes 0.99). Paired, a row tile's packed rows are both heads' query
# heads, each row's Q and O in its own head's half of the columns, and with an FP8 cache
# its own head's scales, and with sinks (the local kernels, but FP8's) its own head's sink
# (docs/design.md, "Decode"; the local ones are paired only where no window bounds the keys
# behind: policy.decode_pairs).
PAIRED_HEAD_DIMS = (128,)
COMBINE_ROWS = 4  # the combine kernel: one warp per (batch, query token, query head) row
MAX_SPLITS = 128  # the most key-range splits a launch takes (the workspace is sized up to it)
MAX_SEQLEN_Q = 128  # query tokens per sequence (speculative and chunked decoding); more: the dense forward
PAGE_ALIGN = 16  # page sizes are multiples of this many keys: a key tile's pieces keep whole swizzle atoms


@dataclass(frozen=True)
class DecodeConfig:
    dtype: str  # "bf16" or "fp16"
    head_dim: int
    causal: bool  # each sequence's queries aligned to the end of its cache
    tile_m: int  # packed rows per CTA
    tile_n: int  # keys per step
    stages: int  # K / V pipeline stages
    threads: int
    producer_regs: int
    consumer_regs: int
    local: bool = False  # a sliding window (left, right at run time) and sinks
    softcap: bool = False  # scores cap * tanh(s / cap), the cap at run time
    ctas_per_sm: int = 1  # the launch's min_blocks_per_mp
    kv_dtype: str = "same"  # "e4m3": an FP8 cache, widened on chip by a third warpgroup
    widener_regs: int = 0
    head_split: bool = False  # two consumer warpgroups on the 64 rows, half the head dim each
    pairs: bool = False  # may read two adjacent KV heads as one (run-time pair_heads: 1 or 2)
    piece_rows: int = 0  # keys per TMA piece of a contiguous cache (0: the tile): LOCAL_PIECE_ROWS
    # warps 0-3 the consumer warpgroup, warp 4 the producer (160 threads); no setmaxnreg
    # (producer_regs, consumer_regs 0): every thread at the launch's register cap
    producer_warp: bool = False
    # one CTA per slot (sm_count x ctas_per_sm), each walking (row tile x split, KV head,
    # sequence) items in launch order: the producer warp loads the next item's tiles and
    # the consumer fetches its Q while this one runs (docs/design.md, "Local attention,
    # sinks, softcap": windowed decode)
    persistent: bool = False

    @property
    def consumers(self) -> int:
        """Consumer warpgroups: two where the head dim is split, else one."""
        return 2 if self.head_split else 1

    @property
    def register_roles(self) -> list[tuple[int, int]]:
        """(threads, registers after setmaxnreg) of each role: the producer warpgroup, the
        widener's (FP8), the consumers; none with a producer warp (no setmaxnreg)."""
        if self.producer_warp:
            return []
        widener = [(WARPGROUP, self.widener_regs)] if self.fp8 else []
        return [(WARPGROUP, self.producer_regs), *widener, (WARPGROUP * self.consumers, self.consumer_regs)]

    def __post_init__(self):
        check_roles(f"decode {self.head_dim}", self.register_roles, self.threads,
                    launch_registers(self.threads, self.ctas_per_sm))

    @classmethod
    def of(cls, variant) -> "DecodeConfig":
        """The config of a ``fa4_aot.variants.Variant`` of kind decode, arch sm90a."""
        assert variant.kind == "decode" and variant.arch == "sm90a", variant
        if variant.head_dim in TILES_HEAD_SPLIT:
            assert not variant.local and variant.kv_dtype == "same", variant
            tile_n, stages = TILES_HEAD_SPLIT[variant.head_dim]
            producer_regs, consumer_regs = HEAD_SPLIT_REGS
            return cls(dtype=variant.dtype, head_dim=variant.head_dim, causal=variant.causal, tile_m=ROWS,
                       tile_n=tile_n, stages=stages, threads=3 * WARPGROUP, producer_regs=producer_regs,
                       consumer_regs=consumer_regs, head_split=True)
        tile_n, stages = TILES[variant.head_dim]
        ctas, producer_regs, consumer_regs = 1, PRODUCER_REGS, CONSUMER_REGS
        producer_warp = False  # the kernels of several CTAs an SM with an idle producer warpgroup: a warp
        fp8 = variant.kv_dtype == "e4m3"
        if fp8:
            tile_n, stages = TILES_E4M3[variant.head_dim]
        elif variant.span == "narrow":
            (tile_n, stages, ctas), producer_warp = NARROW_SPAN[variant.head_dim], True
        elif variant.local and variant.softcap and variant.head_dim in LOCAL_CAPPED_TILES:
            tile_n, stages, ctas, producer_regs, consumer_regs = LOCAL_CAPPED_TILES[variant.head_dim]
        elif variant.local and variant.head_dim in LOCAL_TILES:
            (tile_n, stages, ctas), producer_warp = LOCAL_TILES[variant.head_dim], True
        if producer_warp:  # no setmaxnreg
            producer_regs = consumer_regs = 0
        return cls(dtype=variant.dtype, head_dim=variant.head_dim, causal=variant.causal, tile_m=ROWS,
                   tile_n=tile_n, stages=stages,
                   threads=WARPGROUP + 32 if producer_warp else (3 if fp8 else 2) * WARPGROUP,
                   producer_regs=producer_regs,
                   consumer_regs=consumer_regs, local=variant.local, softcap=variant.softcap, ctas_per_sm=ctas,
                   kv_dtype=variant.kv_dtype, widener_regs=WIDENER_REGS if fp8 else 0,
                   pairs=variant.head_dim in PAIRED_HEAD_DIMS and not variant.softcap
                   and not (variant.local and fp8), piece_rows=LOCAL_PIECE_ROWS if variant.local and not fp8 else 0,
                   producer_warp=producer_warp, persistent=variant.span == "narrow")

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "e4m3"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CombineConfig:
    dtype: str
    head_dim: int
    rows: int  # rows per CTA (one warp each)
    threads: int

    @classmethod
    def of(cls, variant) -> "CombineConfig":
        assert variant.kind == "combine" and variant.arch == "sm90a", variant
        return cls(dtype=variant.dtype, head_dim=variant.head_dim, rows=COMBINE_ROWS, threads=32 * COMBINE_ROWS)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def workspace_rule(cfg: DecodeConfig) -> dict:
    """The split-KV workspace (fa4_aot.launch.workspace's rule form): each split's normalized O
    (fp32, (splits, batch, seqlen_q, heads_q, head_dim)) and LSE ((splits, batch, heads_q,
    seqlen_q)); ``splits`` is the launch's num_splits."""
    return {
        "align": 256,
        "constants": {"query_tile": cfg.tile_m, "max_splits": MAX_SPLITS},
        "regions": [
            {"name": "o_partial", "itemsize": 4, "count": ["splits", "batch", "seqlen_q", "heads_q", "head_dim"]},
            {"name": "lse_partial", "itemsize": 4, "count": ["splits", "batch", "heads_q", "seqlen_q"]},
        ],
    }


def limits() -> dict:
    """What a decode launch may ask (the run time checks calls against the row's copy)."""
    return {"max_splits": MAX_SPLITS, "max_seqlen_q": MAX_SEQLEN_Q, "page_align": PAGE_ALIGN}


def launch_values(cfg: DecodeConfig) -> dict:
    """Launch values the run time derives from a call (fa4_aot.launch.rules expressions): the keys
    of a TMA piece, ``cfg.piece_rows`` or else the key tile, or for a paged cache the pages'
    and that piece's common rows (a tile that crosses pages is loaded in pieces; the K/V
    maps' box rows)."""
    piece = cfg.piece_rows or cfg.tile_n
    return {"piece_rows": ["if", "paged", ["gcd", "cache_rows", piece], piece]}
