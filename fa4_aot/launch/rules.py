"""The manifest's rules: integer expressions the build writes and the run time evaluates
over a call's sizes and run-time values, so that what a kernel was built with is never
re-derived by hand at run time (launch grids, workspace region counts, derived launch
values, tensor-map boxes).

An expression is an int, a name (a size or value of the call, or a constant of the rule),
or a list [op, arg, ...]: "add", "mul" (any number of args), "sub", "div" (floor),
"ceil_div", "min", "max", "gcd", "le" (1 where a <= b, else 0), "eq" (1 where a == b),
"if" (b where a is not 0, else c).

Standard library only.
"""

from __future__ import annotations

import math

from ..errors import ManifestError

_OPS = {
    "add": lambda *a: sum(a),
    "mul": lambda *a: math.prod(a),
    "sub": lambda a, b: a - b,
    "div": lambda a, b: a // b,
    "ceil_div": lambda a, b: -(-a // b),
    "min": min,
    "max": max,
    "gcd": math.gcd,
    "le": lambda a, b: int(a <= b),
    "eq": lambda a, b: int(a == b),
}


def evaluate(expr, names: dict) -> int:
    """The value of ``expr`` with ``names`` bound."""
    if type(expr) is int:
        return expr
    if type(expr) is str:
        try:
            return names[expr]
        except KeyError:
            raise ManifestError(f"the manifest names {expr!r}, which this fa4_aot does not provide: the kernels are "
                                "from another version; rebuild or reinstall") from None
    op, *args = expr
    if op == "if":
        condition, then, otherwise = args
        return evaluate(then if evaluate(condition, names) else otherwise, names)
    try:
        fn = _OPS[op]
    except KeyError:
        raise ManifestError(f"unknown rule {op!r} in the manifest; rebuild or reinstall") from None
    return fn(*(evaluate(a, names) for a in args))


def bind(derived: dict, names: dict) -> dict:
    """``names`` with each of ``derived`` ({name: expression}, in order) evaluated and added."""
    out = dict(names)
    for name, expr in derived.items():
        out[name] = evaluate(expr, out)
    return out
