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

from .cubin_info import kernel_info
from ..variants import Variant
from .common import lpt
from .common.params import Input, check_against_ptx
from .common.registers import check_roles
from .sm90.bwd.config import PERSISTENT_MAX_KEYS, BwdConfig, workspace_rule
from .sm90.bwd.kernel import FlashBwdSm90
from .sm90.decode import config as decode_config
from .sm90.decode.combine import CombineSm90
from .sm90.decode.kernel import DecodeSm90
from .sm90.fwd.config import FwdConfig
from .sm90.fwd.head_split import FlashFwdSm90HeadSplit
from .sm90.fwd.kernel import FlashFwdSm90
from .interfaces import (
    BWD_INPUTS, BWD_MAIN, BWD_LPT, BWD_POSTPROCESS, BWD_PREPROCESS, BWD_SINK, COMBINE, COMBINE_INPUTS, DECODE, DECODE_INPUTS, FWD, FWD_INPUTS, FWD_LPT,
)
from .sm90.primitives import DTYPES

SWIZZLE_BYTES = {0: "NONE", 1: "32B", 2: "64B", 3: "128B"}
# The (s, d, h, b) order the kernels give their TMA coordinate tensors, by axis letter of
# the user-facing (b, s, h, d) layout.
COORD_AXES = ("s", "d", "h", "b")
FP32_TENSORS = {"dq_accum": "fp32"}  # TMA tensors whose dtype is not the variant's
KV_DTYPES = {"e4m3": cutlass.Float8E4M3FN}  # a decode variant's cache dtype other than q's
KV_TENSORS = ("k_cache", "v_cache")
_GBASIS = re.compile(r'tma_gbasis = <"\(([^)]*)\):\(([^)]*)\)">')


def _fake_bshd(dtype, head_dim: int):
    """(b, s, h, d) with any 16-byte-aligned strides and a contiguous last dim."""
    dims = [cute.sym_int() for _ in range(3)]
    strides = [cute.sym_int64(divisibility=128 // dtype.width) for _ in range(3)]
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


def packed_tiles(total: str, tile: int) -> list:
    """The tiles of packed sequences: every sequence's tiles fit ceil(total / tile) + batch
    (common/seqlen.packed_tile), the x of the varlen grids (fa4_aot.launch.rules expression)."""
    return ["add", ["ceil_div", total, tile], "batch"]


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
    check_against_ptx(params, ptx, symbol)
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
    def dtype(name):
        if name in KV_TENSORS and variant.kv_dtype != "same":
            return variant.kv_dtype
        return FP32_TENSORS.get(name, variant.dtype)

    return {name: tensormap_recipe(name, atom_type, swizzle, dtype(name))
            for name, (atom_type, swizzle) in kernel.tma_boxes.items()}


def _fake_rows(dtype, rank: int, static_last: int | None = None):
    """A contiguous tensor of ``rank`` dynamic sizes, and one more static one if given."""
    shape = tuple(cute.sym_int() for _ in range(rank)) + ((static_last,) if static_last else ())
    return make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
        assumed_align=16 if static_last else 4,
    )


def _fake(spec: Input, cfg):
    """What the build compiles input ``spec`` against (common/params.Input)."""
    if spec.fake == "io":
        return _fake_bshd(DTYPES[cfg.dtype], cfg.head_dim)
    if spec.fake == "io_v":
        return _fake_bshd(DTYPES[cfg.dtype], cfg.head_dim_v)
    if spec.fake == "kv":  # a KV cache: q's dtype, or FP8 where the config's kv_dtype says so
        return _fake_bshd(KV_DTYPES.get(getattr(cfg, "kv_dtype", "same"), DTYPES[cfg.dtype]), cfg.head_dim)
    if spec.fake == "Int32":
        return cutlass.Int32(0)
    if spec.fake == "Float32":
        return Float32(1.0)
    dtype = {"f32": Float32, "i32": cutlass.Int32, "i64": cutlass.Int64}[spec.fake]
    return _fake_rows(dtype, spec.rank_for(cfg), static_last=cfg.head_dim if spec.head_dim_last else None)


def _symbols(variant: Variant, symbols: list, roles: list[str]) -> None:
    """Raise unless the cubin's kernels are ``roles``, in launch order."""
    if len(symbols) != len(roles) or not all(f"kernel_cutlass_{role}_" in sym for role, sym in zip(roles, symbols)):
        raise RuntimeError(f"{variant.name}: expected kernels {roles} in order, got {symbols}")


def _check_registers(variant: Variant, cfg, launch: dict) -> None:
    """The roles' registers after setmaxnreg against those ptxas gave the kernel, which can
    be fewer than the most a launch allows (common/registers.py)."""
    check_roles(variant.name, cfg.register_roles, cfg.threads, launch["registers"])


def compile_fwd(variant: Variant) -> dict:
    """Build one forward variant (interfaces.FWD): dense, the attention kernel, one CTA
    per (query tile(s), head, batch); varlen, the heaviest-first sort (launched only where
    the run-time value ``lpt`` is not 0), then one CTA per (query tile, head), every
    sequence's tiles back to back."""
    cfg = FwdConfig.of(variant)
    kernel = FlashFwdSm90HeadSplit(cfg) if cfg.head_split else FlashFwdSm90(cfg)
    cubin, ptx, symbols = _compile(kernel, [FWD_INPUTS.fake_tuple(cfg, _fake)], variant)
    block = [cfg.threads, 1, 1]
    launches = []
    if cfg.varlen:
        _symbols(variant, symbols, ["order_varlen", "kernel_varlen"])
        sort = _launch(cubin, ptx, symbols[0], FWD_LPT.plan(cfg), [lpt.THREADS, 1, 1],
                       [1, 1, 1], lpt.SMEM_BYTES)
        sort["when"] = "lpt"
        grid = [packed_tiles("total_q", cfg.tile_m), "heads_q", 1]
        launches = [sort, _launch(cubin, ptx, symbols[1], FWD.plan(cfg), block, grid, kernel.smem_bytes)]
    else:
        _symbols(variant, symbols, ["kernel"])
        grid = [["ceil_div", "seqlen_q", cfg.tile_m * cfg.q_tiles], "heads_q", "batch"]
        launches = [_launch(cubin, ptx, symbols[0], FWD.plan(cfg), block, grid, kernel.smem_bytes)]
    _check_registers(variant, cfg, launches[-1])
    tiling = {"tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "stages": cfg.stages}
    out = {"cubin": cubin, "ptx": ptx, "tiling": tiling, "launches": launches,
           "tensormaps": _recipes(kernel, variant), "config": cfg.to_dict(), "limits": {}}
    if cfg.varlen:
        out.update(workspace=lpt.workspace_rule(), limits={"lpt_max_batch": lpt.MAX_BATCH})
    return out


def compile_bwd(variant: Variant) -> dict:
    """Build one backward variant (interfaces.BWD_*): preprocess, main kernel and
    postprocess in one cubin; varlen, first the heaviest-first sort (launched only where
    the run-time value ``lpt`` is not 0), the pre- and postprocess grids ceil(total / tile) + batch
    blocks by heads (common/seqlen.packed_tile_of_cta), the workspace by
    config.varlen_workspace_rule."""
    cfg = BwdConfig.of(variant)
    kernel = FlashBwdSm90(cfg)
    cubin, ptx, symbols = _compile(kernel, [BWD_INPUTS.fake_tuple(cfg, _fake)], variant)
    pre_post_block, main_block = [kernel.pre_post.threads, 1, 1], [cfg.threads, 1, 1]
    post_smem = kernel.pre_post.post_smem_bytes
    # the first launch waits for everything before it; the main kernel and the postprocess
    # are programmatic (each may start once every block of the one before has)
    if cfg.varlen:
        pre_post = [packed_tiles("total_q", cfg.tile_m), "heads_q", 1]
        main = [packed_tiles("total_k", cfg.tile_n), "heads_kv", 1]
        plans = {
            "order_varlen": (BWD_LPT, [lpt.THREADS, 1, 1], [1, 1, 1],
                             lpt.SMEM_BYTES, False, "lpt"),
            "preprocess_varlen": (BWD_PREPROCESS, pre_post_block, pre_post, 0, False),
            "kernel_varlen": (BWD_MAIN, main_block, main, kernel.smem_bytes, True),
            "postprocess_varlen": (BWD_POSTPROCESS, pre_post_block, pre_post, post_smem, True),
        }
    else:
        pre_post = [["ceil_div", "seqlen_q", cfg.tile_m], "heads_q", "batch"]
        plans = {
            "preprocess": (BWD_PREPROCESS, pre_post_block, pre_post, 0, False),
            "kernel": (BWD_MAIN, main_block, _bwd_main_grid(cfg), kernel.smem_bytes, True),
            "postprocess": (BWD_POSTPROCESS, pre_post_block, pre_post, post_smem, True),
        }
    if cfg.local:
        # the sinks' gradient, launched last (after the postprocess, not programmatic) where use_sink
        plans["sink_grad"] = (BWD_SINK, [32, 1, 1], ["heads_q", 1, 1], 0, False, "use_sink")
    return _bwd_result(variant, cfg, kernel, cubin, ptx, symbols, plans)


def _bwd_result(variant: Variant, cfg: BwdConfig, kernel: FlashBwdSm90, cubin: bytes, ptx: str, symbols: list,
                plans: dict) -> dict:
    """A backward's manifest fields from its kernels' ``plans`` (role -> launch plan, in
    launch order: varlen, the sort; preprocess, main kernel, postprocess; each role's name
    in its symbol). A plan of six entries ends with its launch's ``when`` (a run-time value
    that leaves the launch out where it is 0)."""
    _symbols(variant, symbols, list(plans))
    launches = []
    for role, sym in zip(plans, symbols):
        (params, *plan), when = plans[role][:5], plans[role][5:]
        launches.append(_launch(cubin, ptx, sym, params.plan(cfg), *plan))
        if when:
            launches[-1]["when"] = when[0]
        if role.startswith("kernel"):
            _check_registers(variant, cfg, launches[-1])
    recipes = _recipes(kernel, variant)
    if "dq_accum" in recipes:
        # the kernel's second accumulator map (stores) is encoded from the reduce's recipe
        store = tensormap_recipe("dq_accum", *kernel.dq_store_box, FP32_TENSORS["dq_accum"])
        if store != recipes["dq_accum"]:
            raise RuntimeError(f"{variant.name}: the dQ store map {store} differs from the reduce's")
    tiling = {"tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "stages": cfg.stages}
    # varlen, the sort's bound; dense, the keys up to which the main kernel's CTAs are persistent
    limits = {"lpt_max_batch": lpt.MAX_BATCH} if cfg.varlen else {
        "persistent_max_keys": PERSISTENT_MAX_KEYS if cfg.persistent else 0}
    return {"cubin": cubin, "ptx": ptx, "tiling": tiling, "launches": launches, "tensormaps": recipes,
            "dq_chains": cfg.chains, "config": cfg.to_dict(), "workspace": workspace_rule(cfg), "limits": limits}


def _bwd_main_grid(cfg: BwdConfig) -> list:
    """One CTA per (key tile, KV head, batch), or (persistent, up to PERSISTENT_MAX_KEYS
    keys) one per SM, at most one per item: the CTAs walk the items in launch order; or
    (tail split) one per item but the last partial wave's, split into pieces."""
    items = [["ceil_div", "seqlen_k", cfg.tile_n], "heads_kv", "batch"]
    if cfg.persistent:
        every = ["mul", *items]
        return [["if", ["le", "seqlen_k", PERSISTENT_MAX_KEYS], ["min", every, "sm_count"], every], 1, 1]
    if cfg.tail_split:
        return [["add", ["mul", *items], ["mul", "tail_tiles", ["sub", "tail_pieces", 1]]], 1, 1]
    return items


def compile_decode(variant: Variant) -> dict:
    """The decode kernel (interfaces.DECODE): one CTA per (row tile x split, KV head,
    batch)."""
    cfg = decode_config.DecodeConfig.of(variant)
    kernel = DecodeSm90(cfg)
    cubin, ptx, symbols = _compile(kernel, [DECODE_INPUTS.fake_tuple(cfg, _fake)], variant)
    _symbols(variant, symbols, ["kernel"])
    rows = ["mul", ["div", "heads_q", "heads_kv"], "seqlen_q"]  # packed rows of a KV head
    grid = [["mul", ["ceil_div", rows, cfg.tile_m], "splits"], "heads_kv", "batch"]
    if cfg.persistent:  # a CTA per slot at most, each walking the items (decode/walk.py)
        grid = [["min", ["mul", *grid], ["mul", "sm_count", cfg.ctas_per_sm]], 1, 1]
    launch = _launch(cubin, ptx, symbols[0], DECODE.plan(cfg), [cfg.threads, 1, 1], grid, kernel.smem_bytes)
    _check_registers(variant, cfg, launch)
    recipes = _recipes(kernel, variant)
    for recipe in recipes.values():  # the cache is loaded in pieces of piece_rows keys
        assert recipe["box"][1] == cfg.tile_n, recipe
        recipe["box"][1] = "piece_rows"
    return {"cubin": cubin, "ptx": ptx, "tiling": {"tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "stages": cfg.stages},
            "launches": [launch], "tensormaps": recipes, "config": cfg.to_dict(),
            "workspace": decode_config.workspace_rule(cfg), "limits": decode_config.limits(),
            "values": decode_config.launch_values(cfg)}


def compile_combine(variant: Variant) -> dict:
    """The split-KV combine (interfaces.COMBINE): one warp per (batch, query token, query
    head) row."""
    cfg = decode_config.CombineConfig.of(variant)
    kernel = CombineSm90(cfg)
    cubin, ptx, symbols = _compile(kernel, [COMBINE_INPUTS.fake_tuple(cfg, _fake)], variant)
    _symbols(variant, symbols, ["kernel"])
    grid = [["ceil_div", ["mul", "batch", "seqlen_q", "heads_q"], cfg.rows], 1, 1]
    # programmatic: launched once the decode kernel's CTAs have started (or, the walking
    # kernels', ended), it waits for their writes (docs/design.md, "Decode": split-KV)
    launch = _launch(cubin, ptx, symbols[0], COMBINE.plan(cfg), [cfg.threads, 1, 1], grid, 0, programmatic=True)
    return {"cubin": cubin, "ptx": ptx, "tiling": {}, "launches": [launch], "tensormaps": {},
            "config": cfg.to_dict(), "limits": {}}


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
