"""Every compile-time knob of one sm_90a backward variant, derived once from its ``Variant``.

``BwdConfig.of(variant)`` is the one place that looks at the variant's head dim, causal,
deterministic, dtype and q_tiles and decides the kernel's shape: tiles, pipelines,
warpgroups, which GEMM layout, what is staged where, persistence and the split last wave.
The kernels (``kernel.py`` and its roles) read the config; the build writes it into the
manifest row (``config``, and the workspace rule, ``workspace_rule``) so the run time
reads it too instead of deciding again. Pure Python: no DSL import.

Each knob's reason and the measurement behind it: docs/design.md, "Backward (sm90)".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...common.registers import check_roles, launch_registers

WARPGROUP = 128

# (tile_m query rows per step, tile_n keys per CTA, Q/dO stages) per head dim, and the
# shapes that differ where the variant steps over two query tiles or is not causal
# (docs/design.md, "Backward: tiles per head dim").
TILES = {64: (64, 128, 4), 96: (64, 128, 2), 128: (64, 128, 2), 192: (64, 96, 1), 256: (64, 80, 1)}
TILES_NOT_CAUSAL = {64: (64, 128, 2), 128: (80, 128, 2)}
# (head_dim, head_dim_v) pairs with a kernel of their own: 192/128's dO and V tiles of 128
# columns leave room for a second Q/dO stage
PAIR_TILES = {(192, 128): (64, 96, 2)}

# Deterministic, not causal: copies of the fp32 dQ accumulator the key tiles add into
# in turn (docs/design.md, "Backward: deterministic order").
DET_DQ_CHAINS = 2
# The split last wave (split_last_wave.py): at most this many key tiles are split, each
# with TAIL_COUNTERS int32 words in the workspace (docs/design.md, "Backward: split last wave").
TAIL_MAX_TILES = 96
TAIL_COUNTERS = 4
# Persistent variants take one CTA per SM up to this many keys, one per key tile beyond.
PERSISTENT_MAX_KEYS = 2048
# Not causal, not deterministic: CTAs start their query loop at multiples of this many tiles.
ROTATION_TILES = 2
# setmaxnreg: the producer warpgroup's registers, and a consumer thread's by consumer count
PRODUCER_REGS = 24
CONSUMER_REGS = {2: 240, 3: 160}


@dataclass(frozen=True)
class BwdConfig:
    dtype: str  # "bf16" or "fp16"
    head_dim: int
    causal: bool
    deterministic: bool
    # v's, dO's and dV's columns: head_dim, or narrower where the variant's pair has its own
    # kernel (192/128, head_on_m: the warpgroups past head_dim_v / 64 own no dV rows)
    head_dim_v: int
    tile_m: int  # query rows per tile: the workspace's unit (statistics, semaphores, pre- and postprocess)
    tile_n: int  # keys per CTA
    stages: int  # Q / dO pipeline stages
    # GEMM layout: the head dim on the M side of dK, dV, dQ (192, 256), else the keys
    head_on_m: bool
    num_consumers: int  # consumer warpgroups
    step_tiles: int  # query tiles per step (2: the two-query-tile kernel)
    step_rows: int
    threads: int
    consumer_regs: int
    # dQ: its GEMM's shape and where its operands live
    dq_chunk: int  # head_on_m: head dims per dQ^T GEMM (one staged part each)
    col_parts: int  # Q, dO, K used as that many column slices: the swizzle atom divides them
    dq_cols: int  # head dims of one warpgroup's dQ (keys on M)
    dq_transposed: bool  # dQ^T = K^T dS^T
    dq_kt_in_registers: bool  # ... with K^T in registers
    stats_by_query: bool  # LSE2 and D read from shared memory where used (80-row tiles)
    dq_tile: tuple  # (rows, cols) one warpgroup stages per step
    dq_parts: int  # staged tiles per step
    dq_stages: int  # staging buffers per part
    dq_slots: int  # staging buffers in all
    dq_fragment_order: bool  # staged in register order, added by 1D bulk reduces
    # the consumers' loop
    kv_in_registers: bool  # K, V as the A operands of S^T, dP^T (registers)
    stagger: bool  # warpgroups staggered: dQ GEMM of a tile issued at the next one
    ds_stages: int
    overlap_scores: bool  # the next tile's S^T issued behind this tile's dK GEMM
    # the walk over the work
    rotate: bool  # not causal: each CTA starts its query loop at a tile of its own
    head_groups: bool  # CTAs in L2-sized groups of heads (common/launch_order.py)
    persistent: bool  # one CTA per SM walking the items (up to PERSISTENT_MAX_KEYS keys)
    kv_stages: int
    tail_split: bool  # the last partial wave's key tiles split by query range
    # the dQ accumulator
    chains: int  # copies of the fp32 accumulator (deterministic, not causal: 2)
    tickets: bool  # not deterministic: first-write tickets in the semaphore words
    # packed sequences (cu_seqlens): one item per (key tile of a sequence, KV head), the
    # workspace's query tiles padded per sequence (docs/design.md, "Variable length")
    varlen: bool = False
    # a sliding window (left, right at run time; causal is right = 0): shaped as the causal
    # kernel, each key tile visiting only the query tiles its keys' windows touch
    local: bool = False
    # scores capped as cap * tanh(s / cap) (local only; the cap at run time): P from the
    # capped scores, dS times tanh's derivative (scores.py)
    softcap: bool = False

    @property
    def register_roles(self) -> list[tuple[int, int]]:
        """(threads, registers after setmaxnreg) of the producer warpgroup and the consumers."""
        return [(WARPGROUP, PRODUCER_REGS), (WARPGROUP * self.num_consumers, self.consumer_regs)]

    def __post_init__(self):
        check_roles(f"bwd {self.head_dim}", self.register_roles, self.threads, launch_registers(self.threads))

    @property
    def masked(self) -> bool:
        """Causal or local: the walks, orders and shapes of a kernel whose key tiles see
        only some query tiles."""
        return self.causal or self.local

    @classmethod
    def of(cls, variant) -> "BwdConfig":
        """The config of a ``fa4_aot.variants.Variant`` of kind bwd, arch sm90a."""
        assert variant.kind == "bwd" and variant.arch == "sm90a", variant
        d, det, varlen = variant.head_dim, variant.deterministic, variant.varlen
        head_dim_v = variant.head_dim_v or d
        causal = variant.causal or variant.local  # the shape decisions: local as causal
        head_on_m = d in (192, 256)
        # two query tiles per step at head_dim 64, except causal and not deterministic,
        # where q_tiles says (both kernels built); varlen, one: a second tile past the
        # sequence would read the next sequence's rows, where the dense kernel reads TMA's zeros
        step_tiles = 2 if d == 64 and not varlen and (not causal or det or variant.q_tiles == 2) else 1
        two_tiles = step_tiles == 2
        tile_m, tile_n, stages = (TILES_NOT_CAUSAL[d] if d in TILES_NOT_CAUSAL and (not causal or two_tiles)
                                  else TILES[d])
        if head_dim_v != d:
            tile_m, tile_n, stages = PAIR_TILES[(d, head_dim_v)]
        num_consumers = 3 if d == 192 else 2
        one_tile_64 = d == 64 and not two_tiles
        col_parts = 1 if d == 128 or head_on_m or two_tiles else 2
        dq_cols = d if two_tiles else d // 2
        dq_transposed = one_tile_64 or tile_m % 64 != 0
        dq_chunk = 64
        dq_tile = (tile_m // 2, d) if one_tile_64 else (tile_m, dq_chunk if head_on_m else dq_cols)
        dq_parts = d // dq_chunk if head_on_m else (1 if two_tiles else num_consumers)
        dq_stages = 1 if head_on_m or tile_m == 80 else (3 if one_tile_64 and causal else 2)
        # varlen: one CTA per item, launched in the packed order (no persistence, no split
        # last wave, no head groups: a sequence's key tiles are its own CTAs)
        persistent = one_tile_64 and not det and variant.dtype == "bf16" and not varlen
        tail_split = not causal and not det and d in (64, 96, 128) and not varlen
        assert not (tail_split and (persistent or head_on_m))
        assert head_dim_v == d or (head_on_m and head_dim_v % (d // num_consumers) == 0 and not variant.local)
        return cls(
            dtype=variant.dtype, head_dim=d, causal=variant.causal, deterministic=det, head_dim_v=head_dim_v,
            tile_m=tile_m, tile_n=tile_n, stages=stages,
            head_on_m=head_on_m, num_consumers=num_consumers, step_tiles=step_tiles,
            step_rows=tile_m * step_tiles, threads=WARPGROUP * (1 + num_consumers),
            consumer_regs=CONSUMER_REGS[num_consumers],
            dq_chunk=dq_chunk, col_parts=col_parts, dq_cols=dq_cols, dq_transposed=dq_transposed,
            dq_kt_in_registers=one_tile_64, stats_by_query=tile_m % 64 != 0, dq_tile=dq_tile,
            dq_parts=dq_parts, dq_stages=dq_stages, dq_slots=3 if head_on_m else dq_parts * dq_stages,
            dq_fragment_order=d in (96, 128) or two_tiles,
            kv_in_registers=one_tile_64, stagger=d <= 96 and not det and not dq_transposed,
            ds_stages=1 if head_on_m else 2, overlap_scores=one_tile_64 and variant.dtype == "bf16",
            rotate=not causal and not det, head_groups=causal != det and not varlen, persistent=persistent,
            kv_stages=2 if persistent else 1, tail_split=tail_split,
            chains=DET_DQ_CHAINS if det and not causal else 1, tickets=not det, varlen=varlen,
            local=variant.local, softcap=variant.softcap,
        )

    @property
    def two_query_tiles(self) -> bool:
        return self.step_tiles == 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def workspace_rule(cfg: BwdConfig) -> dict:
    """How the run time lays out the backward's workspace for a problem (varlen:
    ``varlen_workspace_rule``): the regions in
    order, each ``itemsize`` bytes times the product of ``count`` (fa4_aot.launch.rules
    expressions over the problem's sizes, the rule's constants, its ``derived`` names
    (evaluated in order: ``m_blocks`` = ceil(seqlen_q / query_tile)) and ``partial_tiles``
    (the split tiles the problem can have, at most ``tail_max_tiles``: fa4_aot.policy)),
    each start ``align``-byte aligned; ``views`` give a region the tensor shape a launch
    takes it as (dims as products of such factors, contiguous)."""
    if cfg.varlen:
        return varlen_workspace_rule(cfg)
    rows = ["batch", "heads_q", "m_blocks", "query_tile"]
    return {
        "align": 256,
        "constants": {"query_tile": cfg.tile_m, "key_tile": cfg.tile_n, "chains": cfg.chains,
                      "tail_max_tiles": TAIL_MAX_TILES, "tail_counters": TAIL_COUNTERS},
        "derived": {"m_blocks": ["ceil_div", "seqlen_q", "query_tile"]},
        "regions": [
            {"name": "lse2", "itemsize": 4, "count": rows},  # LSE * log2(e), padded to whole tiles
            {"name": "dsum", "itemsize": 4, "count": rows},  # rowsum(dO * O)
            # fp32 dQ, every copy, padded to whole query tiles (rows, or fragment order)
            {"name": "dq_accum", "itemsize": 4,
             "count": ["chains", "batch", "m_blocks", "query_tile", "heads_q", "head_dim"]},
            {"name": "dq_semaphore", "itemsize": 4, "count": ["chains", "batch", "heads_q", "m_blocks"]},
            {"name": "dq_done", "itemsize": 4, "count": ["batch", "heads_q"]},  # key tiles done per head
            {"name": "tail_counters", "itemsize": 4, "count": ["tail_max_tiles", "tail_counters"]},
            # the split tiles' dK, dV partial sums
            {"name": "dkv_partial", "itemsize": 4,
             "count": ["partial_tiles", 2, "key_tile", "head_dim"] if cfg.tail_split else [0]},
            *sink_regions(cfg, ["batch", "m_blocks"]),
        ],
        # the TMA reduce target: copy c of batch i is batch i * chains + c
        "views": {"dq_accum": [["batch", "chains"], ["seqlen_q"], ["heads_q"], ["head_dim"]]},
    }


def varlen_workspace_rule(cfg: BwdConfig) -> dict:
    """The varlen backward's workspace: the dense layout of one batch entry of
    ``ws_tiles`` = ceil(total_q / query_tile) + batch query tiles per head, sequence b's
    tiles starting at tile cu_seqlens_q[b] // query_tile + b. That start is a whole tile
    (the bulk copies of the statistics and the accumulator's tiles need one) and leaves
    room for the sequence's ceil(len / query_tile) tiles before the next sequence's start,
    and for clamped lying metadata it stays below ws_tiles: no tile of one sequence is
    another's, and none lies outside the workspace (docs/design.md, "Variable length").
    First, the heaviest-first order of the sequences: ``order_entries`` int32, batch where
    the call takes that order, else 0 (so a workspace sized for the plain order holds the
    rest as before); last, one int64 count of the main kernel's CTAs that have ended."""
    rows = ["heads_q", "ws_tiles", "query_tile"]
    return {
        "align": 256,
        "constants": {"query_tile": cfg.tile_m, "key_tile": cfg.tile_n, "chains": cfg.chains},
        "derived": {"ws_tiles": ["add", ["ceil_div", "total_q", "query_tile"], "batch"],
                    "ws_rows": ["mul", "ws_tiles", "query_tile"], "order_entries": ["mul", "batch", "lpt"]},
        "regions": [
            {"name": "order", "itemsize": 4, "count": ["order_entries"]},  # the sequences heaviest first
            {"name": "lse2", "itemsize": 4, "count": rows},
            {"name": "dsum", "itemsize": 4, "count": rows},
            {"name": "dq_accum", "itemsize": 4, "count": ["chains", "ws_tiles", "query_tile", "heads_q", "head_dim"]},
            {"name": "dq_semaphore", "itemsize": 4, "count": ["chains", "heads_q", "ws_tiles"]},
            {"name": "dq_done", "itemsize": 4, "count": ["batch", "heads_q"]},  # key tiles done per sequence, head
            # main-kernel CTAs ended: a postprocess block stops waiting for its key tiles once
            # all have, which lying metadata can leave unwalked (docs/design.md, "Variable length")
            {"name": "ctas_done", "itemsize": 8, "count": [1]},
            *sink_regions(cfg, ["ws_tiles"]),
        ],
        # the TMA reduce target: copy c is batch entry c, ws_tiles * query_tile rows
        "views": {"dq_accum": [["chains"], ["ws_tiles", "query_tile"], ["heads_q"], ["head_dim"]]},
    }


def sink_regions(cfg: BwdConfig, slots: list) -> list:
    """Local: the sinks' gradient's partial sums, one per warp of each preprocess block
    (``slots`` blocks per head: pre_post.sink_grad sums them); else none."""
    if not cfg.local:
        return []
    return [{"name": "sink_partial", "itemsize": 4, "count": ["heads_q", *slots, cfg.tile_m // 8]}]
