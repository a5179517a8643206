"""The backward's workspace, laid out by its manifest row's rule (``row["workspace"]``).

A rule lists regions in order, each ``itemsize`` bytes times the product of its ``count``
factors: numbers, or names of the problem's sizes (batch, seqlen_q, seqlen_k, heads_q,
heads_kv, head_dim), ``m_blocks`` (ceil(seqlen_q / query_tile)), ``partial_tiles`` (the
split last wave's bound: fa4_aot.policy.partial_tiles) and the rule's ``constants``. Every
region starts ``align``-byte aligned; the last one is not padded. ``views`` give a region
the contiguous tensor shape a launch takes it as (each dim a product of factors).

The build writes the rule (fa4_aot/src/sm90/bwd/config.py, workspace_rule); this module
only evaluates it. Standard library only.
"""

from __future__ import annotations

import math

from .errors import LayoutError, ManifestError, ShapeError


def names(rule: dict, sizes: dict, partial_tiles: int) -> dict:
    """The values a rule's factors may name, for a problem's ``sizes``."""
    constants = rule["constants"]
    return {**sizes, **constants, "m_blocks": -(-sizes["seqlen_q"] // constants["query_tile"]),
            "partial_tiles": partial_tiles}


def _product(factors, values: dict) -> int:
    out = 1
    for f in factors:
        if isinstance(f, str):
            if f not in values:
                raise ManifestError(f"workspace rule names {f!r}, which this fa4_aot does not know: "
                                    "rebuild the kernels with this version")
            f = values[f]
        out *= int(f)
    return out


def regions(rule: dict, values: dict) -> list[tuple[str, int]]:
    """(name, bytes) of each region, in order."""
    return [(r["name"], r["itemsize"] * _product(r["count"], values)) for r in rule["regions"]]


def _padded(size: int, align: int) -> int:
    return -(-size // align) * align


def total_bytes(rule: dict, sized: list[tuple[str, int]]) -> int:
    """The regions back to back, each but the last padded to ``align`` (as ``carve`` lays them)."""
    align = rule["align"]
    return sum(_padded(size, align) for _, size in sized[:-1]) + sized[-1][1]


def carve(rule: dict, values: dict, ptr: int, have: int) -> dict:
    """Launch tensors ({"ptr", "shape", "strides", "itemsize"}) of each region of a workspace
    of ``have`` bytes at ``ptr``; a typed error if it is too small or misaligned."""
    sized = regions(rule, values)
    need = total_bytes(rule, sized)
    if have < need:
        raise ShapeError(f"workspace has {have} bytes; this problem needs {need} "
                         "(fa4_aot.backward_workspace_bytes, with the same causal and deterministic)")
    align = rule["align"]
    if ptr % align:
        raise LayoutError(f"workspace pointer {ptr:#x} is not {align}-byte aligned")
    itemsize = {r["name"]: r["itemsize"] for r in rule["regions"]}
    out, at = {}, ptr
    for name, size in sized:
        out[name] = {"ptr": at, "shape": None, "strides": None, "itemsize": itemsize[name]}
        at += _padded(size, align)
    for name, dims in rule.get("views", {}).items():
        shape = tuple(_product(d, values) for d in dims)
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        out[name].update(shape=shape, strides=strides)
    return out
