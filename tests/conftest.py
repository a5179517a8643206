import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A small subset of the matrix, built once per session into a temporary folder: one
# variant per dtype, the smallest and largest head dims, causal and not.
SUBSET = ("fwd.sm90a.bf16.d64", "fwd.sm90a.bf16.d128", "fwd.sm90a.bf16.d256.causal", "fwd.sm90a.fp16.d96.causal", "fwd.sm90a.bf16.d128.causal.q2",
          "bwd.sm90a.bf16.d128.causal.det", "bwd.sm90a.fp16.d256", "bwd.sm90a.bf16.d64.causal",
          "bwd.sm90a.bf16.d64.causal.q2", "bwd.sm90a.fp16.d64", "fwd.sm90a.bf16.d128.causal.varlen",
          "bwd.sm90a.bf16.d128.causal.varlen.det", "decode.sm90a.bf16.d128", "combine.sm90a.bf16.d128",
          "decode.sm90a.bf16.d128.kv_e4m3", "fwd.sm90a.bf16.d192v128.causal.varlen",
          "bwd.sm90a.bf16.d192v128.causal",
          "fwd.sm90a.bf16.d64.local.softcap", "fwd.sm90a.bf16.d128.varlen.local", "bwd.sm90a.bf16.d64.local.softcap")


def pytest_addoption(parser):
    parser.addoption("--kernels", default=None,
                     help="GPU tests: the build folder whose cubins to test (a whole library, e.g. "
                          "build_kernels.py --out DIR --base fa4_aot); default: the package's")


def build_subset(out, *more: str) -> list[str]:
    """The command line of build_kernels.py over SUBSET into folder ``out``, ``more`` after it."""
    args = [sys.executable, str(ROOT / "build_kernels.py"), "--out", str(out)]
    for name in SUBSET:
        args += ["--only", name]
    return args + list(more)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """(folder, completed process) of build_kernels.py over SUBSET."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is needed to build kernels")
    out = tmp_path_factory.mktemp("kernels")
    proc = subprocess.run(build_subset(out, "--jobs", "2"), capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc
