"""Every compile-time knob of one sm_90a forward variant, derived once from its ``Variant``.

``FwdConfig.of(variant)`` is the one place that looks at the variant's head dim, dtype
and q_tiles and decides the kernel's shape; the kernel reads the config and the build
writes it into the manifest row (``config``). Pure Python: no DSL import.

Each knob's reason and the measurement behind it: docs/design.md, "Forward (sm90)".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...common.registers import check_roles, launch_registers

WARPGROUP = 128

# (tile_m query rows per CTA, tile_n keys per step, K/V stages) per head dim: three
# consumer warpgroups (192-row tiles, 160 registers each) at head_dim 64, where a
# warpgroup's softmax needs the GEMMs of two others to hide behind; two elsewhere (three
# spill from head_dim 96 up); key tiles sized so that S (64 x tile_n) and O (64 x
# head_dim) fp32 fragments fit the registers and the K/V stages 227 KB of shared memory
# (docs/design.md, "Forward: tiles and warpgroups").
TILES = {64: (192, 128, 2), 96: (128, 128, 2), 128: (128, 128, 2), 192: (128, 112, 2), 256: (128, 80, 2)}
# The local kernels' tiles (windows, sinks, softcap): keys per step halved at head_dim 64
# and 256, where a narrow window wastes most of a wide key tile (measured against the plain
# tiles, with each warpgroup computing only its own rows' key range: gpt-oss's window of
# 128, 120 TFLOP/s against 108; Gemma's head_dim 256, window 1024, +6% capped and uncapped;
# docs/design.md, "Local attention, sinks, softcap").
# At head_dim 64 four consumer warpgroups (256 x 64): a narrow window leaves each warpgroup
# a few key tiles a query tile, so a fourth hides more of the others' waits (gpt-oss, H100:
# 145 -> 155 TFLOP/s at 16k tokens a sequence, 138 -> 144 at 128k).
LOCAL_TILES = {**TILES, 64: (256, 64, 4), 256: (128, 64, 2)}
# Head dims whose dense local forward launches the query heads of a KV head next to each
# other, tile by tile, where one query head's K and V (16-bit) pass LOCAL_KV_HEAD_BYTES, so
# that each window's K and V are read from DRAM once for the group, not once a head after
# L2 has lost them: at 128k tokens a sequence, d64 windows 128-512 +3-6% (gpt-oss +4%);
# Gemma d256 -2 to +2% and d128 -3 to +2%, not taken. 8 MB (32k keys at d64) against 20:
# 64k +0.6-2.5%, 32k and 128k equal; 2 MB takes 16k too: -1% there (docs/design.md, "Local
# attention, sinks, softcap").
LOCAL_KV_HEAD_ORDER = (64,)
LOCAL_KV_HEAD_BYTES = 8 * 1024 * 1024
# (head_dim, head_dim_v) pairs with a kernel of their own: 192/128 holds 128-key tiles (S and
# O fragments as at head_dim 128; Q 48 KB, two stages of K 48 KB and V 32 KB each: 208 KB).
PAIR_TILES = {(192, 128): (128, 128, 2)}
# Head dims whose O does not fit one warpgroup's registers (64 rows x 512 fp32 is 256 a
# thread): two consumer warpgroups share a 64-row tile, each owning half of O's head dim,
# warpgroup 0 alone computing S and the softmax (head_split.py); 64-key tiles, one K and
# one V stage (Q 64 KB, K and V 64 KB each, P 8 KB: 204 KB) (docs/design.md, "Head dims").
HEAD_SPLIT_TILES = {512: (64, 64, 1)}
# setmaxnreg per role, by number of consumer warpgroups: all warps together fit 64K registers.
# setmaxnreg only moves registers within what the launch gave the CTA: 640 threads get 96 a
# thread, so the 72 the producer frees cover an increase to 112 for the four consumer
# warpgroups, not to 120 (the consumers would wait for registers forever).
REGISTERS = {2: (24, 240), 3: (32, 160), 4: (24, 112)}  # consumers -> (producer, consumer)


@dataclass(frozen=True)
class FwdConfig:
    dtype: str  # "bf16" or "fp16"
    head_dim: int
    causal: bool
    head_dim_v: int  # v's and O's columns: head_dim, or the pair's own (PAIR_TILES)
    tile_m: int  # query rows per tile, 64 per consumer warpgroup
    tile_n: int  # keys per step
    stages: int  # K / V pipeline stages
    q_tiles: int  # query tiles per CTA (2: tiles m and M-1-m, Q double-buffered)
    varlen: bool  # packed sequences (cu_seqlens): offsets and lengths per batch entry
    num_consumers: int
    producer_regs: int
    consumer_regs: int
    threads: int
    # P converted a register pair at a time (bf16 tiles of 80 or 112 keys: head_dim 256, 192)
    paired_convert: bool
    local: bool = False  # a sliding window (left, right at run time) and sinks
    softcap: bool = False  # scores cap * tanh(s / cap), the cap at run time
    head_split: bool = False  # two consumer warpgroups on one 64-row tile, half the head dim each
    # dense local: past this many keys a KV head's query heads are launched together, tile
    # by tile (0: never)
    kv_head_order_keys: int = 0

    @property
    def register_roles(self) -> list[tuple[int, int]]:
        """(threads, registers after setmaxnreg) of the producer warpgroup and the consumers."""
        return [(WARPGROUP, self.producer_regs), (WARPGROUP * self.num_consumers, self.consumer_regs)]

    def __post_init__(self):
        check_roles(f"fwd {self.head_dim} x {self.tile_m}", self.register_roles, self.threads,
                    launch_registers(self.threads))

    @property
    def masks_right(self) -> bool:
        """Whether a query row may see fewer keys than the sequence's (causal, or a window's right edge)."""
        return self.causal or self.local

    @classmethod
    def of(cls, variant) -> "FwdConfig":
        """The config of a ``fa4_aot.variants.Variant`` of kind fwd, arch sm90a."""
        assert variant.kind == "fwd" and variant.arch == "sm90a", variant
        head_dim_v = variant.head_dim_v or variant.head_dim
        if variant.head_dim in HEAD_SPLIT_TILES:
            assert not variant.local and variant.q_tiles == 1 and head_dim_v == variant.head_dim, variant
            tile_m, tile_n, stages = HEAD_SPLIT_TILES[variant.head_dim]
            producer_regs, consumer_regs = REGISTERS[2]
            return cls(dtype=variant.dtype, head_dim=variant.head_dim, head_dim_v=head_dim_v, causal=variant.causal,
                       tile_m=tile_m, tile_n=tile_n, stages=stages, q_tiles=1, varlen=variant.varlen,
                       num_consumers=2, producer_regs=producer_regs, consumer_regs=consumer_regs,
                       threads=3 * WARPGROUP, paired_convert=False, softcap=variant.softcap, head_split=True)
        if head_dim_v != variant.head_dim:
            assert not variant.local and variant.q_tiles == 1, "O is staged over Q's one buffer"
            tile_m, tile_n, stages = PAIR_TILES[(variant.head_dim, head_dim_v)]
        else:
            tile_m, tile_n, stages = (LOCAL_TILES if variant.local else TILES)[variant.head_dim]
        consumers = tile_m // 64
        producer_regs, consumer_regs = REGISTERS[consumers]
        assert not (variant.varlen and variant.q_tiles != 1)
        return cls(dtype=variant.dtype, head_dim=variant.head_dim, head_dim_v=head_dim_v, causal=variant.causal,
                   tile_m=tile_m, tile_n=tile_n, stages=stages, q_tiles=variant.q_tiles, varlen=variant.varlen,
                   num_consumers=consumers,
                   producer_regs=producer_regs, consumer_regs=consumer_regs, threads=WARPGROUP * (1 + consumers),
                   paired_convert=variant.dtype == "bf16" and tile_n % 128 != 0, local=variant.local,
                   softcap=variant.softcap,
                   kv_head_order_keys=LOCAL_KV_HEAD_BYTES // (4 * variant.head_dim)
                   if variant.local and not variant.varlen and variant.head_dim in LOCAL_KV_HEAD_ORDER else 0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
