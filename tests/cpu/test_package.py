"""Import promises, the variant matrix, the parameter-plan parser and the CLI."""

import itertools
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fa4_aot import abi
from fa4_aot.cli import main
from fa4_aot.variants import AXES, MATRIX, NOT_BUILT_REASONS, Variant, built_values, matches, select

from ..conftest import SUBSET


def test_import_pulls_in_neither_torch_nor_the_dsl():
    code = ("import sys, fa4_aot, fa4_aot.loader, fa4_aot.cli; "
            "print(sorted(m for m in ('torch', 'cutlass', 'jax', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_matrix_is_the_product_of_the_built_axes():
    assert len(MATRIX) == len(set(MATRIX)) == len({v.name for v in MATRIX})
    for axis, spec in AXES.items():
        assert {getattr(v, axis) for v in MATRIX} == set(spec["built"]), axis
    axes = ("arch", "dtype", "head_dim", "causal", "deterministic", "q_tiles")
    for kind in AXES["kind"]["built"]:
        mine = [v for v in MATRIX if v.kind == kind]
        for axis in axes:
            assert {getattr(v, axis) for v in mine} == set(built_values(kind, axis)), (kind, axis)
        product = [Variant(kind=kind, **dict(zip(axes, values)))
                   for values in itertools.product(*(built_values(kind, a) for a in axes))]
        # every combination of built values, less the ones a NOT_BUILT_REASONS entry names
        expected = [v for v in product if not any(matches(v, key) for key in NOT_BUILT_REASONS)]
        assert sorted(mine) == sorted(expected)


def test_names_round_trip_and_read_well():
    v = Variant("fwd", "sm90a", "bf16", 128, True)
    assert v.name == "fwd.sm90a.bf16.d128.causal" and Variant.from_name(v.name) == v
    assert Variant.from_dict(v.to_dict()) == v
    assert v.gpu_arch == "sm_90a" and v.compute_capability == (9, 0)
    assert [x.name for x in select(("fwd.*.fp16.d64",))] == ["fwd.sm90a.fp16.d64"]
    assert [x.name for x in select(("fwd.*.fp16.d64*",))] == [
        "fwd.sm90a.fp16.d64", "fwd.sm90a.fp16.d64.q2", "fwd.sm90a.fp16.d64.causal", "fwd.sm90a.fp16.d64.causal.q2"]
    assert Variant.from_name("fwd.sm90a.bf16.d128.causal.q2").q_tiles == 2
    with pytest.raises(ValueError, match="head_dim=80"):
        Variant("fwd", "sm90a", "bf16", 80, False)


PTX = """
.visible .entry kern(
\t.param .align 64 .b8 kern_param_0[128],
\t.param .align 4 .b8 kern_param_1[12],
\t.param .u64 .ptr .global .align 16 kern_param_2,
\t.param .f32 kern_param_3
)
"""


def test_ptx_parameter_parser_and_layout():
    assert abi.ptx_entries(PTX) == {"kern": [(128, 64), (12, 4), (8, 8), (4, 4)]}
    slots = abi.with_offsets([abi._slot("a", "tensormap", tensor="q"), abi._slot("b", "i32", fields=["x", "y", "z"]),
                              abi._slot("c", "ptr", tensor="lse"), abi._slot("d", "f32", value="s")])
    assert [s["offset"] for s in slots] == [0, 128, 144, 152]
    abi.check_against_ptx(slots, PTX, "kern")
    with pytest.raises(ValueError, match="flattening changed"):
        abi.check_against_ptx(slots[:3], PTX, "kern")


def test_fwd_plan_offsets_are_aligned():
    plan = abi.fwd_plan()
    assert all(s["offset"] % s["align"] == 0 for s in plan)
    assert [s["name"] for s in plan][:2] == ["tma_q", "q_coords"]


def test_cli_list_info_verify(built):
    folder = str(built[0])
    runner = CliRunner()
    out = runner.invoke(main, ["--kernels", folder, "list", "--all"])
    assert out.exit_code == 0, out.output
    assert "fwd.sm90a.bf16.d64 " in out.output and "not in this build" in out.output
    n = len(SUBSET)
    assert f"{n} of {n} built variants" in out.output and "not built: arch=sm100a" in out.output
    out = runner.invoke(main, ["--kernels", folder, "info"])
    assert out.exit_code == 0 and "driver floor: CUDA 13.0" in out.output
    out = runner.invoke(main, ["--kernels", folder, "verify"])
    assert f"checksums: {n} ok, 0 bad" in out.output


def test_cli_without_kernels_explains(tmp_path):
    out = CliRunner().invoke(main, ["--kernels", str(tmp_path), "list"])
    assert out.exit_code != 0 and "build_kernels.py" in out.output
