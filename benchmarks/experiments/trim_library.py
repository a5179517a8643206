#!/usr/bin/env python3
"""Cut a built library folder (``build_kernels.py --out DIR``) down to the cubins an A/B
needs, so that several fit one device call's carry beside the package.

    python benchmarks/experiments/trim_library.py DIR [--keep GLOB ...] [--base fa4_aot]

Deletes from DIR/cubins every cubin no ``--keep`` glob names or, with no ``--keep``,
every one byte-identical to the one of the same name in ``--base`` (the package's); then
rewrites DIR/manifest.json with only the rows whose cubins are left, with its index
(``fa4_aot.launch.manifest.rewrite``, as the build writes it). A library of that folder
(``fa4_aot.KernelLibrary(DIR)``) serves the calls those rows serve and refuses the others.
"""

import argparse
import filecmp
import fnmatch
from pathlib import Path

from fa4_aot.launch.manifest import rewrite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--keep", action="append", default=[], help="a variant-name glob to keep (repeatable)")
    ap.add_argument("--base", type=Path, default=Path("fa4_aot"))
    args = ap.parse_args()
    cubins = args.folder / "cubins"
    for path in sorted(cubins.glob("*.cubin")):
        name = path.name[:-len(".cubin")]
        base = args.base / "cubins" / path.name
        if args.keep:
            gone = not any(fnmatch.fnmatchcase(name, g) for g in args.keep)
        else:
            gone = base.exists() and filecmp.cmp(path, base, shallow=False)
        if gone:
            path.unlink()
    rows = rewrite(args.folder / "manifest.json", lambda rows: [r for r in rows if (args.folder / r["file"]).exists()])
    print(f"{args.folder}: {len(rows)} rows: " + ", ".join(r["name"] for r in rows))


if __name__ == "__main__":
    main()
