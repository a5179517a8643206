"""Which gradients of the varlen backward differ between two runs of one order and
between the plain and heaviest-first orders, and by how much (tests/gpu/test_varlen.py's
lpt-order test asserts dK, dV bitwise equal across orders in every variant).

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_bwd_order_bits.py NAME [NAME ...]
"""
import random
import sys

import torch

from tests.gpu import test_varlen as t

for name in sys.argv[1:]:
    variant = next(v for v in t.VARLEN_BWD if v.name == name)
    rng, gen = random.Random(1), torch.Generator(device="cuda").manual_seed(1)
    mixes = [([256] * 9 + [3000], [256] * 9 + [3100], 4, 4), ([256] * 9 + [3000], [256] * 9 + [3100], 4, 2),
             ([700, 5, 1, 300], [650, 9, 1, 280], 4, 4)]
    for lq, lk, hq, hkv in mixes:
        q, k, v, dout, out, lse, cu_q, cu_k = t._problem(lq, lk, hq, hkv, variant.head_dim, torch.bfloat16,
                                                         variant.causal, gen)
        run = lambda order: t._backward(q, k, v, out, dout, lse, cu_q, cu_k, max(lq), max(lk),  # noqa: E731
                                        variant.causal, variant.deterministic, order=order)
        p1, p2, l1, l2 = run("plain"), run("plain"), run("lpt"), run("lpt")
        torch.cuda.synchronize()
        diff = lambda a, b: [(torch.equal(x, y), (x.float() - y.float()).abs().max().item()) for x, y in zip(a, b)]  # noqa: E731
        print(f"{name} lq={lq[:3]}.. h{hq}x{hkv}: plain/plain {diff(p1, p2)} | lpt/lpt {diff(l1, l2)} | "
              f"plain/lpt {diff(p1, l1)}")
