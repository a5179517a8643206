"""Import promises, the variant matrix, the parameter-plan parser, the CLI and the wheel."""

import itertools
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from click.testing import CliRunner

import fa4_aot
from fa4_aot.launch import driver
from fa4_aot.cli import main
from fa4_aot.errors import NoDeviceError
from fa4_aot.variants import AXES, MATRIX, NOT_BUILT_REASONS, Variant, built_values, matches, select

from ..conftest import ROOT, SUBSET


def test_import_pulls_in_neither_torch_nor_the_dsl():
    code = ("import sys, fa4_aot, fa4_aot.launch.loader, fa4_aot.cli; "
            "print(sorted(m for m in ('torch', 'cutlass', 'jax', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_matrix_is_the_product_of_the_built_axes():
    assert len(MATRIX) == len(set(MATRIX)) == len({v.name for v in MATRIX})
    for axis, spec in AXES.items():
        assert {getattr(v, axis) for v in MATRIX} == set(spec["built"]), axis
    axes = ("arch", "dtype", "head_dim", "causal", "varlen", "deterministic", "q_tiles", "local", "softcap",
            "kv_dtype", "head_dim_v", "span")
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
        "fwd.sm90a.fp16.d64", "fwd.sm90a.fp16.d64.local", "fwd.sm90a.fp16.d64.local.softcap", "fwd.sm90a.fp16.d64.q2",
        "fwd.sm90a.fp16.d64.q2.local", "fwd.sm90a.fp16.d64.q2.local.softcap", "fwd.sm90a.fp16.d64.varlen", "fwd.sm90a.fp16.d64.varlen.local", "fwd.sm90a.fp16.d64.varlen.local.softcap",
        "fwd.sm90a.fp16.d64.causal", "fwd.sm90a.fp16.d64.causal.q2", "fwd.sm90a.fp16.d64.causal.varlen"]
    assert Variant.from_name("fwd.sm90a.bf16.d128.causal.q2").q_tiles == 2
    with pytest.raises(ValueError, match="head_dim=80"):
        Variant("fwd", "sm90a", "bf16", 80, False)


def test_cli_list_info_verify(built):
    folder = str(built[0])
    runner = CliRunner()
    out = runner.invoke(main, ["--kernels", folder, "list", "--all"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0].split() == ["variant", "size", "KiB", "kernels", "smem", "KiB", "regs",
                                                  "local", "B"]
    assert "fwd.sm90a.bf16.d64 " in out.output and "not in this build" in out.output
    n = len(SUBSET)
    assert f"{n} of {n} built variants" in out.output and "not built: arch=sm100a" in out.output
    assert "any multiple of 8 up to 256" in out.output and "192/128" in out.output  # the head dims served
    out = runner.invoke(main, ["--kernels", folder, "info"])
    assert out.exit_code == 0 and "driver floor: CUDA 13.0" in out.output
    out = runner.invoke(main, ["--kernels", folder, "verify", "--checksums-only"])
    assert out.exit_code == 0 and out.output == f"checksums: {n} ok, 0 bad\n"


def _no_driver():
    raise NoDeviceError("no driver in this test")


@pytest.mark.parametrize("machine, exit_code", [
    (dict(init=_no_driver), 1),  # no driver (or no GPU): cuInit fails
    (dict(init=lambda: 13000, device_count=lambda: 0), 1),
    (dict(init=lambda: 12080, device_count=lambda: 1, compute_capability=lambda d: (9, 0)), 1),  # driver too old
    (dict(init=lambda: 13000, device_count=lambda: 1, compute_capability=lambda d: (8, 0)), 1),  # A100: wrong arch
    (dict(init=lambda: 13000, device_count=lambda: 2, compute_capability=lambda d: (8, 0) if d else (9, 0)), 0),
])
def test_cli_verify_fails_where_the_cubins_cannot_run(built, monkeypatch, machine, exit_code):
    monkeypatch.setattr(driver, "device_name", lambda d: "a GPU")
    for name, fn in machine.items():
        monkeypatch.setattr(driver, name, fn)
    out = CliRunner().invoke(main, ["--kernels", str(built[0]), "verify"])
    assert out.exit_code == exit_code, out.output
    assert f"checksums: {len(SUBSET)} ok, 0 bad" in out.output


def test_cli_verify_checksums_only_finds_a_changed_cubin(built, tmp_path):
    folder = tmp_path / "kernels"
    shutil.copytree(built[0], folder)
    cubin = sorted((folder / "cubins").glob("*.cubin"))[0]
    data = bytearray(cubin.read_bytes())
    data[-1] ^= 1
    cubin.write_bytes(bytes(data))
    out = CliRunner().invoke(main, ["--kernels", str(folder), "verify", "--checksums-only"])
    assert out.exit_code == 1 and f"checksums: {len(SUBSET) - 1} ok, 1 bad" in out.output


def test_cli_version_and_python_dash_m():
    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0 and out.output == f"fa4-aot, version {fa4_aot.__version__}\n"
    proc = subprocess.run([sys.executable, "-m", "fa4_aot", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout == out.output


def test_cli_without_kernels_explains(tmp_path):
    out = CliRunner().invoke(main, ["--kernels", str(tmp_path), "list"])
    assert out.exit_code != 0 and "build_kernels.py" in out.output


def test_build_log_has_a_line_per_variant(built):
    """Not on a terminal (here: a pipe), build_kernels.py writes a line per variant, not a bar."""
    lines = built[1].stdout.splitlines()
    n = len(SUBSET)
    assert lines[0] == f"compiling {n} of {n} variants"
    assert sorted(re.fullmatch(rf"\[\d+/{n}\] (\S+) \d+\.\d s", line).group(1) for line in lines[1:n + 1]) == sorted(SUBSET)


def test_variant_table_counts_the_build(built):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "variant_table.py"), "--kernels", str(built[0])],
                          capture_output=True, text=True, check=True)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| `")]
    assert sum(int(row.split("|")[2]) for row in rows) == len(SUBSET)
    assert "| `fwd.sm90a.{bf16}.d64` | 2 | plain, `.local.softcap` | 1 |" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"{len(SUBSET)} cubins, built with nvidia-cutlass-dsl 4.8.1, ptxas 13.4 (V13.4.59).")


def _source_tree(dest):
    """The files a wheel is built from, without any built kernels."""
    shutil.copytree(ROOT / "fa4_aot", dest / "fa4_aot",
                    ignore=shutil.ignore_patterns("__pycache__", "cubins", "manifest.json"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "NOTICE"):
        shutil.copy(ROOT / name, dest / name)
    return dest


def _pip_wheel(src, out):
    # setuptools of this environment (no build isolation): no package index needed
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True)


def test_wheel_needs_built_kernels(built, tmp_path):
    src = _source_tree(tmp_path / "src")
    proc = _pip_wheel(src, tmp_path / "dist")
    assert proc.returncode != 0 and "python build_kernels.py" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("dist/*.whl"))

    shutil.copytree(built[0] / "cubins", src / "fa4_aot" / "cubins")
    shutil.copy(built[0] / "manifest.json", src / "fa4_aot" / "manifest.json")
    proc = _pip_wheel(src, tmp_path / "dist")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("fa4_aot-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert sum(name.startswith("fa4_aot/cubins/") and name.endswith(".cubin") for name in names) == len(SUBSET)
    assert {"fa4_aot/manifest.json", "fa4_aot/src/sm90/bwd/kernel.py", "fa4_aot/__main__.py"} <= set(names)
    assert any(name.endswith("licenses/LICENSE") for name in names)


def test_ci_fails_when_a_test_starts_skipping(tmp_path):
    """.ci/check_skips.py: CI fails on a CPU test that skips, or a new reason to skip."""
    import subprocess

    def run(cases: str) -> int:
        (tmp_path / "t.xml").write_text(f'<testsuites><testsuite>{cases}</testsuite></testsuites>')
        return subprocess.run([sys.executable, str(ROOT / ".ci" / "check_skips.py"), str(tmp_path / "t.xml"),
                               str(ROOT / ".ci" / "expected-skips.json")], capture_output=True).returncode

    gpu = '<testcase classname="tests.gpu.test_fwd" name="a"><skipped message="GPU tests: no CUDA GPU"/></testcase>'
    sanitizer = ('<testcase classname="tests.gpu.test_sanitizer" name="s">'
                 '<skipped message="compute-sanitizer is not on PATH"/></testcase>')
    ran = '<testcase classname="tests.cpu.test_x" name="b"/>'
    assert run(gpu + sanitizer + ran) == 0
    assert run(gpu + sanitizer + '<testcase classname="tests.cpu.test_x" name="b">'
               '<skipped message="GPU tests: no CUDA GPU"/></testcase>') == 1  # a CPU test skipped
    assert run(gpu + sanitizer + '<testcase classname="tests.gpu.test_y" name="c">'
               '<skipped message="needs a tail split"/></testcase>') == 1  # a new reason
