"""Kernel interfaces: what each kernel takes at run time, declared once.

A kernel family (the forward, the backward, decode, the combine) declares two things in
``fa4_aot/src/interfaces.py``:

- ``Inputs``: every tensor and scalar its host entry takes at run time, each with what the
  build compiles it against (a fake tensor of a dtype and rank, or a scalar type);
- per kernel, ``Params``: the kernel's parameters in order, each an input in one form (a
  TMA tensor map and its coordinates, an address, an address and strides, a scalar).

Everything else follows from those two, so a new run-time argument is one line in each:

- the build's fake arguments (``Inputs.fake_tuple``, filled by fa4_aot/src/compile.py);
- each kernel's one argument: ``Params.bind(inputs, tma)``, a NamedTuple that the DSL
  flattens in field order into PTX parameters (a field that is None is no parameter);
- the manifest's slot plan (``Params.plan(cfg)``), checked against the PTX and the cubin
  when built and against the driver when loaded;
- the run-time values: each slot names the tensor or value it is filled from
  (fa4_aot.launch.loader.pack_params), so nothing is assembled by position.

Every entry may be optional (``when``: a config flag, or "not" one): varlen is the
metadata inputs and parameters present, one declaration for both forms.

Standard library only: the build reads the plans without tracing a kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

# PTX parameter (size, alignment) of each slot kind; "extents" are int32 runs
SLOT_LAYOUT = {"tensormap": (128, 64), "ptr": (8, 8), "stride": (8, 8), "i32": (4, 4), "i64": (8, 8),
               "f32": (4, 4)}
AXES = "bsh"  # a (b, s, h, d) tensor's axes that strides and extents name
TMA_EXTENTS = "shb"  # the dynamic modes of a TMA coordinate tensor over (s, d, h, b)


def _holds(cfg, when: str) -> bool:
    """Whether config ``cfg`` has flag ``when`` ("" always; "not x": x false)."""
    if not when:
        return True
    negate = when.startswith("not ")
    value = bool(getattr(cfg, when[4:] if negate else when))
    return value != negate


# ------------------------------------------------------------------ inputs (host entry)
@dataclass(frozen=True)
class Input:
    """One run-time input of a family's host entry.

    ``fake``: what the build compiles against: "io" a (b, s, h, d) tensor of the variant's
    dtype (any 16-byte strides, d static and contiguous), "io_v" the same d_v wide (the
    config's ``head_dim_v``: v and out); "f32", "i32", "i64" a contiguous
    tensor of ``rank`` dynamic sizes (``varlen_rank`` where the variant is varlen), with a
    static last dim of the head dim where ``head_dim_last``; "Int32", "Float32" a scalar,
    which takes ``default`` where a call gives no value of that name (the manifest's slot
    carries it: a new argument with a neutral default needs no change of the run time).
    """

    name: str
    fake: str
    rank: int = 0
    varlen_rank: int | None = None
    head_dim_last: bool = False
    when: str = ""
    default: int | float | None = None

    def rank_for(self, cfg) -> int:
        return self.varlen_rank if self.varlen_rank is not None and cfg.varlen else self.rank


class Inputs:
    """A family's run-time inputs: the host entry's one argument is ``tuple_type`` (a
    NamedTuple, fields in declaration order; an input the config leaves out is None)."""

    def __init__(self, name: str, *inputs: Input):
        self.inputs = inputs
        self.by_name = {i.name: i for i in inputs}
        if len(self.by_name) != len(inputs):
            raise ValueError(f"{name}: an input is declared twice")
        self.tuple_type = NamedTuple(name, [(i.name, object) for i in inputs])

    def present(self, cfg) -> list[Input]:
        return [i for i in self.inputs if _holds(cfg, i.when)]

    def fake_tuple(self, cfg, make) -> tuple:
        """The host entry's argument for the build: ``make(input, cfg)`` of each present
        input, None for the others."""
        return self.tuple_type(**{i.name: make(i, cfg) if _holds(cfg, i.when) else None for i in self.inputs})


# ------------------------------------------------------------------ kernel parameters
class Tma(NamedTuple):
    """A TMA-loaded or -stored tensor: its copy atom (a CUtensorMap parameter) and its
    coordinate tensor (s, d, h, b) (the int32 extents s, h, b)."""

    atom: object
    coords: object


class Rows(NamedTuple):
    """A tensor addressed by hand: its address and element strides (one per named axis)."""

    ptr: object
    strides: tuple


@dataclass(frozen=True)
class Param:
    """One kernel parameter: input ``source`` in a ``form``:

    - "tma": its tensor map and coordinates (``Tma``; the atom from the kernel's host
      code); "tma_map": a second map of the same tensor (a store beside a reduce), no
      coordinates;
    - "ptr": its address; "rows": its address and strides over ``axes`` (``Rows``);
    - "i32", "i64", "f32": the scalar itself.
    """

    field: str
    form: str
    source: str
    axes: str = ""
    when: str = ""

    def slots(self, default=None) -> list[dict]:
        """The manifest slots of this parameter, in PTX order (offsets not yet laid); a
        scalar's ``default`` where its input has one."""
        if self.form == "tma":
            return [_slot(f"tma_{self.field}", "tensormap", tensor=self.source),
                    _slot(f"{self.field}_coords", "extents", tensor=self.source, axes=TMA_EXTENTS)]
        if self.form == "tma_map":
            return [_slot(f"tma_{self.field}", "tensormap", tensor=self.source)]
        if self.form == "ptr":
            return [_slot(self.field, "ptr", tensor=self.source)]
        if self.form == "rows":
            return [_slot(self.field, "ptr", tensor=self.source),
                    *(_slot(f"{self.field}_stride_{a}", "stride", tensor=self.source, axis=a) for a in self.axes)]
        if self.form in ("i32", "i64", "f32"):
            extra = {} if default is None else {"default": default}
            return [_slot(self.field, self.form, value=self.source, **extra)]
        raise ValueError(f"unknown parameter form {self.form!r}")

    def bind(self, inputs, tma: dict):
        """This parameter's kernel argument from the host entry's ``inputs`` and the
        kernel's TMA atoms ``tma`` ({source: Tma})."""
        if self.form == "tma":
            return tma[self.field]
        if self.form == "tma_map":
            return tma[self.field].atom
        value = getattr(inputs, self.source)
        if self.form == "ptr":
            return value.iterator
        if self.form == "rows":
            return Rows(value.iterator, tuple(value.stride[AXES.index(a)] for a in self.axes))
        return value


def tma(name: str, source: str | None = None, when: str = "") -> Param:
    return Param(name, "tma", source or name, when=when)


def tma_map(name: str, source: str, when: str = "") -> Param:
    return Param(name, "tma_map", source, when=when)


def ptr(name: str, source: str | None = None, when: str = "") -> Param:
    return Param(name, "ptr", source or name, when=when)


def rows(name: str, axes: str, source: str | None = None, when: str = "") -> Param:
    return Param(name, "rows", source or name, axes=axes, when=when)


def i32(name: str, source: str | None = None, when: str = "") -> Param:
    return Param(name, "i32", source or name, when=when)


def i64(name: str, source: str | None = None, when: str = "") -> Param:
    return Param(name, "i64", source or name, when=when)


def f32(name: str, source: str | None = None, when: str = "") -> Param:
    return Param(name, "f32", source or name, when=when)


def _leaves(value):
    """The values a kernel argument flattens to, in order (None: none)."""
    if value is None:
        return
    if isinstance(value, tuple):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


class KernelArgs(tuple):
    """Base of the NamedTuples ``Params`` makes: the DSL names a kernel after its
    arguments' ``str`` (and ptxas's code depends on that name: docs/design.md, "Kernel
    symbols"), so one argument reads as its leaves would as separate arguments."""

    __slots__ = ()

    def __str__(self):
        return "_".join(str(leaf).replace("class", "").replace(" ", "") for leaf in _leaves(self))


class Params:
    """A kernel's parameters in order. ``tuple_type`` is its one argument's type (annotate
    the @cute.kernel's parameter with it); ``bind`` builds it; ``plan`` gives the slots."""

    def __init__(self, name: str, *params: Param, inputs: Inputs | None = None):
        self.name, self.params = name, params
        fields = [p.field for p in params]
        if len(set(fields)) != len(fields):
            raise ValueError(f"{name}: a field is declared twice")
        if inputs is not None:
            unknown = [p.source for p in params if p.source not in inputs.by_name]
            if unknown:
                raise ValueError(f"{name}: parameters of undeclared inputs {unknown}")
        self.inputs = inputs
        base = NamedTuple(name, [(f, object) for f in fields])
        self.tuple_type = type(name, (KernelArgs, base), {"__slots__": ()})

    def present(self, cfg) -> list[Param]:
        return [p for p in self.params if _holds(cfg, p.when)]

    def bind(self, cfg, inputs, tma: dict | None = None):
        """The kernel's argument: each present parameter from ``inputs`` (and ``tma``), None
        for the others."""
        tma = tma or {}
        return self.tuple_type(**{p.field: p.bind(inputs, tma) if _holds(cfg, p.when) else None
                                  for p in self.params})

    def plan(self, cfg) -> list[dict]:
        """The manifest's slots of this kernel for config ``cfg``, laid out as PTX lays
        parameters (each at its alignment, back to back)."""
        defaults = {} if self.inputs is None else {i.name: i.default for i in self.inputs.inputs}
        return with_offsets([s for p in self.present(cfg) for s in p.slots(defaults.get(p.source))])


def _slot(name: str, kind: str, **fields) -> dict:
    if kind == "extents":
        size, align = 4 * len(fields["axes"]), 4
    else:
        size, align = SLOT_LAYOUT[kind]
    return {"name": name, "kind": kind, "size": size, "align": align, **fields}


def with_offsets(slots: list[dict]) -> list[dict]:
    """Lay slots out back to back, each at its alignment, as PTX parameters are."""
    offset, out = 0, []
    for s in slots:
        offset = -(-offset // s["align"]) * s["align"]
        out.append({**s, "offset": offset})
        offset += s["size"]
    return out


# ------------------------------------------------------------------ the PTX check
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
            "argument flattening changed, or a kernel was not handed its declared parameters "
            "(fa4_aot/src/interfaces.py)."
        )
