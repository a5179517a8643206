"""Every kernel's run-time interface, in one place (the machinery: common/params.py).

Per family, ``*_INPUTS`` lists what the run time passes its host entry (tensors by their
run-time names, scalars by the run-time values that fill them), and each kernel's
``Params`` the parameters it takes, in order: the kernel reads them by field name, the
manifest's slots name their sources, so an order written here is the order everywhere.

To add a run-time argument to a family: declare its input (and where it is optional, the
config flag), add it to the kernels' ``Params`` that take it, read ``p.<field>`` in the
kernel, and give the run time a value or tensor of that name.

Columns: the tensors' head dims may be narrower than the variant's, q and k's (and dq, dk,
the k cache) ``columns``, v and out's (dv, dout, the v cache) ``columns_v``: TMA fills the
columns past them with zeros on load and clips them on store, and where a kernel addresses
rows by hand (``rows``) it reads and writes only those columns (docs/design.md, "Head dims").

Names: a tensor input is named as the public API's argument (``out``, ``dout``,
``k_cache``), a workspace region as the workspace rule's. Shapes: (b, s, h, d) tensors as
the user's; varlen forms pass packed (total, h, d) as (1, total, h, d), LSE (h_q, total_q).
"""

from .common.params import Input, Inputs, Params, f32, i32, ptr, rows, tma, tma_map

# ------------------------------------------------------------------ shared pieces
# The sequences' metadata of a varlen call (cu_seqlens (b + 1,), seqused (b,) read where
# use_seqused; batch: b) and the heaviest-first order (b,) with its switch.
SEQUENCE_INPUTS = (
    Input("cu_seqlens_q", "i32", 1, when="varlen"), Input("cu_seqlens_k", "i32", 1, when="varlen"),
    Input("seqused_q", "i32", 1, when="varlen"), Input("seqused_k", "i32", 1, when="varlen"),
    Input("use_seqused_q", "Int32", when="varlen"), Input("use_seqused_k", "Int32", when="varlen"),
    Input("order", "i32", 1, when="varlen"), Input("lpt", "Int32", when="varlen"),
    Input("batch", "Int32", when="varlen"), Input("total_q", "Int32", when="varlen"),
    Input("total_k", "Int32", when="varlen"),
)
SEQUENCE_PARAMS = (
    ptr("cu_seqlens_q", when="varlen"), ptr("cu_seqlens_k", when="varlen"), ptr("seqused_q", when="varlen"),
    ptr("seqused_k", when="varlen"), i32("use_seqused_q", when="varlen"), i32("use_seqused_k", when="varlen"),
    i32("batch", when="varlen"),
)
LPT_PARAMS = (ptr("order", when="varlen"), i32("lpt", when="varlen"))


def lpt_params(inputs: Inputs) -> Params:
    """The heaviest-first sort (common/lpt.py), launched where lpt: the
    sequences' metadata in, the order out."""
    return Params("LptParams", *SEQUENCE_PARAMS, i32("total_q"), i32("total_k"), ptr("order"), inputs=inputs)


# ------------------------------------------------------------------ forward
FWD_INPUTS = Inputs(
    "FwdInputs",
    Input("q", "io"), Input("k", "io"), Input("v", "io_v"), Input("out", "io_v"),
    Input("lse", "f32", 3, varlen_rank=2),  # (b, h_q, s_q); varlen (h_q, total_q)
    Input("scale_log2", "Float32"),  # softmax_scale * log2(e); softcap: cap * log2(e)
    # local: the window, keys left and right of each query's diagonal (-1: unbounded), and
    # the sinks (h_q,), one logit per query head, read where use_sink
    Input("window_left", "Int32", when="local"), Input("window_right", "Int32", when="local"),
    Input("sink", "f32", 1, when="local"), Input("use_sink", "Int32", when="local"),
    Input("softcap_scale", "Float32", when="softcap"),  # softmax_scale / cap
    Input("columns_v", "Int32", when="varlen"),  # O's head dim (its rows by hand)
    *SEQUENCE_INPUTS,
)
FWD_LPT = lpt_params(FWD_INPUTS)
# kernel (dense) and kernel_varlen: O by TMA, or row by row where packed
FWD = Params(
    "FwdParams",
    tma("q"), tma("k"), tma("v"), tma("out", when="not varlen"), rows("out_rows", "sh", "out", when="varlen"),
    ptr("lse"), f32("scale_log2"),
    i32("window_left", when="local"), i32("window_right", when="local"), ptr("sink", when="local"),
    i32("use_sink", when="local"), f32("softcap_scale", when="softcap"), i32("columns_v", when="varlen"),
    *SEQUENCE_PARAMS, *LPT_PARAMS,
    inputs=FWD_INPUTS,
)

# ------------------------------------------------------------------ backward
BWD_INPUTS = Inputs(
    "BwdInputs",
    # q's head dim ("io") or v's ("io_v": the config's head_dim_v)
    *(Input(n, "io_v" if n in ("v", "out", "dout", "dv") else "io")
      for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")),
    Input("lse", "f32", 3, varlen_rank=2),  # from the forward
    Input("lse2", "f32", 3, varlen_rank=2),  # workspace: LSE * log2(e), rows padded to tile_m
    Input("dsum", "f32", 3, varlen_rank=2),  # workspace: rowsum(dO * O)
    Input("dq_accum", "f32", 3, head_dim_last=True),  # workspace: fp32 dQ, (copies, rows, h_q, d)
    Input("dq_semaphore", "i32", 3),  # workspace: ordered turns or tickets per query tile
    Input("dq_done", "i32", 2),  # workspace (b, h_q): key tiles done adding into each head's dQ
    Input("ctas_done", "i64", 1, when="varlen"),  # workspace: main-kernel CTAs ended
    Input("scale", "Float32"), Input("scale_log2", "Float32"),
    Input("turn_tiles", "Int32"),  # deterministic: query tiles per ordered turn
    Input("first_write", "Int32"),  # 1: the accumulator uncleared, each tile's first share stored
    Input("tail_counters", "i32", 1, when="not varlen"),  # the split last wave (split_last_wave.py)
    Input("dkv_partial", "f32", 1, when="not varlen"),
    Input("tail_tiles", "Int32", when="not varlen"), Input("tail_pieces", "Int32", when="not varlen"),
    *SEQUENCE_INPUTS,
    Input("seqlen_q", "Int32", when="not varlen"), Input("seqlen_k", "Int32", when="not varlen"),
    Input("heads_q", "Int32"), Input("heads_kv", "Int32", when="varlen"),
    Input("columns", "Int32"),  # q's head dim: dQ (and varlen dK) rows by hand
    Input("columns_v", "Int32"),  # v's head dim: O and dO (and varlen dV) rows by hand
    # local: the forward's window (the sinks are in the forward's LSE already); where
    # use_sink, the sinks' gradient (h_q,) out, from per-warp partial sums in the workspace
    # ((h_q, sink_slots, tile_m // 8): sink_slots = the preprocess's blocks per head)
    Input("window_left", "Int32", when="local"), Input("window_right", "Int32", when="local"),
    Input("sink", "f32", 1, when="local"), Input("use_sink", "Int32", when="local"),
    Input("dsink", "f32", 1, when="local"), Input("sink_partial", "f32", 1, when="local"),
    Input("sink_slots", "Int32", when="local"),
    Input("softcap_scale", "Float32", when="softcap"),  # softmax_scale / cap (scale_log2: cap * log2(e))
)
BWD_LPT = lpt_params(BWD_INPUTS)
BWD_PREPROCESS = Params(
    "BwdPreParams",
    rows("out", "bsh", when="not varlen"), rows("out_rows", "sh", "out", when="varlen"),
    rows("dout", "bsh", when="not varlen"), rows("dout_rows", "sh", "dout", when="varlen"),
    ptr("lse"), ptr("lse2"), ptr("dsum"), ptr("dq_accum"), ptr("dq_semaphore"), ptr("dq_done"),
    ptr("tail_counters", when="not varlen"), ptr("ctas_done", when="varlen"),
    i32("seqlen_q", when="not varlen"), i32("total_q", when="varlen"), i32("heads_q"), i32("first_write"),
    i32("columns_v"),
    ptr("cu_seqlens_q", when="varlen"), ptr("seqused_q", when="varlen"), i32("use_seqused_q", when="varlen"),
    i32("batch", when="varlen"),
    ptr("sink", when="local"), i32("use_sink", when="local"), ptr("sink_partial", when="local"),
    i32("sink_slots", when="local"),
    inputs=BWD_INPUTS,
)
# kernel (dense) and kernel_varlen: dK, dV by TMA, or row by row where packed; the dQ
# accumulator by a TMA reduce (and a store for a tile's first share) into its rows, or
# in fragment order by 1D bulk reduces at its address
BWD_MAIN = Params(
    "BwdParams",
    tma("q"), tma("dout"), tma("k"), tma("v"),
    tma("dk", when="not varlen"), rows("dk_rows", "sh", "dk", when="varlen"),
    tma("dv", when="not varlen"), rows("dv_rows", "sh", "dv", when="varlen"),
    tma("dq_accum", when="not dq_fragment_order"), tma_map("dq_accum_store", "dq_accum", when="not dq_fragment_order"),
    ptr("lse2"), ptr("dsum"), ptr("dq_semaphore"), ptr("dq_accum_ptr", "dq_accum"), ptr("dq_done"),
    ptr("ctas_done", when="varlen"),
    f32("scale"), f32("scale_log2"), i32("turn_tiles"), i32("first_write"),
    ptr("tail_counters", when="not varlen"), ptr("dkv_partial", when="not varlen"),
    i32("tail_tiles", when="not varlen"), i32("tail_pieces", when="not varlen"),
    *SEQUENCE_PARAMS, *LPT_PARAMS,
    i32("window_left", when="local"), i32("window_right", when="local"), f32("softcap_scale", when="softcap"),
    i32("columns", when="varlen"), i32("columns_v", when="varlen"),
    inputs=BWD_INPUTS,
)
BWD_POSTPROCESS = Params(
    "BwdPostParams",
    ptr("dq_accum"), ptr("dq_semaphore"), ptr("dq_done"), ptr("ctas_done", when="varlen"),
    rows("dq", "bsh", when="not varlen"), rows("dq_rows", "sh", "dq", when="varlen"),
    i32("seqlen_q", when="not varlen"), i32("seqlen_k", when="not varlen"), i32("total_q", when="varlen"),
    i32("heads_q"), f32("scale"), i32("first_write"), i32("columns"),
    ptr("cu_seqlens_q", when="varlen"), ptr("seqused_q", when="varlen"), i32("use_seqused_q", when="varlen"),
    ptr("cu_seqlens_k", when="varlen"), ptr("seqused_k", when="varlen"), i32("use_seqused_k", when="varlen"),
    i32("batch", when="varlen"), i32("total_k", when="varlen"), i32("heads_kv", when="varlen"),
    i32("window_left", when="local"), i32("window_right", when="local"),
    inputs=BWD_INPUTS,
)
# local, where use_sink: the sinks' gradient from the preprocess's partial sums
BWD_SINK = Params(
    "BwdSinkParams",
    ptr("sink_partial", when="local"), ptr("dsink", when="local"), i32("sink_slots", when="local"),
    inputs=BWD_INPUTS,
)

# ------------------------------------------------------------------ decode and combine
DECODE_INPUTS = Inputs(
    "DecodeInputs",
    Input("q", "io"),  # (b, s_q, h_q, d)
    # (pages, page rows, h_kv, d); (b, max_cache, ...) unpaged; of q's dtype, or e4m3 where fp8
    Input("k_cache", "kv"), Input("v_cache", "kv"),
    Input("out", "io"),
    Input("lse", "f32", 3),  # (b, h_q, s_q)
    Input("o_partial", "f32", 5),  # workspace (splits, b, s_q, h_q, d)
    Input("lse_partial", "f32", 4),  # workspace (splits, b, h_q, s_q)
    Input("cache_seqlens", "i32", 1),  # (b,): keys in each sequence's cache, read unless full_cache
    Input("page_table", "i32", 2),  # (b, max_pages), read where paged
    Input("scale_log2", "Float32"),  # softmax_scale * log2(e); softcap: cap * log2(e)
    *(Input(n, "Int32") for n in ("batch", "seqlen_q", "heads_q", "splits", "max_pages", "piece_rows", "paged",
                                  "turn_stride", "full_cache", "columns", "columns_v")),
    # local and softcap: as the forward's
    Input("window_left", "Int32", when="local"), Input("window_right", "Int32", when="local"),
    Input("sink", "f32", 1, when="local"), Input("use_sink", "Int32", when="local"),
    Input("softcap_scale", "Float32", when="softcap"),
    # fp8: the cache's dequantization scales, fp32 (b, h_kv) read at [b * sb + h * sh]
    # (a scalar: strides 0), each read where use_ (else 1)
    Input("k_descale", "f32", 2, when="fp8"), Input("v_descale", "f32", 2, when="fp8"),
    *(Input(n, "Int32", when="fp8") for n in ("k_descale_sb", "k_descale_sh", "use_k_descale",
                                              "v_descale_sb", "v_descale_sh", "use_v_descale")),
    # pairs: 2 where the cache is given as pairs of adjacent KV heads, each pair one head of
    # twice the width (k_cache, v_cache viewed so; heads_kv the pairs): each packed row reads
    # Q into and writes O from its own head's half of the columns; 1 otherwise
    Input("pair_heads", "Int32", when="pairs", default=1),
)
DECODE = Params(
    "DecodeParams",
    tma("k_cache"), tma("v_cache"), rows("q", "bsh"), rows("out", "bsh"),
    ptr("lse"), ptr("o_partial"), ptr("lse_partial"), ptr("cache_seqlens"), ptr("page_table"), f32("scale_log2"),
    i32("batch"), i32("seqlen_q"), i32("heads_q"), i32("splits"),
    i32("max_pages"),  # page table columns (paged); 1 otherwise
    i32("piece_rows"),  # keys per TMA piece: tile_n, or a divisor of it (small pages)
    i32("paged"),  # 1: K/V pages from the page table; 0: page = batch entry
    i32("turn_stride"),  # key tiles between consecutive (sequence, split) CTAs' starts
    i32("full_cache"),  # 1: every sequence's keys are its whole cache (cache_seqlens not read)
    i32("columns"), i32("columns_v"),  # q's and v's head dims: Q read and O written by hand
    i32("window_left", when="local"), i32("window_right", when="local"), ptr("sink", when="local"),
    i32("use_sink", when="local"), f32("softcap_scale", when="softcap"),
    ptr("k_descale", when="fp8"), i32("k_descale_sb", when="fp8"), i32("k_descale_sh", when="fp8"),
    i32("use_k_descale", when="fp8"),
    ptr("v_descale", when="fp8"), i32("v_descale_sb", when="fp8"), i32("v_descale_sh", when="fp8"),
    i32("use_v_descale", when="fp8"), i32("pair_heads", when="pairs"),
    inputs=DECODE_INPUTS,
)
COMBINE_INPUTS = Inputs(
    "CombineInputs",
    Input("o_partial", "f32", 5), Input("lse_partial", "f32", 4), Input("out", "io"), Input("lse", "f32", 3),
    *(Input(n, "Int32") for n in ("batch", "seqlen_q", "heads_q", "splits", "columns_v")),
)
COMBINE = Params(
    "CombineParams",
    ptr("o_partial"), ptr("lse_partial"), rows("out", "bsh"), ptr("lse"),
    i32("batch"), i32("seqlen_q"), i32("heads_q"), i32("splits"), i32("columns_v"),
    inputs=COMBINE_INPUTS,
)
