"""The innermost loop around the exponentials of each cubin's main kernel: its length and opcode histogram."""
import collections, os, re, subprocess, sys
from pathlib import Path
ND = os.environ.get("NVDISASM") or str(next(Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu13/bin/nvdisasm")))
res = {}
for path in sys.argv[1:]:
    txt = subprocess.run([ND, "-c", path], capture_output=True, text=True).stdout
    for fn in re.split(r"\n\s*\.text\.", txt):
        if 'FlashBwd' not in fn.split(":")[0]: continue
        lines = [l for l in fn.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", l)]
        ins = [l.split("*/", 1)[1].strip().rstrip(" ;") for l in lines]
        ex = [i for i, l in enumerate(ins) if 'MUFU.EX2' in l]
        best = None
        # use labels: nvdisasm prints labels as lines ".L_x_N:"
        labels = {}
        allines = fn.splitlines(); idx = -1
        for l in allines:
            if re.match(r"\s*/\*[0-9a-f]{4,}\*/", l): idx += 1
            mm = re.match(r"\s*\.L_x_(\d+):", l)
            if mm: labels[mm.group(1)] = idx + 1
        for i, l in enumerate(ins):
            t = re.search(r"BRA.*\.L_x_(\d+)", l)
            if t and t.group(1) in labels:
                tgt = labels[t.group(1)]
                if tgt <= ex[0] and i >= ex[-1] and (best is None or i - tgt < best[1] - best[0]):
                    best = (tgt, i)
        lo, hi = best
        c = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", l).split()[0].split('.')[0] for l in ins[lo:hi + 1])
        res[path] = c
        print(path.split('/')[-3], path.split('/')[-1], "loop", lo, hi, "len", hi - lo + 1)
if len(res) == 2:
    a, b = res.values()
    print({k: (a[k], b[k]) for k in sorted(set(a) | set(b)) if a[k] != b[k]})
