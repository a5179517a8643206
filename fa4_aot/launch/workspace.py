"""A kernel's workspace, laid out by its manifest row's rule (``row["workspace"]``): the
backward's statistics and dQ accumulator, decode's split partials, the varlen forward's
sequence order.

A rule lists regions in order, each ``itemsize`` bytes times the product of its ``count``
factors (fa4_aot.launch.rules expressions over the problem's sizes and run-time values, the
rule's ``constants`` and its ``derived`` names, evaluated in order). Every region starts
``align``-byte aligned; the last one is not padded. ``views`` give a region the contiguous
tensor shape a launch takes it as (each dim a product of factors).

The build writes the rules (fa4_aot/src: the kernels' configs); this module only
evaluates them. Standard library only.
"""

from __future__ import annotations

import math

from ..errors import LayoutError, ShapeError
from .rules import bind, evaluate


def names(rule: dict, values: dict) -> dict:
    """The values a rule's factors may name: a problem's sizes and run-time values
    (``values``), the rule's constants and its derived names."""
    return bind(rule.get("derived", {}), {**values, **rule["constants"]})


def _product(factors, values: dict) -> int:
    out = 1
    for f in factors:
        out *= evaluate(f, values)
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
