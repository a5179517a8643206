"""Runs tests/gpu/test_varlen.py's heaviest-first bits test (the backward's) over and over
on fresh seeds, for the bf16 varlen backward variants whose names contain a pattern, and
prints each failure with its seed and which check failed (bits across orders, or the
reference check), so that a rare failure can be told apart and replayed.

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_bwd_order_fuzz.py SECONDS_EACH PATTERN [PATTERN ...]
    PYTHONPATH=$PWD python benchmarks/experiments/varlen_bwd_order_fuzz.py replay NAME SEED
"""
import random
import sys
import time
import traceback

import torch

from tests.gpu import test_varlen as t

TEST = t.test_varlen_backward_lpt_order_gives_the_plain_orders_bits
VARIANTS = [v for v in t.VARLEN_BWD if v.dtype == "bf16"]


def run(variant, seed):
    """None, or the failed assertion's message and its line in the test file."""
    try:
        TEST(variant, torch.Generator(device="cuda").manual_seed(seed))
        return None
    except AssertionError as e:
        where = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.endswith(".py")][-1]
        return f"{where.name}:{where.lineno}: {str(e)[:600]}"


if sys.argv[1] == "replay":
    variant = next(v for v in VARIANTS if v.name == sys.argv[2])
    for _ in range(5):
        print(run(variant, int(sys.argv[3])))
    sys.exit()

seconds, patterns = float(sys.argv[1]), sys.argv[2:]
rng = random.Random()
for variant in (v for v in VARIANTS if any(p in v.name for p in patterns)):
    trials, failures, end = 0, [], time.time() + seconds
    while time.time() < end:
        seed = rng.randrange(2**31)
        result = run(variant, seed)
        trials += 1
        if result:
            failures.append(seed)
            print(f"FAIL {variant.name} seed {seed}: {result}", flush=True)
    print(f"{variant.name}: {len(failures)} of {trials} failed {failures}", flush=True)
