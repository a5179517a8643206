"""Random varlen backward mixes until one fails (the failure printed with its mix):

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_bwd_fuzz.py TRIALS
"""
import random
import sys
import traceback

import torch

from tests.gpu import test_varlen as t

trials = int(sys.argv[1])
fails = 0
for trial in range(trials):
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator(device="cuda").manual_seed(seed)
    name = rng.choice(("bwd.sm90a.bf16.d128.causal.varlen", "bwd.sm90a.fp16.d192.varlen"))
    variant = next(v for v in t.VARLEN_BWD if v.name == name)
    batch = rng.randint(1, 6)
    lq = [rng.choice((0, 1, rng.randint(2, 400))) for _ in range(batch)]
    lk = [rng.choice((0, 1, rng.randint(2, 400))) for _ in range(batch)]
    if not sum(lq) or not sum(lk):
        continue
    q, k, v, dout, out, lse, cu_q, cu_k = t._problem(lq, lk, 4, 2, variant.head_dim, t.DTYPES[variant.dtype],
                                                     variant.causal, gen)
    grads = t._backward(q, k, v, out, dout, lse, cu_q, cu_k, max(lq) or 1, max(lk) or 1, variant.causal)
    torch.cuda.synchronize()
    try:
        t._check_grads_by_sequence(grads, q, k, v, out, dout, lq, lk, lq, lk, variant.causal)
    except AssertionError as e:
        fails += 1
        print(f"FAIL {name} lq={lq} lk={lk}: {str(e)[:300]}")
print(f"{fails} of {trials} failed")
