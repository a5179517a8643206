#!/usr/bin/env python3
"""Put a built library folder's rows into the package, on a device machine, so that the
tests run on them (the package's cubins and manifest are build outputs: nothing tracked
changes).

    python benchmarks/experiments/swap_in.py DIR [--package fa4_aot]

Copies each cubin of DIR/manifest.json's rows into the package's cubins folder and puts
the row in the package's manifest in place of the row of the same name (or beside the
others where it has none); the manifest is written with its index
(``fa4_aot.launch.manifest.rewrite``, as the build writes it). ``whole_library``: the same
into a temporary copy of the package (removed at exit), for A/B scripts given a trimmed
folder.
"""

import argparse
import atexit
import json
import shutil
import tempfile
from pathlib import Path

from fa4_aot.launch.manifest import rewrite


def swap_in(folder: Path, package: Path) -> list:
    """``folder``'s rows (cubins and manifest rows) into ``package``; returns the rows."""
    rows = _rows(folder)
    for row in rows:
        shutil.copyfile(folder / row["file"], package / row["file"])
    # each row in place of its namesake's, or after the others
    rewrite(package / "manifest.json", lambda kernels: list({r["name"]: r for r in kernels + rows}.values()))
    return rows


def whole_library(folder: Path, package: Path = Path("fa4_aot")) -> Path:
    """A folder that serves every call the package serves: ``folder`` where it has a row of
    every name the package has, else (a folder trimmed to an A/B's rows, e.g. backward
    only) a temporary copy of the package with ``folder``'s rows swapped in."""
    if {r["name"] for r in _rows(package)} <= {r["name"] for r in _rows(folder)}:
        return folder
    whole = Path(tempfile.mkdtemp(prefix=f"{folder.name}-whole-"))
    atexit.register(shutil.rmtree, whole, ignore_errors=True)  # the library loads lazily: gone at exit, not before
    shutil.copytree(package / "cubins", whole / "cubins")
    shutil.copyfile(package / "manifest.json", whole / "manifest.json")
    swap_in(folder, whole)
    return whole


def _rows(folder: Path) -> list:
    return json.loads((folder / "manifest.json").read_text())["kernels"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--package", type=Path, default=Path("fa4_aot"))
    args = ap.parse_args()
    rows = swap_in(args.folder, args.package)
    print(f"{args.package}: {len(rows)} rows from {args.folder}: " + ", ".join(r["name"] for r in rows))


if __name__ == "__main__":
    main()
