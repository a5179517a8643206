"""Kernel interfaces (fa4_aot/src/interfaces.py): each kernel's parameters declared once,
and the plan, the kernel's argument and the run-time packing all following from it."""

import re
import types

import pytest

from fa4_aot.src import interfaces
from fa4_aot.src.common import params as P
from fa4_aot.src.sm90.bwd.config import BwdConfig
from fa4_aot.src.sm90.decode.config import CombineConfig, DecodeConfig
from fa4_aot.src.sm90.fwd.config import FwdConfig
from fa4_aot.variants import matrix

PTX = """
.visible .entry kern(
\t.param .align 64 .b8 kern_param_0[128],
\t.param .align 4 .b8 kern_param_1[12],
\t.param .u64 .ptr .global .align 16 kern_param_2,
\t.param .f32 kern_param_3
)
"""

# each kind's kernels, in launch order, by whether the variant is varlen
KERNELS = {
    "fwd": lambda varlen: [interfaces.FWD_LPT, interfaces.FWD] if varlen else [interfaces.FWD],
    "bwd": lambda varlen: ([interfaces.BWD_LPT] if varlen else []) + [
        interfaces.BWD_PREPROCESS, interfaces.BWD_MAIN, interfaces.BWD_POSTPROCESS],
    "decode": lambda varlen: [interfaces.DECODE],
    "combine": lambda varlen: [interfaces.COMBINE],
}
INPUTS = {"fwd": interfaces.FWD_INPUTS, "bwd": interfaces.BWD_INPUTS, "decode": interfaces.DECODE_INPUTS,
          "combine": interfaces.COMBINE_INPUTS}
CONFIGS = {"fwd": FwdConfig, "bwd": BwdConfig, "decode": DecodeConfig, "combine": CombineConfig}


def test_ptx_parameter_parser_and_layout():
    assert P.ptx_entries(PTX) == {"kern": [(128, 64), (12, 4), (8, 8), (4, 4)]}
    plan = P.Params("K", P.tma("q"), P.ptr("lse"), P.f32("s")).plan(types.SimpleNamespace())
    assert [(s["name"], s["offset"]) for s in plan] == [("tma_q", 0), ("q_coords", 128), ("lse", 144), ("s", 152)]
    P.check_against_ptx(plan, PTX, "kern")
    with pytest.raises(ValueError, match="flattening changed"):
        P.check_against_ptx(plan[:3], PTX, "kern")


class Tensor:
    """A stand-in for a host tensor: its iterator and strides name it."""

    def __init__(self, name):
        self.iterator = f"{name}.ptr"
        self.stride = tuple(f"{name}.stride.{a}" for a in "bsh")


def _sentinel_inputs(inputs, cfg):
    return inputs.fake_tuple(cfg, lambda spec, cfg: Tensor(spec.name) if spec.fake in ("io", "io_v", "f32", "i32", "i64")
                             else f"{spec.name}.value")


def _sentinel_tma(params):
    return {p.field: P.Tma(f"{p.source}.map", f"{p.source}.coords") for p in params.params if p.form == "tma"} | {
        p.field: P.Tma(f"{p.source}.map", None) for p in params.params if p.form == "tma_map"}


def _slot_sources(plan):
    """What each slot is filled with at run time (fa4_aot.launch.loader.pack_params), spelt as
    the sentinels spell the kernel's leaves."""
    spelt = {"tensormap": "{tensor}.map", "extents": "{tensor}.coords", "ptr": "{tensor}.ptr",
             "stride": "{tensor}.stride.{axis}", "i32": "{value}.value", "i64": "{value}.value", "f32": "{value}.value"}
    return [spelt[s["kind"]].format(**s) for s in plan]


@pytest.mark.parametrize("variant", matrix(), ids=lambda v: v.name)
def test_each_kernels_argument_flattens_to_its_plan(variant):
    """For every built variant, the kernel's one argument (bound by field name from the
    host's inputs) flattens, in the order the DSL passes it, to exactly what the plan's
    slots are filled with at run time: each value lands where the kernel reads it."""
    cfg = CONFIGS[variant.kind].of(variant)
    inputs = _sentinel_inputs(INPUTS[variant.kind], cfg)
    for params in KERNELS[variant.kind](variant.varlen):
        plan = params.plan(cfg)
        leaves = list(P._leaves(params.bind(cfg, inputs, _sentinel_tma(params))))
        assert leaves == _slot_sources(plan), params.name
        assert all(s["offset"] % s["align"] == 0 for s in plan)


def test_a_declaration_with_two_same_sized_fields_swapped_still_agrees_with_its_kernel():
    """Swap two same-sized parameters (both int32) of the varlen forward: the plan's slots
    swap and so does the kernel's argument, so the run time, filling slots by name, still
    puts each value where the kernel reads it. Nothing is written twice by position that
    could disagree."""
    cfg = FwdConfig.of(next(v for v in matrix() if v.kind == "fwd" and v.varlen))
    fields = list(interfaces.FWD.params)
    i, j = (next(k for k, p in enumerate(fields) if p.field == f) for f in ("use_seqused_q", "use_seqused_k"))
    fields[i], fields[j] = fields[j], fields[i]
    swapped = P.Params("FwdParams", *fields, inputs=interfaces.FWD_INPUTS)
    inputs = _sentinel_inputs(interfaces.FWD_INPUTS, cfg)
    before, after = interfaces.FWD.plan(cfg), swapped.plan(cfg)
    assert [s["value"] for s in after if s["name"].startswith("use_")] == ["use_seqused_k", "use_seqused_q"]
    assert [(s["offset"], s["size"]) for s in after] == [(s["offset"], s["size"]) for s in before]
    bound = swapped.bind(cfg, inputs, _sentinel_tma(swapped))
    assert list(P._leaves(bound)) == _slot_sources(after)
    assert bound.use_seqused_q == "use_seqused_q.value"  # the kernel reads it by name


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="undeclared inputs"):
        P.Params("K", P.ptr("nowhere"), inputs=interfaces.FWD_INPUTS)
    with pytest.raises(ValueError, match="twice"):
        P.Params("K", P.ptr("lse"), P.ptr("lse"))
    with pytest.raises(ValueError, match="twice"):
        P.Inputs("I", P.Input("a", "Int32"), P.Input("a", "Int32"))


def test_kernel_argument_reads_as_separate_arguments_to_the_dsls_namer():
    """The DSL names a kernel after str() of its arguments, and ptxas's code depends on
    the name: one argument must read as its leaves did as separate arguments."""
    args = interfaces.COMBINE.tuple_type(o_partial="ptr<f32, gmem>", lse_partial=None,
                                         out=P.Rows("ptr<bf16>", ("?", "?", "?")), lse="class X", batch="?",
                                         seqlen_q="?", heads_q="?", splits="?", columns_v="?")
    assert str(args) == "ptr<f32,gmem>_ptr<bf16>_?_?_?_X_?_?_?_?_?"


def _compile_probe(params_type, body):
    """PTX of a one-thread kernel taking ``params_type``'s argument (built with the DSL)."""
    cutlass = pytest.importorskip("cutlass", reason="the CuTe DSL is needed to compile a kernel")
    import os
    import tempfile

    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    class Probe:
        def __str__(self):
            return "probe"

        @cute.kernel
        def kernel(self, p: params_type.tuple_type):
            body(p)

        @cute.jit
        def __call__(self, x):
            self.kernel(params_type.bind(None, x)).launch(grid=[1, 1, 1], block=[32, 1, 1])

    out = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), stride_order=(0,), assumed_align=4)
    inputs = PROBE_INPUTS.tuple_type(out=out, a=cutlass.Int32(0), b=cutlass.Int32(0))
    with tempfile.TemporaryDirectory() as tmp:
        compiled = cute.compile(Probe(), inputs, options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp}")
        ptx = compiled.artifacts.PTX
        return open(ptx).read() if os.path.exists(ptx) else ptx


PROBE_INPUTS = P.Inputs("ProbeInputs", P.Input("out", "i32", 1), P.Input("a", "Int32"), P.Input("b", "Int32"))


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_the_compiled_kernel_reads_each_field_from_the_slot_its_plan_names(order):
    """Compiled for real: a kernel that writes a - b, declared with a, b in either order.
    In the PTX, the minuend is loaded from the parameter the plan's slot "a" sits at."""
    import cutlass.cute as cute  # noqa: F401  (skips without the DSL, in _compile_probe)

    params = P.Params("ProbeParams", P.ptr("out"), *(P.i32(n) for n in order), inputs=PROBE_INPUTS)

    def body(p):
        import cutlass.cute as cute

        cute.make_tensor(p.out, cute.make_layout(1))[0] = p.a - p.b

    ptx = _compile_probe(params, body)
    plan = params.plan(None)
    loads = dict(re.findall(r"ld\.param\.[bu]32\s+(%r\d+),\s*\[\S+_param_(\d+)\]", ptx))
    (minuend, subtrahend), = re.findall(r"sub\.s32\s+%r\d+,\s*(%r\d+),\s*(%r\d+)", ptx)
    assert plan[int(loads[minuend])]["value"] == "a" and plan[int(loads[subtrahend])]["value"] == "b"


def test_a_scalar_with_a_default_is_packed_without_the_runs_value(monkeypatch):
    """A new scalar declared with a neutral default reaches the kernel with no change of
    the run time: the slot carries the default, which pack_params takes where the call's
    values lack the name (and refuses a slot with neither)."""
    import struct

    from fa4_aot.errors import AbiMismatchError
    from fa4_aot.launch import loader

    inputs = P.Inputs("I", P.Input("lse", "f32", 1), P.Input("gain", "Float32", default=1.5), P.Input("n", "Int32"))
    plan = P.Params("K", P.ptr("lse"), P.f32("gain"), P.i32("n"), inputs=inputs).plan(None)
    assert [s.get("default") for s in plan] == [None, 1.5, None]
    launch = {"params": plan, "symbol": "k"}
    tensors = {"lse": {"ptr": 0x1000}}
    raw, _ = loader.pack_params({"name": "row"}, launch, {"n": 7}, tensors)
    assert struct.unpack_from("<Qfi", bytes(raw)) == (0x1000, 1.5, 7)
    raw, _ = loader.pack_params({"name": "row"}, launch, {"n": 7, "gain": 2.0}, tensors)
    assert struct.unpack_from("<f", bytes(raw), 8) == (2.0,)
    with pytest.raises(AbiMismatchError, match=r"\['n'\]"):
        loader.pack_params({"name": "row"}, launch, {}, tensors)
