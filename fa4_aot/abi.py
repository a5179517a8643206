"""Kernel parameter plans: what each byte of a kernel's parameter buffer means.

The CuTe DSL flattens a kernel's Python arguments into PTX ``.param`` entries: a TMA copy
atom becomes its 128-byte CUtensorMap (64-byte aligned), a TMA coordinate tensor becomes
its dynamic int32 modes, a pointer becomes a u64, a Float32 an f32. The plan below is
written by hand from the kernel's argument list; ``check_against_ptx`` compares it with the
PTX the DSL emitted, so a change in the DSL's flattening fails the build, not a user's run.

A plan is a list of slots; each slot is a dict that goes verbatim into the manifest:
  {"name", "kind", "offset", "size", "align", ...kind-specific fields}
kinds:
  tensormap  {"tensor": "q"}             CUtensorMap encoded at launch from tensormaps[tensor]
  i32        {"fields": ["seqlen_q", ...]} consecutive int32 run-time sizes
  i64        {"fields": ["stride.o.b"]}  an int64 run-time value (element strides)
  ptr        {"tensor": "lse"}           a device address
  f32        {"value": "scale_log2"}     a float32 run-time scalar
"""

from __future__ import annotations

import re

SLOT_SIZES = {"tensormap": (128, 64), "ptr": (8, 8), "f32": (4, 4)}


def _slot(name: str, kind: str, **fields) -> dict:
    if kind == "i32":
        size, align = 4 * len(fields["fields"]), 4
    elif kind == "i64":
        size, align = 8 * len(fields["fields"]), 8
    else:
        size, align = SLOT_SIZES[kind]
    return {"name": name, "kind": kind, "size": size, "align": align, **fields}


def fwd_plan() -> list[dict]:
    """Slots of FlashFwdSm90.kernel, in argument order."""
    q_sizes = ["seqlen_q", "heads_q", "batch"]
    kv_sizes = ["seqlen_k", "heads_kv", "batch"]
    slots = []
    for tensor, sizes in (("q", q_sizes), ("k", kv_sizes), ("v", kv_sizes), ("o", q_sizes)):
        slots.append(_slot(f"tma_{tensor}", "tensormap", tensor=tensor))
        slots.append(_slot(f"{tensor}_coords", "i32", fields=sizes))
    slots.append(_slot("lse", "ptr", tensor="lse"))
    slots.append(_slot("scale_log2", "f32", value="scale_log2"))
    return with_offsets(slots)


def fwd_varlen_plan() -> list[dict]:
    """Slots of FlashFwdSm90.kernel_varlen: packed Q, K, V as (total, d, h, 1) tensor maps,
    O by address and (row, head) strides, LSE (h_q, total_q), the sequences' metadata."""
    slots = []
    for tensor, sizes in (("q", ["total_q", "heads_q", "one"]), ("k", ["total_k", "heads_kv", "one"]),
                          ("v", ["total_k", "heads_kv", "one"])):
        slots.append(_slot(f"tma_{tensor}", "tensormap", tensor=tensor))
        slots.append(_slot(f"{tensor}_coords", "i32", fields=sizes))
    slots.append(_slot("o", "ptr", tensor="o"))
    slots += [_slot(f"o_stride_{a}", "i64", fields=[f"stride.o.{a}"]) for a in "sh"]
    slots.append(_slot("lse", "ptr", tensor="lse"))
    slots.append(_slot("scale_log2", "f32", value="scale_log2"))
    slots += [_slot(n, "ptr", tensor=n) for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")]
    slots += [_slot(n, "i32", fields=[n]) for n in ("use_seqused_q", "use_seqused_k", "batch")]
    slots += [_slot("order", "ptr", tensor="order"), _slot("lpt", "i32", fields=["lpt"])]
    return with_offsets(slots)


def varlen_order_plan() -> list[dict]:
    """Slots of FlashFwdSm90.order_varlen and FlashBwdSm90.order_varlen: the sequences'
    metadata in, their heaviest-first order out (the workspace)."""
    slots = [_slot(n, "ptr", tensor=n) for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")]
    slots += [_slot(n, "i32", fields=[n]) for n in ("use_seqused_q", "use_seqused_k", "batch", "total_q", "total_k")]
    slots.append(_slot("order", "ptr", tensor="order"))
    return with_offsets(slots)


def decode_plan() -> list[dict]:
    """Slots of DecodeSm90.kernel: K, V cache tensor maps over (pages, page rows, h_kv, d),
    Q and O by address and (b, s, h) strides, LSE, the split workspace, the cache lengths
    and page table, the scale and the launch's sizes."""
    cache = ["cache_rows", "heads_kv", "cache_pages"]
    slots = []
    for tensor in ("k", "v"):
        slots.append(_slot(f"tma_{tensor}", "tensormap", tensor=tensor))
        slots.append(_slot(f"{tensor}_coords", "i32", fields=cache))
    slots += [_slot("q", "ptr", tensor="q"), *_strides("q"), _slot("o", "ptr", tensor="o"), *_strides("o")]
    slots += [_slot(n, "ptr", tensor=n) for n in ("lse", "o_partial", "lse_partial", "cache_seqlens", "page_table")]
    slots.append(_slot("scale_log2", "f32", value="scale_log2"))
    slots += [_slot(n, "i32", fields=[n])
              for n in ("batch", "seqlen_q", "heads_q", "splits", "max_pages", "piece_rows", "paged", "turn_stride")]
    return with_offsets(slots)


def combine_plan() -> list[dict]:
    """Slots of CombineSm90.kernel: the split workspace in, O (by address and strides) and
    LSE out, the sizes."""
    slots = [_slot("o_partial", "ptr", tensor="o_partial"), _slot("lse_partial", "ptr", tensor="lse_partial"),
             _slot("o", "ptr", tensor="o"), *_strides("o"), _slot("lse", "ptr", tensor="lse")]
    slots += [_slot(n, "i32", fields=[n]) for n in ("batch", "seqlen_q", "heads_q", "splits")]
    return with_offsets(slots)


def _strides(tensor: str) -> list[dict]:
    return [_slot(f"{tensor}_stride_{a}", "i64", fields=[f"stride.{tensor}.{a}"]) for a in "bsh"]


def bwd_preprocess_plan() -> list[dict]:
    """FlashBwdSm90.preprocess: O and dO rows, LSE in, workspaces out."""
    slots = [_slot("o", "ptr", tensor="o"), *_strides("o"), _slot("do", "ptr", tensor="do"), *_strides("do")]
    slots += [_slot(n, "ptr", tensor=n)
              for n in ("lse", "lse2", "dsum", "dq_accum", "dq_semaphore", "dq_done", "tail_counters")]
    slots += [_slot("seqlen_q", "i32", fields=["seqlen_q"]), _slot("heads_q", "i32", fields=["heads_q"]),
              _slot("first_write", "i32", fields=["first_write"])]
    return with_offsets(slots)


def bwd_main_plan(dq_tensor_map: bool = True) -> list[dict]:
    """FlashBwdSm90.kernel: TMA for Q, dO, K, V in, dK, dV out, dQ reduce-add (by a tensor
    map into rows unless ``dq_tensor_map`` is False: the fragment-order variants add by 1D
    bulk reduces at the accumulator's address); workspaces; scales."""
    q_sizes = ["seqlen_q", "heads_q", "batch"]
    kv_sizes = ["seqlen_k", "heads_kv", "batch"]
    maps = [("q", q_sizes), ("do", q_sizes), ("k", kv_sizes), ("v", kv_sizes), ("dk", kv_sizes), ("dv", kv_sizes)]
    if dq_tensor_map:
        # the dQ accumulator's batch axis holds every copy (the row config's chains)
        maps.append(("dq_accum", ["seqlen_q", "heads_q", "dq_batch"]))
    slots = []
    for tensor, sizes in maps:
        slots.append(_slot(f"tma_{tensor}", "tensormap", tensor=tensor))
        slots.append(_slot(f"{tensor}_coords", "i32", fields=sizes))
    if dq_tensor_map:
        # the same map again, for the bulk stores of a tile's first dQ share (no coordinates:
        # the kernel addresses it through the reduce's)
        slots.append(_slot("tma_dq_accum_store", "tensormap", tensor="dq_accum"))
    # the accumulator as a plain address: the fragment-order reduces (head_dim 96, 128)
    slots += [_slot(n, "ptr", tensor=n) for n in ("lse2", "dsum", "dq_semaphore", "dq_accum", "dq_done")]
    slots += [_slot("scale", "f32", value="scale"), _slot("scale_log2", "f32", value="scale_log2")]
    slots.append(_slot("turn_tiles", "i32", fields=["turn_tiles"]))
    slots.append(_slot("first_write", "i32", fields=["first_write"]))
    # the split last wave (variants.tail_split): its counters and dK, dV partial sums; the
    # split tiles and pieces per tile (0 and 1: none)
    slots += [_slot(n, "ptr", tensor=n) for n in ("tail_counters", "dkv_partial")]
    slots += [_slot("tail_tiles", "i32", fields=["tail_tiles"]), _slot("tail_pieces", "i32", fields=["tail_pieces"])]
    return with_offsets(slots)


def bwd_postprocess_plan() -> list[dict]:
    """FlashBwdSm90.postprocess: the fp32 accumulator to dQ (with first_write, which tiles
    the main kernel wrote: from the semaphore words, or the key count and turn order)."""
    slots = [_slot("dq_accum", "ptr", tensor="dq_accum"), _slot("dq_semaphore", "ptr", tensor="dq_semaphore"),
             _slot("dq_done", "ptr", tensor="dq_done"), _slot("dq", "ptr", tensor="dq"), *_strides("dq")]
    slots += [_slot("seqlen_q", "i32", fields=["seqlen_q"]), _slot("seqlen_k", "i32", fields=["seqlen_k"]),
              _slot("heads_q", "i32", fields=["heads_q"]), _slot("scale", "f32", value="scale"),
              _slot("first_write", "i32", fields=["first_write"])]
    return with_offsets(slots)


def _strides_sh(tensor: str) -> list[dict]:
    """A packed (total, h, d) tensor's row and head strides (elements)."""
    return [_slot(f"{tensor}_stride_{a}", "i64", fields=[f"stride.{tensor}.{a}"]) for a in "sh"]


def _i32s(*names) -> list[dict]:
    return [_slot(n, "i32", fields=[n]) for n in names]


def _ptrs(*names) -> list[dict]:
    return [_slot(n, "ptr", tensor=n) for n in names]


def bwd_varlen_preprocess_plan() -> list[dict]:
    """PrePostSm90.preprocess_varlen: packed O and dO rows, LSE (h_q, total_q) in, the
    workspace out, the query sequences' metadata."""
    slots = [_slot("o", "ptr", tensor="o"), *_strides_sh("o"), _slot("do", "ptr", tensor="do"), *_strides_sh("do")]
    slots += _ptrs("lse", "lse2", "dsum", "dq_accum", "dq_semaphore", "dq_done", "ctas_done")
    slots += _i32s("total_q", "heads_q", "first_write")
    slots += _ptrs("cu_seqlens_q", "seqused_q") + _i32s("use_seqused_q", "batch")
    return with_offsets(slots)


def bwd_varlen_main_plan(dq_tensor_map: bool = True) -> list[dict]:
    """FlashBwdSm90.kernel_varlen: packed Q, dO, K, V as (total, d, h, 1) tensor maps, dK and
    dV by address and (row, head) strides, the dQ accumulator (a tensor map over its
    (ws_rows, h_q, chains) rows unless in fragment order), workspaces, scales, metadata,
    the sequence order (read where lpt)."""
    maps = [("q", ["total_q", "heads_q", "one"]), ("do", ["total_q", "heads_q", "one"]),
            ("k", ["total_k", "heads_kv", "one"]), ("v", ["total_k", "heads_kv", "one"])]
    slots = []
    for tensor, sizes in maps:
        slots.append(_slot(f"tma_{tensor}", "tensormap", tensor=tensor))
        slots.append(_slot(f"{tensor}_coords", "i32", fields=sizes))
    for tensor in ("dk", "dv"):
        slots += [_slot(tensor, "ptr", tensor=tensor), *_strides_sh(tensor)]
    if dq_tensor_map:
        slots.append(_slot("tma_dq_accum", "tensormap", tensor="dq_accum"))
        slots.append(_slot("dq_accum_coords", "i32", fields=["ws_rows", "heads_q", "chains"]))
        slots.append(_slot("tma_dq_accum_store", "tensormap", tensor="dq_accum"))
    slots += _ptrs("lse2", "dsum", "dq_semaphore", "dq_accum", "dq_done", "ctas_done")
    slots += [_slot("scale", "f32", value="scale"), _slot("scale_log2", "f32", value="scale_log2")]
    slots += _i32s("turn_tiles", "first_write")
    slots += _ptrs("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")
    slots += _i32s("use_seqused_q", "use_seqused_k", "batch")
    slots += [_slot("order", "ptr", tensor="order"), _slot("lpt", "i32", fields=["lpt"])]
    return with_offsets(slots)


def bwd_varlen_postprocess_plan() -> list[dict]:
    """PrePostSm90.postprocess_varlen: the fp32 accumulator to packed dQ rows (the main
    grid's size from total_k, batch and heads_kv: when all its CTAs have ended)."""
    slots = _ptrs("dq_accum", "dq_semaphore", "dq_done", "ctas_done", "dq") + _strides_sh("dq")
    slots += _i32s("total_q", "heads_q") + [_slot("scale", "f32", value="scale")] + _i32s("first_write")
    slots += _ptrs("cu_seqlens_q", "seqused_q") + _i32s("use_seqused_q")
    slots += _ptrs("cu_seqlens_k", "seqused_k") + _i32s("use_seqused_k", "batch", "total_k", "heads_kv")
    return with_offsets(slots)


def with_offsets(slots: list[dict]) -> list[dict]:
    """Lay slots out back to back, each at its alignment, as PTX parameters are."""
    offset = 0
    out = []
    for s in slots:
        offset = -(-offset // s["align"]) * s["align"]
        out.append({**s, "offset": offset})
        offset += s["size"]
    return out


def buffer_size(slots: list[dict]) -> int:
    end = max(s["offset"] + s["size"] for s in slots)
    align = max(s["align"] for s in slots)
    return -(-end // align) * align


# PTX patterns, compiled on first use (re's cache): a build's check, not the run time's import
_ENTRY = r"\.entry\s+(\S+)\s*\((.*?)\)"
_PARAM_ARRAY = r"\.param\s+(?:\.align\s+(\d+)\s+)?\.b8\s+\S+?\[(\d+)\]"
_PARAM_SCALAR = r"\.param\s+\.([a-z]+)(\d+)\b"


def ptx_entries(ptx: str) -> dict[str, list[tuple[int, int]]]:
    """{kernel symbol: [(size, alignment) per .param]} from PTX text."""
    entries = {}
    for name, body in re.findall(_ENTRY, ptx, re.S):
        params = []
        for decl in body.split(","):
            decl = decl.strip()
            if not decl:
                continue
            m = re.search(_PARAM_ARRAY, decl)
            if m:
                params.append((int(m.group(2)), int(m.group(1) or 1)))
                continue
            m = re.search(_PARAM_SCALAR, decl)
            if not m:
                raise ValueError(f"unrecognised PTX parameter: {decl!r}")
            size = int(m.group(2)) // 8
            params.append((size, size))
        entries[name] = params
    return entries


def check_against_ptx(slots: list[dict], ptx: str, symbol: str) -> None:
    """Raise ValueError unless the plan's (size, alignment) sequence is the PTX's."""
    entries = ptx_entries(ptx)
    if symbol not in entries:
        raise ValueError(f"kernel {symbol} not in the PTX (has {sorted(entries)})")
    got = entries[symbol]
    want = [(s["size"], s["align"]) for s in slots]
    if got != want:
        raise ValueError(
            f"parameter plan {want} does not match the PTX of {symbol}: {got}. The DSL's "
            "argument flattening changed; update fa4_aot/abi.py for this kernel."
        )
