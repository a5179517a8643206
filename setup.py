"""Packaging hooks: a wheel or sdist is made only from built kernels.

Without this check setuptools would happily package fa4_aot without its cubins, and the
result would install and import, then fail at the first launch. Editable installs
(`pip install -e .`) are exempt: they come before the first `python build_kernels.py`.
"""

import hashlib
import json
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.errors import SetupError

PACKAGE = Path(__file__).resolve().parent / "fa4_aot"
HOW = "Build them first with `python build_kernels.py` (needs the [build] extra, no GPU)."


def check_kernels() -> None:
    """Raise unless fa4_aot/manifest.json lists cubins that are all present and intact."""
    path = PACKAGE / "manifest.json"
    if not path.exists():
        raise SetupError(f"fa4_aot has no built kernels: {path} is missing. {HOW}")
    rows = json.loads(path.read_text()).get("kernels") or []
    if not rows:
        raise SetupError(f"{path} lists no kernels. {HOW}")
    bad = [r["file"] for r in rows
           if not (PACKAGE / r["file"]).is_file()
           or hashlib.sha256((PACKAGE / r["file"]).read_bytes()).hexdigest() != r["sha256"]]
    if bad:
        raise SetupError(f"{len(bad)} of {len(rows)} cubins in {path} are missing or differ from "
                         f"their sha256 (first: fa4_aot/{bad[0]}). {HOW}")


class BuildPyWithKernels(build_py):
    def run(self):
        if not getattr(self, "editable_mode", False):
            check_kernels()
            # build/lib outlives a build: cubins or modules removed since would be packaged
            shutil.rmtree(Path(self.build_lib) / "fa4_aot", ignore_errors=True)
        super().run()


class SdistWithKernels(sdist):
    def run(self):
        check_kernels()
        super().run()


setup(cmdclass={"build_py": BuildPyWithKernels, "sdist": SdistWithKernels})
