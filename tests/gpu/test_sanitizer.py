"""The kernels under compute-sanitizer: no out-of-bounds or misaligned access (memcheck)
and no invalid use of barriers (synccheck), on the shapes of sanitizer_cases.py.

racecheck and initcheck are not run here: on these kernels they report hazards the tools
do not model rather than defects (docs/design.md, "Tolerances in the tests"; the runs in
docs/history/perf-log-2026-11-30_to_2026-12-01.md: every read of the statistics that bulk
copies put in shared memory, and every read of O written by the forward's TMA store, are
flagged; the counts are those of all such accesses)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SANITIZER = shutil.which("compute-sanitizer")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer is not on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "synccheck"])
def test_kernels_are_clean_under_compute_sanitizer(tool, kernel_library):
    cmd = [SANITIZER, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "3", "--print-limit", "20",
           sys.executable, "-m", "tests.gpu.sanitizer_cases", *([str(kernel_library)] if kernel_library else [])]
    # torch's caching allocator off: each array its own allocation, bounded for memcheck
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = run.stdout + run.stderr
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in report, report[-4000:]
