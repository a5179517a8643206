#!/usr/bin/env python3
"""Compare two built kernel folders cubin by cubin (sha256), for a restructure that must
leave the generated code alone.

    python scripts/compare_builds.py OLD_DIR NEW_DIR     # folders holding manifest.json

Prints one line per variant of NEW that differs (or is not in OLD), then ``N of M
identical``;
exits 1 if any differs. Manifest fields besides the files (launch contracts) are
compared too, except build keys and timestamps.
"""

import json
import sys
from pathlib import Path

IGNORED = {"build_key"}


def rows(folder: Path) -> dict:
    return {r["name"]: r for r in json.loads((folder / "manifest.json").read_text())["kernels"]}


def main(old: Path, new: Path) -> int:
    a, b = rows(old), rows(new)
    same, report = 0, []
    for name in sorted(b):  # a partial new build is compared where it was built
        if name not in a:
            report.append(f"{name}: not in {old}")
            continue
        ra, rb = a[name], b[name]
        if ra["sha256"] != rb["sha256"]:
            report.append(f"{name}: cubin differs ({ra['size']} -> {rb['size']} bytes)")
            continue
        fields = sorted(k for k in set(ra) & set(rb) if k not in IGNORED and ra[k] != rb[k])
        if fields:
            report.append(f"{name}: cubin identical; manifest fields differ: {', '.join(fields)}")
        same += 1
    print("\n".join(report))
    print(f"{same} of {len(b)} identical" + (f" ({len(a)} in {old})" if len(a) != len(b) else ""))
    return 0 if same == len(b) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
