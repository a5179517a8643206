"""The varlen backward's tolerance edge (varlen_bwd_fuzz.py's failures), seed by seed: for
each sequence, dk's error against the float32 reference beside PyTorch's two low-precision
errors (fp16/bf16 autograd; the flash recipe with float32 FMA GEMMs) and the recipe with
tensor-core GEMMs (tests/reference.attention_bwd_tensor_cores: 16-bit operands, float32
outputs, a tensor-core backward's accumulation), and |dk| of the reference.

    PYTHONPATH=$PWD python benchmarks/experiments/varlen_bwd_tolerance.py SEED [SEED ...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varlen_bwd_fuzz import DEFAULT, draw  # noqa: E402

from tests.gpu import test_bwd as tb  # noqa: E402
from tests.gpu import test_varlen as t  # noqa: E402
from tests.reference import attention_bwd_tensor_cores  # noqa: E402

for seed in map(int, sys.argv[1:]):
    name, variant, lq, lk, gen = draw(seed, DEFAULT.split(","))  # the fuzz's default variants
    q, k, v, dout, out, lse, cu_q, cu_k = t._problem(lq, lk, 4, 2, variant.head_dim, t.DTYPES[variant.dtype],
                                                     variant.causal, gen)
    grads = t._backward(q, k, v, out, dout, lse, cu_q, cu_k, max(lq) or 1, max(lk) or 1, variant.causal)
    torch.cuda.synchronize()
    print(f"seed {seed} {name} lq={lq} lk={lk}")
    at_q = at_k = 0
    for sq, sk in zip(lq, lk):
        rq, rk = slice(at_q, at_q + sq), slice(at_k, at_k + sk)
        if sq and sk:
            args = [x[r][None] for x, r in ((q, rq), (k, rk), (v, rk))]
            o, do = out[rq][None], dout[rq][None]
            ref, errors = tb.reference_errors(*args, do, o, variant.causal)
            tc = attention_bwd_tensor_cores(*args, do, o, variant.causal)
            for i, (g, r) in enumerate(zip((grads[0][rq], grads[1][rk], grads[2][rk]), ref)):
                err = (g[None].float() - r).abs().max().item()
                e_tc = (tc[i].to(q.dtype).float() - r).abs().max().item()
                e_low, e_recipe = errors[i]
                tol = 2 * max(e_low, e_recipe) + 1e-5
                print(f"  seq q{sq} k{sk} {'dq dk dv'.split()[i]}: err {err:.3e} tol {tol:.3e} ({err / tol:.2f}) | "
                      f"e_low {e_low:.3e} e_recipe {e_recipe:.3e} e_recipe_tc {e_tc:.3e} "
                      f"(err / 2 max {err / (2 * max(e_low, e_recipe, e_tc) + 1e-5):.2f}) | max|ref| {r.abs().max().item():.3e}")
        at_q, at_k = at_q + sq, at_k + sk
