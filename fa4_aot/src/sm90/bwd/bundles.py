"""What the backward main kernel's roles are handed, as named bundles (trace-time Python
containers of the kernel's tensors, pointers and pipelines; read, never carried through
a run-time loop)."""

from typing import NamedTuple


class Inputs(NamedTuple):
    """TMA atoms and coordinate tensors (s, d, h, b) of the loaded inputs, and their
    shared-memory tiles."""

    tma_q: object
    gQ: object
    sQ: object  # (step_rows, d, stages); also dK's staging tile
    tma_do: object
    gdO: object
    sdO: object  # (step_rows, d, stages); also dV's staging tile
    tma_k: object
    gK: object
    sK: object  # (tile_n, d[, kv_stages])
    tma_v: object
    gV: object
    sV: object


class Tiles(NamedTuple):
    """The consumers' shared-memory tiles."""

    sQ: object  # (step_rows, d, stages)
    sdO: object
    sK: object  # (tile_n, d[, kv_stages])
    sV: object
    sdS: object  # (step_rows, tile_n, ds_stages); head_on_m: (tile_n, tile_m)
    sdQ: object  # fp32 dQ staging: (*dq_tile, dq_slots), or fragment order (4, 128, chunks, dq_slots)
    sLSE2: object  # (step_rows, stages), with Q's stages
    sDsum: object  # (step_rows, stages), with dO's stages


class Pipes(NamedTuple):
    """The mbarrier pipelines the producer fills: K and V together, Q, dO."""

    kv: object
    q: object
    do: object


class Stats(NamedTuple):
    """The per-query statistics: workspace rows (b, h_q, s_q padded to tile_m) and the
    stages' shared copies (step_rows, stages), Q's stages carrying LSE2, dO's D."""

    lse2_ptr: object
    sLSE2: object
    dsum_ptr: object
    sDsum: object


class Outputs(NamedTuple):
    """dK and dV: TMA atoms, coordinate tensors (s_k, d, h_kv, b), staging tiles."""

    tma_dk: object
    gdK: object
    sdK: object
    tma_dv: object
    gdV: object
    sdV: object


class DqTarget(NamedTuple):
    """Where the dQ writer adds: the fp32 accumulator (a TMA reduce and store atom on its
    rows, None in fragment order, and its address), the semaphores, the per-head counts;
    varlen, the count of the grid's CTAs that have ended."""

    tma_dq: object
    tma_dq_store: object
    gdQacc: object
    dqacc_ptr: object
    sem_ptr: object
    done_ptr: object
    ended_ptr: object = None


class Scalars(NamedTuple):
    scale: object  # softmax_scale
    scale_log2: object  # softmax_scale * log2(e)
    turn_tiles: object  # deterministic: query tiles per ordered turn
    first_write: object  # 1: no accumulator clear, each tile's first share stored
    softcap_scale: object = None  # softcap: softmax_scale / cap (scale_log2 is then cap * log2(e))


class Start(NamedTuple):
    """What a main-kernel CTA sets up before its walk (FlashBwdSm90._start): shared
    storage, the K/V, Q and dO pipelines, the shared tiles (as Tiles) and dK, dV's
    staging tiles."""

    storage: object
    pipe_kv: object
    pipe_q: object
    pipe_do: object
    sQ: object
    sdO: object
    sK: object
    sV: object
    sdS: object
    sdQ: object
    sLSE2: object
    sDsum: object
    sdK: object
    sdV: object
