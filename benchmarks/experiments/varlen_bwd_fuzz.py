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
from tests.reference import attention_bwd_from_out, attention_bwd_tensor_cores, attention_ref

DEFAULT = "bwd.sm90a.bf16.d128.causal.varlen,bwd.sm90a.fp16.d192.varlen"


def draw(seed: int, names) -> tuple:
    """(name, variant, lq, lk, generator) of trial ``seed`` over ``names``, drawn as the
    random-mix test draws (varlen_bwd_tolerance.py replays a seed by it)."""
    rng, gen = random.Random(seed), torch.Generator(device="cuda").manual_seed(seed)
    name = rng.choice(names)
    variant = next(v for v in t.VARLEN_BWD if v.name == name)
    batch = rng.randint(1, 6)
    lq = [rng.choice((0, 1, rng.randint(2, 400))) for _ in range(batch)]
    lk = [rng.choice((0, 1, rng.randint(2, 400))) for _ in range(batch)]
    return name, variant, lq, lk, gen


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
            do = dout[rq][None]
            refg = tb.reference_grads(*args, do, causal, True)
            low = tb.reference_grads(*args, do, causal, False)
            recipe = attention_bwd_from_out(*args, do, o, causal, operands=q.dtype)
            cores = attention_bwd_tensor_cores(*args, do, o, causal)
            for name, g, r, lo, re, tc in zip(("dq", "dk", "dv"), (dq[rq], dk[rk], dv[rk]), refg, low, recipe, cores):
                if g.isnan().any():
                    worst["unwritten"] = float("inf")
                e = lambda x: (x.to(q.dtype).float() - r).abs().max().item()  # noqa: E731
                err, before, now = e(g[None]), 2 * max(e(lo), e(re)) + 1e-5, 2 * max(e(lo), e(re), e(tc)) + 1e-5
                worst[name + "_fp32_recipe"] = max(worst.get(name + "_fp32_recipe", 0.0), err / before)
                worst[name] = max(worst[name], err / now)
                worst[name + "_loosening"] = max(worst.get(name + "_loosening", 0.0), now / before)
        at_q, at_k = at_q + sq, at_k + sk
    return worst


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trials", type=int)
    p.add_argument("--variants", default=DEFAULT)
    p.add_argument("--det", action="store_true", help="deterministic variants (the names given take .det)")
    args = p.parse_args()
    names = [n + ".det" if args.det else n for n in args.variants.split(",")]
    fails, tops, tops_tc, loosening = [], [], [], []  # tops_tc: the fp32-recipe rule
    for trial in range(args.trials):
        seed = random.randrange(2**31)
        name, variant, lq, lk, gen = draw(seed, names)
        if not sum(lq) or not sum(lk):
            continue
        q, k, v, dout, out, lse, cu_q, cu_k = t._problem(lq, lk, 4, 2, variant.head_dim, t.DTYPES[variant.dtype],
                                                         variant.causal, gen)
        run = lambda: t._backward(q, k, v, out, dout, lse, cu_q, cu_k, max(lq) or 1, max(lk) or 1,  # noqa: E731
                                  variant.causal, variant.deterministic)
        grads = run()
        torch.cuda.synchronize()
        worst = ratios(grads, q, k, v, out, dout, lq, lk, variant.causal)
        top = max(x for key, x in worst.items() if not key.endswith(("_fp32_recipe", "_loosening")))
        tops.append(top)
        tops_tc.append(max(x for key, x in worst.items() if key.endswith("_fp32_recipe") or key in ("out", "unwritten")))
        loosening.append(max((x for key, x in worst.items() if key.endswith("_loosening")), default=1.0))
        if top > 1:
            again = ratios(run(), q, k, v, out, dout, lq, lk, variant.causal)
            fails.append((seed, name, lq, lk, worst, again))
            print(f"FAIL seed={seed} {name} lq={lq} lk={lk}\n  first  {worst}\n  replay {again}", flush=True)
    for label, x in (("the test's rule (recipe on float32 GEMMs and tensor cores)", tops),
                     ("the recipe on float32 GEMMs alone", tops_tc)):
        x.sort()
        print(f"{label}: {sum(r > 1 for r in x)} of {len(x)} failed; worst ratio err/tol: median "
              f"{statistics.median(x):.3f}, p99 {x[int(0.99 * (len(x) - 1))]:.3f}, max {x[-1]:.3f}")
    loosening.sort()
    print(f"tolerance with / without the tensor-core recipe (worst gradient of a trial): median {statistics.median(loosening):.3f}, "
          f"p99 {loosening[int(0.99 * (len(loosening) - 1))]:.3f}, max {loosening[-1]:.3f}")


if __name__ == "__main__":
    main()
