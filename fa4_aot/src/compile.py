"""Compile one variant with the CuTe DSL into a cubin and its launch contract.

Build-time only (imported by build_kernels.py): needs nvidia-cutlass-dsl, never a GPU.
Every dynamic size is a ``cute.sym_int`` and every tensor a fake one, so the cubin serves
any shape the contract admits; nothing is read from the build machine's hardware.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

from .. import abi
from ..cubin_info import kernel_info
from ..variants import Variant
from .common import heaviest_first
from .sm90.bwd.config import PERSISTENT_MAX_KEYS, BwdConfig, workspace_rule
from .sm90.bwd.kernel import FlashBwdSm90
from .sm90.decode import config as decode_config
from .sm90.decode.combine import CombineSm90
from .sm90.decode.kernel import DecodeSm90
from .sm90.fwd.config import FwdConfig
from .sm90.fwd.kernel import FlashFwdSm90
from .sm90.primitives import DTYPES

SWIZZLE_BYTES = {0: "NONE", 1: "32B", 2: "64B", 3: "128B"}
# The (s, d, h, b) order the kernels give their TMA coordinate tensors, by axis letter of
# the user-facing (b, s, h, d) layout.
COORD_AXES = ("s", "d", "h", "b")
FP32_TENSORS = {"dq_accum": "fp32"}  # TMA tensors whose dtype is not the variant's
_GBASIS = re.compile(r'tma_gbasis = <"\(([^)]*)\):\(([^)]*)\)">')


def _fake_bshd(dtype, head_dim: int):
    """(b, s, h, d) with any 16-byte-aligned strides and a contiguous last dim."""
    dims = [cute.sym_int() for _ in range(3)]
    strides = [cute.sym_int64(divisibility=8) for _ in range(3)]
    return make_fake_tensor(
        dtype, (*dims, head_dim), stride=(*strides, 1), assumed_align=16
    )


def tensormap_recipe(tensor: str, atom_type: str, swizzle: str, dtype_name: str) -> dict:
    """How to encode this atom's CUtensorMap with cuTensorMapEncodeTiled at run time."""
    m = _GBASIS.search(atom_type)
    if not m:
        raise RuntimeError(f"cannot read the TMA basis of {tensor}: {atom_type}")
    box = [int(x) for x in m.group(1).split(",")]
    axes = []
    for basis in m.group(2).split(","):
        scale, mode = basis.split("@")
        if scale != "1":
            raise RuntimeError(f"TMA basis {m.group(0)} of {tensor} splits a mode")
        axes.append(COORD_AXES[int(mode)])
    if axes != ["d", "s", "h", "b"]:
        raise RuntimeError(f"TMA dims of {tensor} are {axes}, expected d, s, h, b")
    bits = re.fullmatch(r"S<(\d),(\d),(\d)>", swizzle)
    return {
        "tensor": tensor,
        "dtype": dtype_name,
        "dims": axes,  # innermost first; sizes and strides come from the tensor
        "box": box,
        "element_strides": [1] * len(box),
        "interleave": "NONE",
        "swizzle": SWIZZLE_BYTES[int(bits.group(1))],
        "l2_promotion": "128B",
        "oob_fill": "NONE",
    }


def check_against_cubin(params: list[dict], info) -> None:
    """The cubin's own parameter table (KPARAM_INFO) must agree with the plan."""
    base = info.params[0][1] if info.params else 0
    got = [(off - base, size) for _, off, size in info.params]
    want = [(p["offset"], p["size"]) for p in params]
    if got != want:
        raise RuntimeError(f"cubin parameters {got} differ from the plan {want}")


def _compile(kernel, args, variant: Variant):
    """cute.compile with fake arguments; returns (cubin bytes, PTX text, kernel symbols in launch order)."""
    with tempfile.TemporaryDirectory() as tmp:
        # The DSL names dumps after the argument types, which several variants share.
        compiled = cute.compile(
            kernel, *args,
            options=f"--gpu-arch {variant.gpu_arch} --keep-cubin --keep-ptx --dump-dir {tmp}",
        )
        art = compiled.artifacts
        cubin = Path(art.CUBIN).read_bytes() if isinstance(art.CUBIN, str) else art.CUBIN
        ptx = Path(art.PTX).read_text() if os.path.exists(art.PTX) else art.PTX
    return cubin, ptx, list(compiled.kernel_info)


def _launch(cubin: bytes, ptx: str, symbol: str, params: list[dict], block, grid, smem_bytes: int,
            programmatic: bool = False) -> dict:
    """One kernel's launch contract, its parameter plan checked against PTX and cubin.
    ``programmatic``: launched with programmatic stream serialization, so it may start
    before the launch before it on the stream ends (the kernel then calls
    griddepcontrol.wait before it reads what that launch writes)."""
    abi.check_against_ptx(params, ptx, symbol)
    info = kernel_info(cubin, symbol)
    check_against_cubin(params, info)
    return {
        "symbol": symbol,
        "block": list(block),
        "cluster": [1, 1, 1],
        "grid": grid,
        "smem_bytes": int(smem_bytes),
        "programmatic": programmatic,
        "static_smem_bytes": info.static_smem_bytes,
        "registers": info.registers,  # at entry; setmaxnreg moves them between roles
        "local_bytes": info.frame_bytes,  # stack frame: spills and local arrays
        "params": params,
    }


def _recipes(kernel, variant: Variant) -> dict:
    return {
        name: tensormap_recipe(name, atom_type, swizzle, FP32_TENSORS.get(name, variant.dtype))
        for name, (atom_type, swizzle) in kernel.tma_boxes.items()
    }


def _fake_rows(dtype, rank: int, static_last: int | None = None):
    """A contiguous tensor of ``rank`` dynamic sizes, and one more static one if given."""
    shape = tuple(cute.sym_int() for _ in range(rank)) + ((static_last,) if static_last else ())
    return make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
        assumed_align=16 if static_last else 4,
    )


def compile_fwd(variant: Variant) -> dict:
    """Build one forward variant; returns the cubin, its PTX and its manifest fields."""
    dtype = DTYPES[variant.dtype]
    cfg = FwdConfig.of(variant)
    kernel = FlashFwdSm90(cfg)
    if cfg.varlen:
        return _compile_fwd_varlen(variant, cfg, kernel)
    args = [*(_fake_bshd(dtype, variant.head_dim) for _ in range(4)), _fake_rows(Float32, 3), Float32(1.0)]
    cubin, ptx, symbols = _compile(kernel, args, variant)
    if len(symbols) != 1:
        raise RuntimeError(f"{variant.name}: expected one kernel, got {symbols}")
    grid = [["ceil_div", "seqlen_q", cfg.tile_m * cfg.q_tiles], ["size", "heads_q"], ["size", "batch"]]
    launch = _launch(cubin, ptx, symbols[0], abi.fwd_plan(), [cfg.threads, 1, 1], grid, kernel.smem_bytes)
    tiling = {"tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "stages": cfg.stages}
    return {"cubin": cubin, "ptx": ptx, "tiling": tiling, "launches": [launch],
            "tensormaps": _recipes(kernel, variant), "config": cfg.to_dict()}


def _compile_fwd_varlen(variant: Variant, cfg: FwdConfig, kernel: FlashFwdSm90) -> dict:
    """The varlen forward: packed (1, total, h, d) tensors, LSE (h_q, total_q), cu_seqlens
    and seqused int32 vectors, the order workspace; the heaviest-first sort (launched only
    where the run-time value ``lpt`` is not 0), then one CTA per (query tile, head), every
    sequence's tiles back to back."""
    dtype = DTYPES[variant.dtype]
    lengths = [_fake_rows(cutlass.Int32, 1) for _ in range(4)]  # cu_seqlens_q, _k, seqused_q, _k
    args = [*(_fake_bshd(dtype, variant.head_dim) for _ in range(4)), _fake_rows(Float32, 2), Float32(1.0),
            *lengths, cutlass.Int32(0), cutlass.Int32(0), _fake_rows(cutlass.Int32, 1), cutlass.Int32(0)]
    cubin, ptx, symbols = _compile(kernel.varlen_call, args, variant)
    order = ["order_varlen", "kernel_varlen"]
    if len(symbols) != 2 or not all(f"kernel_cutlass_{role}_" in sym for role, sym in zip(order, symbols)):
        raise RuntimeError(f"{variant.name}: expected kernels {order} in order, got {symbols}")
    sort = _launch(cubin, ptx, symbols[0], abi.varlen_order_plan(), [heaviest_first.THREADS, 1, 1],
                   [["const", 1], ["const", 1], ["const", 1]], heaviest_first.SMEM_BYTES)
    sort["when"] = "lpt"
    # every sequence's tiles fit ceil(total_q / tile_m) + batch CTAs (common/seqlen.packed_tile)
    grid = [["add", ["ceil_div", "total_q", cfg.tile_m], ["size", "batch"]], ["size", "heads_q"], ["const", 1]]
    launch = _launch(cubin, ptx, symbols[1], abi.fwd_varlen_plan(), [cfg.threads, 1, 1], grid, kernel.smem_bytes)
    tiling = {"tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "stages": cfg.stages}
    return {"cubin": cubin, "ptx": ptx, "tiling": tiling, "launches": [sort, launch],
            "tensormaps": _recipes(kernel, variant), "config": cfg.to_dict()}


def compile_bwd(variant: Variant) -> dict:
    """Build one backward variant: preprocess, main kernel and postprocess in one cubin."""
    dtype = DTYPES[variant.dtype]
    cfg = BwdConfig.of(variant)
    kernel = FlashBwdSm90(cfg)
    if cfg.varlen:
        return _compile_bwd_varlen(variant, cfg, kernel)
    args = [*(_fake_bshd(dtype, variant.head_dim) for _ in range(8)),
            _fake_rows(Float32, 3), _fake_rows(Float32, 3), _fake_rows(Float32, 3),
            _fake_rows(Float32, 3, static_last=variant.head_dim), _fake_rows(cutlass.Int32, 3),
            _fake_rows(cutlass.Int32, 2), Float32(1.0), Float32(1.0), cutlass.Int32(1), cutlass.Int32(1),
            _fake_rows(cutlass.Int32, 1), _fake_rows(Float32, 1), cutlass.Int32(0), cutlass.Int32(1)]
    cubin, ptx, symbols = _compile(kernel, args, variant)
    rows = [["ceil_div", "seqlen_q", cfg.tile_m], ["size", "heads_q"], ["size", "batch"]]
    plans = {
        # the first launch waits for everything before it; the other two are programmatic
        "preprocess": (abi.bwd_preprocess_plan(), [kernel.rows.threads, 1, 1], rows, 0, False),
        "kernel": (abi.bwd_main_plan(dq_tensor_map=not cfg.dq_fragment_order), [cfg.threads, 1, 1],
                   _bwd_main_grid(cfg), kernel.smem_bytes, True),
        "postprocess": (abi.bwd_postprocess_plan(), [kernel.rows.threads, 1, 1], rows,
                        kernel.rows.post_smem_bytes, True),
    }
    return _bwd_result(variant, cfg, kernel, cubin, ptx, symbols, plans)


def _compile_bwd_varlen(variant: Variant, cfg: BwdConfig, kernel: FlashBwdSm90) -> dict:
    """The varlen backward: packed (1, total, h, d) tensors, LSE (h_q, total_q), the
    workspace by config.varlen_workspace_rule, cu_seqlens and seqused int32 vectors, the
    order (a workspace region); the heaviest-first sort (launched only where the run-time
    value ``lpt`` is not 0), then the three kernels, each grid ceil(total / tile) + batch
    blocks by heads (common/seqlen.packed_tile_of_cta)."""
    dtype = DTYPES[variant.dtype]
    lengths = [_fake_rows(cutlass.Int32, 1) for _ in range(4)]  # cu_seqlens_q, _k, seqused_q, _k
    args = [*(_fake_bshd(dtype, variant.head_dim) for _ in range(8)),
            _fake_rows(Float32, 2), _fake_rows(Float32, 2), _fake_rows(Float32, 2),
            _fake_rows(Float32, 3, static_last=variant.head_dim), _fake_rows(cutlass.Int32, 3),
            _fake_rows(cutlass.Int32, 2), _fake_rows(cutlass.Int64, 1), Float32(1.0), Float32(1.0), cutlass.Int32(1),
            cutlass.Int32(1), *lengths, cutlass.Int32(0), cutlass.Int32(0), _fake_rows(cutlass.Int32, 1),
            cutlass.Int32(0)]
    cubin, ptx, symbols = _compile(kernel.varlen_call, args, variant)
    rows = [["add", ["ceil_div", "total_q", cfg.tile_m], ["size", "batch"]], ["size", "heads_q"], ["const", 1]]
    main = [["add", ["ceil_div", "total_k", cfg.tile_n], ["size", "batch"]], ["size", "heads_kv"], ["const", 1]]
    plans = {
        "order_varlen": (abi.varlen_order_plan(), [heaviest_first.THREADS, 1, 1],
                         [["const", 1], ["const", 1], ["const", 1]], heaviest_first.SMEM_BYTES, False, "lpt"),
        "preprocess_varlen": (abi.bwd_varlen_preprocess_plan(), [kernel.rows.threads, 1, 1], rows, 0, False),
        "kernel_varlen": (abi.bwd_varlen_main_plan(dq_tensor_map=not cfg.dq_fragment_order), [cfg.threads, 1, 1],
                          main, kernel.smem_bytes, True),
        "postprocess_varlen": (abi.bwd_varlen_postprocess_plan(), [kernel.rows.threads, 1, 1], rows,
                               kernel.rows.post_smem_bytes, True),
    }
    return _bwd_result(variant, cfg, kernel, cubin, ptx, symbols, plans)


def _bwd_result(variant: Variant, cfg: BwdConfig, kernel: FlashBwdSm90, cubin: bytes, ptx: str, symbols: list,
                plans: dict) -> dict:
    """A backward's manifest fields from its kernels' ``plans`` (role -> launch plan, in
    launch order: varlen, the sort; preprocess, main kernel, postprocess; each role's name
    in its symbol). A plan of six entries ends with its launch's ``when`` (a run-time value
    that leaves the launch out where it is 0)."""
    order = list(plans)
    if len(symbols) != len(order) or not all(f"kernel_cutlass_{role}_" in sym for role, sym in zip(order, symbols)):
        raise RuntimeError(f"{variant.name}: expected kernels {order} in order, got {symbols}")
    launches = []
    for role, sym in zip(order, symbols):
        plan, when = plans[role][:5], plans[role][5:]
        launches.append(_launch(cubin, ptx, sym, *plan))
        if when:
            launches[-1]["when"] = when[0]
    recipes = _recipes(kernel, variant)
    if "dq_accum" in recipes:
        # the kernel's second accumulator map (stores) is encoded from the reduce's recipe
        store = tensormap_recipe("dq_accum", *kernel.dq_store_box, FP32_TENSORS["dq_accum"])
        if store != recipes["dq_accum"]:
            raise RuntimeError(f"{variant.name}: the dQ store map {store} differs from the reduce's")
    tiling = {"tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "stages": cfg.stages}
    return {"cubin": cubin, "ptx": ptx, "tiling": tiling, "launches": launches, "tensormaps": recipes,
            "dq_chains": cfg.chains, "config": cfg.to_dict(), "workspace": workspace_rule(cfg)}


def _bwd_main_grid(cfg: BwdConfig) -> list:
    """One CTA per (key tile, KV head, batch), or (persistent, up to PERSISTENT_MAX_KEYS
    keys) one per SM, at most one per item: the CTAs walk the items in launch order; or
    (tail split) one per item but the last partial wave's, split into pieces."""
    items = [["ceil_div", "seqlen_k", cfg.tile_n], ["size", "heads_kv"], ["size", "batch"]]
    if cfg.persistent:
        return [["persistent", items, ["seqlen_k", PERSISTENT_MAX_KEYS]], ["const", 1], ["const", 1]]
    if cfg.tail_split:
        return [["split_tail", items, "tail_tiles", "tail_pieces"], ["const", 1], ["const", 1]]
    return items


def compile_decode(variant: Variant) -> dict:
    """The decode kernel: K/V cache tensor maps, Q/O by address, the split workspace; one
    CTA per (row tile x split, KV head, batch), the grid's x the launch's ``decode_ctas``."""
    dtype = DTYPES[variant.dtype]
    cfg = decode_config.DecodeConfig.of(variant)
    kernel = DecodeSm90(cfg)
    args = [*(_fake_bshd(dtype, variant.head_dim) for _ in range(4)), _fake_rows(Float32, 3), _fake_rows(Float32, 5),
            _fake_rows(Float32, 4), _fake_rows(cutlass.Int32, 1), _fake_rows(cutlass.Int32, 2), Float32(1.0),
            *(cutlass.Int32(1) for _ in range(8))]
    cubin, ptx, symbols = _compile(kernel, args, variant)
    if len(symbols) != 1:
        raise RuntimeError(f"{variant.name}: expected one kernel, got {symbols}")
    grid = [["size", "decode_ctas"], ["size", "heads_kv"], ["size", "batch"]]
    launch = _launch(cubin, ptx, symbols[0], abi.decode_plan(), [cfg.threads, 1, 1], grid, kernel.smem_bytes)
    return {"cubin": cubin, "ptx": ptx, "tiling": {"tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "stages": cfg.stages},
            "launches": [launch], "tensormaps": _recipes(kernel, variant), "config": cfg.to_dict(),
            "workspace": decode_config.workspace_rule(cfg)}


def compile_combine(variant: Variant) -> dict:
    """The split-KV combine: one warp per (batch, query token, query head) row."""
    dtype = DTYPES[variant.dtype]
    cfg = decode_config.CombineConfig.of(variant)
    kernel = CombineSm90(cfg)
    args = [_fake_rows(Float32, 5), _fake_rows(Float32, 4), _fake_bshd(dtype, variant.head_dim), _fake_rows(Float32, 3),
            *(cutlass.Int32(1) for _ in range(4))]
    cubin, ptx, symbols = _compile(kernel, args, variant)
    if len(symbols) != 1:
        raise RuntimeError(f"{variant.name}: expected one kernel, got {symbols}")
    grid = [["ceil_div", "combine_rows", cfg.rows], ["const", 1], ["const", 1]]
    launch = _launch(cubin, ptx, symbols[0], abi.combine_plan(), [cfg.threads, 1, 1], grid, 0)
    return {"cubin": cubin, "ptx": ptx, "tiling": {}, "launches": [launch], "tensormaps": {},
            "config": cfg.to_dict()}


def compile_variant(variant: Variant) -> dict:
    if variant.kind == "fwd" and variant.arch == "sm90a":
        return compile_fwd(variant)
    if variant.kind == "decode" and variant.arch == "sm90a":
        return compile_decode(variant)
    if variant.kind == "combine" and variant.arch == "sm90a":
        return compile_combine(variant)
    if variant.kind == "bwd" and variant.arch == "sm90a":
        return compile_bwd(variant)
    raise NotImplementedError(f"no kernel source for {variant.name}")


def ptxas_release(ptx: str) -> str:
    m = re.search(r"Cuda compilation tools, release ([\d.]+), (V[\d.]+)", ptx)
    return f"{m.group(1)} ({m.group(2)})" if m else "unknown"
