#!/usr/bin/env python3
"""Fail CI when tests stop running silently: the CPU tests' skips and the skip reasons of
a run (its JUnit XML) must be those .ci/expected-skips.json names. A test that starts
skipping on the CPU, or a new reason to skip, fails here until the file says it is meant.

    python .ci/check_skips.py build/ci-tests.xml .ci/expected-skips.json
"""

import collections
import json
import sys
import xml.etree.ElementTree as ET


def skips(junit: str) -> collections.Counter:
    """(tests' folder, skip reason) -> how many, from a pytest JUnit XML report."""
    found = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            found[(case.get("classname", "").split(".")[1], skipped.get("message", ""))] += 1
    return found


def main(junit: str, expected_path: str) -> int:
    expected = json.load(open(expected_path))
    found = skips(junit)
    cpu = sum(n for (folder, _), n in found.items() if folder == "cpu")
    reasons = sorted({reason for _, reason in found})
    problems = []
    if cpu != expected["cpu_skipped"]:
        problems.append(f"{cpu} CPU tests skipped, expected {expected['cpu_skipped']}: "
                        f"{sorted((r, n) for (f, r), n in found.items() if f == 'cpu')}")
    if reasons != sorted(expected["reasons"]):
        problems.append(f"skip reasons {reasons}, expected {sorted(expected['reasons'])}")
    for problem in problems:
        print("check_skips:", problem)
    if not problems:
        print(f"check_skips: {cpu} CPU tests skipped, {sum(found.values())} in all, reasons as expected")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
