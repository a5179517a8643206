"""Random varlen backward mixes, as tests/gpu/test_varlen.py's random-mix test draws them,
each checked like the test but measured rather than asserted: every trial's worst ratio of
error to tolerance (out, dq, dk, dv of each sequence), the failures with their seeds, and
each failure replayed on the same inputs (a race gives other numbers on a replay; a
tolerance edge the same failure, up to the unordered dQ adds).

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_bwd_fuzz.py TRIALS [--variants a,b] [--det]
"""
import argparse
import random
import statistics

import torch

from tests.gpu import test_bwd as tb
from tests.gpu import test_varlen as t
from tests.reference import attention_ref

DEFAULT = "bwd.sm90a.bf16.d128.causal.varlen,bwd.sm90a.fp16.d192.varlen"


def ratios(grads, q, k, v, out, dout, lq, lk, causal) -> dict:
    """name -> worst err / tol over the sequences (the test's rules: tests/gpu/test_bwd.py
    check_grads), plus 'unwritten' for NaN or stray writes."""
    dq, dk, dv = grads
    worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0, "unwritten": 0.0}
    at_q = at_k = 0
    for sq, sk in zip(lq, lk):
        rq, rk = slice(at_q, at_q + sq), slice(at_k, at_k + sk)
        if sq and sk:
            args = [x[r][None] for x, r in ((q, rq), (k, rk), (v, rk))]
            ref, _ = attention_ref(*args, causal, None, upcast=True)
            low, _ = attention_ref(*args, causal, None, upcast=False)
            o = out[rq][None]
            worst["out"] = max(worst["out"], (o.float() - ref.float()).abs().max().item()
                               / (2 * (low.float() - ref.float()).abs().max().item() + 1e-5))
            refg, errors = tb.reference_errors(*args, dout[rq][None], o, causal)
            for name, g, r, (e_low, e_recipe) in zip(("dq", "dk", "dv"), (dq[rq], dk[rk], dv[rk]), refg, errors):
                if g.isnan().any():
                    worst["unwritten"] = float("inf")
                worst[name] = max(worst[name], (g[None].float() - r).abs().max().item() / (2 * max(e_low, e_recipe) + 1e-5))
        at_q, at_k = at_q + sq, at_k + sk
    return worst


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trials", type=int)
    p.add_argument("--variants", default=DEFAULT)
    p.add_argument("--det", action="store_true", help="deterministic variants (the names given take .det)")
    args = p.parse_args()
    names = [n + ".det" if args.det else n for n in args.variants.split(",")]
    fails, tops = [], []
    for trial in range(args.trials):
        seed = random.randrange(2**31)
        rng, gen = random.Random(seed), torch.Generator(device="cuda").manual_seed(seed)
        name = rng.choice(names)
        variant = next(v for v in t.VARLEN_BWD if v.name == name)
        batch = rng.randint(1, 6)
        lq = [rng.choice((0, 1, rng.randint(2, 400))) for _ in range(batch)]
        lk = [rng.choice((0, 1, rng.randint(2, 400))) for _ in range(batch)]
        if not sum(lq) or not sum(lk):
            continue
        q, k, v, dout, out, lse, cu_q, cu_k = t._problem(lq, lk, 4, 2, variant.head_dim, t.DTYPES[variant.dtype],
                                                         variant.causal, gen)
        run = lambda: t._backward(q, k, v, out, dout, lse, cu_q, cu_k, max(lq) or 1, max(lk) or 1,  # noqa: E731
                                  variant.causal, variant.deterministic)
        grads = run()
        torch.cuda.synchronize()
        worst = ratios(grads, q, k, v, out, dout, lq, lk, variant.causal)
        top = max(worst.values())
        tops.append(top)
        if top > 1:
            again = ratios(run(), q, k, v, out, dout, lq, lk, variant.causal)
            fails.append((seed, name, lq, lk, worst, again))
            print(f"FAIL seed={seed} {name} lq={lq} lk={lk}\n  first  {worst}\n  replay {again}", flush=True)
    tops.sort()
    print(f"{len(fails)} of {len(tops)} failed; worst ratio err/tol: median {statistics.median(tops):.3f}, "
          f"p99 {tops[int(0.99 * (len(tops) - 1))]:.3f}, max {tops[-1]:.3f}")


if __name__ == "__main__":
    main()
