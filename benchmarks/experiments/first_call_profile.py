"""Where a fresh process's first fa4_aot.forward spends its time: ``-X importtime`` of
``import fa4_aot`` (cuda-python imported before) and a cProfile of the first forward, in a
cuda-python process like launch_overhead.py's (bytecode cached by one run before).

    PYTHONPATH=$PWD python benchmarks/experiments/first_call_profile.py [--top 25]
"""
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch_overhead import FIRST_RAW  # noqa: E402

PROFILED = FIRST_RAW.replace(
    "fa4_aot.forward(q, k, v, out, lse, stream=0)\ncu.cuCtxSynchronize()",
    "import cProfile, pstats\nprofile = cProfile.Profile()\nprofile.enable()\n"
    "fa4_aot.forward(q, k, v, out, lse, stream=0)\ncu.cuCtxSynchronize()\nprofile.disable()\n"
    "pstats.Stats(profile).sort_stats('cumulative').print_stats(TOP)\n"
    "pstats.Stats(profile).sort_stats('tottime').print_stats(TOP)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    assert "cProfile" in PROFILED
    env = {k: x for k, x in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(root), env.get("PYTHONPATH")) if x)
    with tempfile.TemporaryDirectory() as cache:
        env["PYTHONPYCACHEPREFIX"] = cache
        for _ in range(2):  # the first run writes the bytecode cache
            imports = subprocess.run([sys.executable, "-X", "importtime", "-c", FIRST_RAW], env=env, cwd=root,
                                     capture_output=True, text=True)
        lines = imports.stderr.splitlines()
        start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("| cuda.bindings.driver"))
        rows = []
        for line in lines[start + 1:]:
            if line.startswith("import time:") and "|" in line:
                self_us, cum_us, name = line[len("import time:"):].split("|")
                rows.append((int(self_us), int(cum_us), name.rstrip()))
        print(f"-X importtime after cuda.bindings.driver (us, top {args.top} by self time; "
              f"fa4_aot cumulative {next(c for _, c, n in rows if n.strip() == 'fa4_aot')})")
        for self_us, cum_us, name in sorted(rows, reverse=True)[:args.top]:
            print(f"{self_us:8d} {cum_us:8d} {name}")
        out = subprocess.run([sys.executable, "-c", PROFILED.replace("TOP", str(args.top))], env=env, cwd=root,
                             capture_output=True, text=True)
        print(out.stdout[-20000:], out.stderr[-3000:])


if __name__ == "__main__":
    main()
