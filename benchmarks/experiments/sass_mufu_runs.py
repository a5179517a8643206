"""MUFU.EX2 clumping in each cubin's main kernel: runs of consecutive MUFU (no other instr between)."""
import collections, os, re, subprocess, sys
from pathlib import Path
ND = os.environ.get("NVDISASM") or str(next(Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu13/bin/nvdisasm")))
for path in sys.argv[1:]:
    txt = subprocess.run([ND, "-c", path], capture_output=True, text=True).stdout
    # split functions
    funcs = re.split(r"\n\s*\.text\.", txt)
    for f in funcs:
        name = f.split(":")[0][:60]
        if "FlashBwd" not in name and "FlashFwd" not in name: continue
        ins = [l for l in f.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", l)]
        ops = []
        for l in ins:
            body = l.split("*/", 1)[1].strip()
            body = re.sub(r"^@!?U?P\w+\s+", "", body)
            ops.append(body.split()[0] if body else "")
        ex = [i for i, o in enumerate(ops) if o.startswith("MUFU.EX2")]
        runs = []; cur = 0
        for i, o in enumerate(ops):
            if o.startswith("MUFU"): cur += 1
            else:
                if cur: runs.append(cur)
                cur = 0
        hist = collections.Counter(runs)
        big = sum(r for r in runs if r >= 4)
        print(f"{path.split('/')[-1]:40s} n={len(ops)} ex2={len(ex)} mufu_in_runs>=4: {big} max_run={max(runs) if runs else 0} runs={sorted(hist.items())}")
