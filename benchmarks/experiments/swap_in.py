#!/usr/bin/env python3
"""Put a built library folder's rows into the package, on a device machine, so that the
tests run on them (the package's cubins and manifest are build outputs: nothing tracked
changes).

    python benchmarks/experiments/swap_in.py DIR [--package fa4_aot]

Copies each cubin of DIR/manifest.json's rows into the package's cubins folder and puts
the row in the package's manifest in place of the row of the same name (or beside the
others where it has none); the manifest is written with its index
(``fa4_aot.launch.manifest.rewrite``, as the build writes it).
"""

import argparse
import json
import shutil
from pathlib import Path

from fa4_aot.launch.manifest import rewrite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--package", type=Path, default=Path("fa4_aot"))
    args = ap.parse_args()
    rows = json.loads((args.folder / "manifest.json").read_text())["kernels"]
    for row in rows:
        shutil.copyfile(args.folder / row["file"], args.package / row["file"])

    # each row in place of its namesake's, or after the others
    rewrite(args.package / "manifest.json", lambda kernels: list({r["name"]: r for r in kernels + rows}.values()))
    print(f"{args.package}: {len(rows)} rows from {args.folder}: " + ", ".join(r["name"] for r in rows))


if __name__ == "__main__":
    main()
