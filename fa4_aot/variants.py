"""The variant matrix: the one place that says which kernels exist.

A ``Variant`` is at once the compile key, the manifest row's key, the cubin's file name,
the test id and the run-time selection key; its ``name`` reads like
``fwd.sm90a.bf16.d128.causal``. ``MATRIX`` is every variant this release builds, and
``AXES`` says, per axis, which values are built and which are not yet: the CLI and the
manifest print it so nobody has to guess.

Imports nothing beyond the standard library: the runtime uses it to select kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

ARCHS = ("sm90a", "sm100a")
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 96, 128, 192, 256)

# What each axis can take, and what this release builds of it. Kept in sync with MATRIX by
# a CPU test.
AXES = {
    "kind": {"declared": ("fwd", "bwd"), "built": ("fwd", "bwd")},
    "arch": {"declared": ARCHS, "built": ("sm90a",)},
    "dtype": {"declared": DTYPES, "built": DTYPES},
    "head_dim": {"declared": HEAD_DIMS, "built": HEAD_DIMS},
    "causal": {"declared": (False, True), "built": (False, True)},
    "varlen": {"declared": (False, True), "built": (False, True)},
    "cta_mode": {"declared": (1, 2), "built": (1,)},
    "deterministic": {"declared": (False, True), "built": (False, True)},
    "q_tiles": {"declared": (1, 2), "built": (1, 2)},
}
# Per kind, the axes whose built values differ from AXES.
KIND_AXES = {
    "fwd": {"deterministic": (False,)},
    "bwd": {"varlen": (False,)},
}

NOT_BUILT_REASONS = {
    "arch=sm100a": "no Blackwell kernel is written yet; the sm90a kernels use wgmma, "
    "which sm_100a does not have",
    "kind=bwd,varlen=True": "the variable-length (cu_seqlens) backward is not written yet",
    "kind=fwd,varlen=True,q_tiles=2": "packed sequences take one query tile per CTA",
    "cta_mode=2": "2-CTA mode (cluster pairs that add dQ before the reduce) measured slower than one CTA "
    "on sm90a; not built (docs/perf-notes.md, session 5)",
    "kind=fwd,deterministic=True": "the forward is deterministic already; the axis is the backward's",
    # the backward's q_tiles: query tiles per step, where a variant has both kernels
    "kind=bwd,causal=False,q_tiles=2": "not causal, head_dim 64 steps over two query tiles already (q_tiles 1)",
    "kind=bwd,deterministic=True,q_tiles=2": "deterministic, head_dim 64 steps over two query tiles already "
    "(q_tiles 1)",
    **{f"kind=bwd,head_dim={d},q_tiles=2": "two query tiles per backward step are built at head_dim 64 only"
       for d in (96, 128, 192, 256)},
    **{f"kind=fwd,head_dim={d},q_tiles=2": f"two Q buffers do not fit 227 KB of shared memory at head_dim {d}"
       for d in (192, 256)},
}


@dataclass(frozen=True)
class Tiling:
    """Per-variant tile shape: query rows per CTA, key rows per step, K/V buffers."""

    tile_m: int
    tile_n: int
    stages: int


# Consumer warpgroups of 64 rows each: three (192-row tiles, 160 registers each) for
# head_dim 64, where a warpgroup's softmax needs the GEMMs of two others to hide behind;
# two elsewhere (three spill from head_dim 96 up). Key tiles sized so that S (64 x tile_n)
# and O (64 x head_dim) fp32 fragments fit the registers, and K/V stages in 227 KB of smem.
FWD_SM90_TILING = {
    64: Tiling(192, 128, 2),
    96: Tiling(128, 128, 2),
    128: Tiling(128, 128, 2),
    192: Tiling(128, 112, 2),
    256: Tiling(128, 80, 2),
}


# Backward: 128 keys per CTA (64 per consumer warpgroup), 64 query rows per step, Q/dO
# double-buffered; four stages at head_dim 64 (three: +1-2% not causal, session 7; four:
# +2-4% deterministic, equal otherwise, session 9; three at 96 measured 0-2% slower:
# docs/perf-notes.md). head_dim 192 and 256: dK, dV and dQ computed with the head dim on
# the GEMMs' M side; 192: 96 keys per CTA, three consumer warpgroups (dK^T, dV^T fp32 64 x
# 96 each; 194 KB of smem); 256: 80 keys, two (128 x 80 each; 214 KB); one Q/dO buffer.
# The query rows of a step are also the unit of the LSE2 / D padding, of the dQ semaphores
# and of the row kernels' blocks, which the runtime sizes the workspace by
# (fa4_aot.api.backward_workspace_bytes, through bwd_query_rows).
BWD_SM90_TILING = {
    64: Tiling(64, 128, 4),
    96: Tiling(64, 128, 2),
    128: Tiling(64, 128, 2),
    192: Tiling(64, 96, 1),
    256: Tiling(64, 80, 1),
}
# head_dim 64 not causal: two 64-row query tiles per step (128 queries, FA4's shape: the
# step's fixed costs spread over twice the rows; fa4_aot/src/bwd_wide_sm90.py), two Q/dO
# stages of 128 rows; the 64-row tile stays the workspace's unit. Deterministic causal
# takes it too (bwd_step_tiles); causal not deterministic keeps one tile per step.
# head_dim 128 not causal: 80 query rows per step (dQ computed transposed, split by head
# dims; its staging single-buffered to fit), as FA4 upstream takes there: a step's fixed
# costs spread over 25% more queries (+1-2% measured, session 17). Causal keeps 64.
BWD_SM90_TILING_NOT_CAUSAL = {64: Tiling(64, 128, 2), 128: Tiling(80, 128, 2)}


def bwd_tiling(head_dim: int, causal: bool, deterministic: bool = False, q_tiles: int = 1) -> Tiling:
    """The sm90a backward's tile shape of a head dim, causal or not (and deterministic or
    not, q_tiles: the head_dim 64 causal kernels differ in their stages; the query tile, the
    workspace's unit, does not depend on them)."""
    wide = bwd_step_tiles(head_dim, causal, deterministic, q_tiles) == 2
    if head_dim in BWD_SM90_TILING_NOT_CAUSAL and (not causal or wide):
        return BWD_SM90_TILING_NOT_CAUSAL[head_dim]
    return BWD_SM90_TILING[head_dim]


def bwd_step_tiles(head_dim: int, causal: bool, deterministic: bool = False, q_tiles: int = 1) -> int:
    """Query tiles per backward step: two at head_dim 64 (128 queries, FA4's Hopper shape:
    fa4_aot/src/bwd_wide_sm90.py), except causal and not deterministic, where the variant's
    q_tiles says: 1, the persistent 64-row kernel, which the wide one loses to by 5% at 1k
    keys; 2 (``.q2``), the wide one, +2% at 4k-16k (session 19; fa4_aot.api picks by
    seqlen_k). Deterministic causal, the wide kernel measured +2% at 1k-4k and +4.6% at 16k
    (session 19). Elsewhere one."""
    if head_dim != 64:
        return 1
    return 2 if not causal or deterministic or q_tiles == 2 else 1


def bwd_query_rows(head_dim: int, causal: bool) -> int:
    """Query rows per backward step: the workspace's unit (see BWD_SM90_TILING)."""
    return bwd_tiling(head_dim, causal).tile_m


# Deterministic backward, not causal: the key tiles of a head add their dQ into DET_DQ_CHAINS
# copies of the fp32 accumulator, key tile n into copy n % DET_DQ_CHAINS and, within a copy,
# in ascending n; the postprocess sums the copies in copy order. A head's CTAs walk the
# query tiles in lockstep and every tile's turns pass from CTA to CTA; two chains halve
# the CTAs each turn passes through, which pays with two-tile turns (turn_tiles 2): +21-25%
# at head_dim 64 1k-4k, +3-5% at 128 (docs/perf-notes.md, session 7), for one more
# accumulator copy to clear and read. Four chains measured slower. Causal keeps one chain
# (its order already starts each CTA at its first turn).
DET_DQ_CHAINS = 2


def dq_chains(causal: bool, deterministic: bool) -> int:
    """Copies of the backward's fp32 dQ accumulator (and of its semaphores)."""
    return DET_DQ_CHAINS if deterministic and not causal else 1


# Backward, not causal, not deterministic (head_dim 64, 96, 128): when the key tiles (one
# CTA each, all the same length) leave a last partial wave of at most TAIL_MAX_TILES CTAs,
# those tiles are each split by query range into pieces that spread over all the SMs;
# their dK, dV partial sums meet in an fp32 workspace region (TAIL_MAX_TILES tiles: 12.6 MB
# at head_dim 128, part of every such backward's workspace, whose size is reported before
# the problem's key count is known). 4096 key tiles on 132 SMs are 31.03 waves: the 32nd,
# 4 CTAs long, cost 2.6-2.8% of every such backward (docs/perf-notes.md, session 18); 2048
# leave 68.
TAIL_MAX_TILES = 96
TAIL_COUNTERS = 4  # int32 words per split tile (bwd_tail)
# A piece's own cost (K, V loads, the partial sums, its start and end), in steps: what
# splitting finer pays per piece (the per-CTA timelines of session 18: 3-5 us, ~2 steps).
PIECE_COST_STEPS = 2


def bwd_tail_split(head_dim: int, causal: bool, deterministic: bool) -> bool:
    """Whether the sm90a backward variant splits its last partial wave (see TAIL_MAX_TILES)."""
    return not causal and not deterministic and head_dim in (64, 96, 128)


@functools.lru_cache(maxsize=1024)
def tail_split(items: int, sm_count: int, units: int) -> tuple[int, int]:
    """(tiles, pieces): the last ``tiles`` of ``items`` equal CTAs of ``units`` steps each
    are split into ``pieces`` each, or (0, 1). The pieces run in rounds of ``sm_count``;
    taken where rounds x (steps a piece + PIECE_COST_STEPS) is least and under ``units``
    (the last wave unsplit), after at least one full wave."""
    waves, tail = divmod(items, sm_count)
    if waves == 0 or tail == 0 or tail > TAIL_MAX_TILES:
        return 0, 1
    best, cost = 1, units
    for pieces in range(2, units + 1):
        rounds = -(-tail * pieces // sm_count)
        split_cost = rounds * (-(-units // pieces) + PIECE_COST_STEPS)
        if split_cost < cost:
            best, cost = pieces, split_cost
    return (tail, best) if best > 1 else (0, 1)


def dq_fragment_order(head_dim: int, causal: bool, deterministic: bool = False, q_tiles: int = 1) -> bool:
    """The backward adds dQ in fragment order by 1D bulk reduces at the accumulator's
    address (no tensor map for it), else into rows by a TMA reduce (fa4_aot/src/bwd_sm90.py)."""
    return head_dim in (96, 128) or bwd_step_tiles(head_dim, causal, deterministic, q_tiles) == 2


@dataclass(frozen=True, order=True)
class Variant:
    kind: str
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    varlen: bool = False
    cta_mode: int = 1
    deterministic: bool = False
    # forward: query tiles per CTA, Q double-buffered when 2 (``.q2``); backward: query
    # tiles per step where a variant has both kernels (bwd_step_tiles)
    q_tiles: int = 1

    def __post_init__(self):
        for axis, spec in AXES.items():
            value = getattr(self, axis)
            if value not in spec["declared"]:
                raise ValueError(f"{axis}={value!r} is not one of {spec['declared']}")

    @property
    def name(self) -> str:
        parts = [self.kind, self.arch, self.dtype, f"d{self.head_dim}"]
        if self.causal:
            parts.append("causal")
        if self.varlen:
            parts.append("varlen")
        if self.cta_mode != 1:
            parts.append(f"cta{self.cta_mode}")
        if self.deterministic:
            parts.append("det")
        if self.q_tiles != 1:
            parts.append(f"q{self.q_tiles}")
        return ".".join(parts)

    @property
    def cubin_file(self) -> str:
        return f"{self.name}.cubin"

    @property
    def tiling(self) -> Tiling:
        if self.kind == "fwd" and self.arch == "sm90a":
            return FWD_SM90_TILING[self.head_dim]
        if self.kind == "bwd" and self.arch == "sm90a":
            return bwd_tiling(self.head_dim, self.causal, self.deterministic, self.q_tiles)
        raise NotImplementedError(f"no kernel for {self.name}")

    @property
    def gpu_arch(self) -> str:
        """The DSL's and ptxas' spelling: sm_90a."""
        return self.arch[:-1].replace("sm", "sm_") + "a"

    @property
    def compute_capability(self) -> tuple[int, int]:
        digits = self.arch[2:-1]
        return int(digits[:-1]), int(digits[-1])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Variant":
        return cls(**d)

    @classmethod
    def from_name(cls, name: str) -> "Variant":
        for v in MATRIX:
            if v.name == name:
                return v
        raise KeyError(name)


ARCH_OF_CAPABILITY = {(9, 0): "sm90a", (10, 0): "sm100a"}


def arch_for_capability(cc: tuple[int, int]) -> str | None:
    """The matrix's architecture whose cubins run on a device of compute capability ``cc``."""
    return ARCH_OF_CAPABILITY.get(tuple(cc))


def built_values(kind: str, axis: str) -> tuple:
    return KIND_AXES.get(kind, {}).get(axis, AXES[axis]["built"])


def _build_matrix() -> tuple[Variant, ...]:
    out = []
    for kind in AXES["kind"]["built"]:
        for arch in built_values(kind, "arch"):
            for dtype in built_values(kind, "dtype"):
                for head_dim in built_values(kind, "head_dim"):
                    for causal, varlen in itertools.product(built_values(kind, "causal"),
                                                            built_values(kind, "varlen")):
                        for det, q_tiles in itertools.product(built_values(kind, "deterministic"),
                                                              built_values(kind, "q_tiles")):
                            v = Variant(kind, arch, dtype, head_dim, causal, varlen=varlen, deterministic=det,
                                        q_tiles=q_tiles)
                            if not any(matches(v, key) for key in NOT_BUILT_REASONS):
                                out.append(v)
    return tuple(sorted(out))


def matches(v: "Variant", key: str) -> bool:
    """Whether ``v`` has every axis value of a NOT_BUILT_REASONS key such as "kind=fwd,head_dim=192"."""
    return all(str(getattr(v, axis)) == value for axis, value in (p.split("=") for p in key.split(",")))


MATRIX: tuple[Variant, ...] = _build_matrix()


def select(only: tuple[str, ...] = (), archs: tuple[str, ...] = ()) -> list[Variant]:
    """Variants whose name matches any glob in ``only`` (all when empty), in ``archs``."""
    import fnmatch

    chosen = []
    for v in MATRIX:
        if archs and v.arch not in archs:
            continue
        if only and not any(fnmatch.fnmatchcase(v.name, pat) for pat in only):
            continue
        chosen.append(v)
    return chosen


def nearest(kind: str, dtype: str, head_dim: int, causal: bool, arch: str | None = None) -> list[str]:
    """Names of built variants closest to a request, for error messages."""
    pool = [v for v in MATRIX if v.kind == kind and (arch is None or v.arch == arch)]
    pool.sort(key=lambda v: (v.dtype != dtype, abs(v.head_dim - head_dim), v.causal != causal))
    return [v.name for v in pool[:4]]
