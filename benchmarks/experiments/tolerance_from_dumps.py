"""The backward tolerance rules on cases saved by dump_bwd_case.py, on the CPU (the tests'
own reference and errors: tests/gpu/test_bwd.py reference_errors): per case and gradient,
err / tol under the rule of tests before session 21 ("low": twice PyTorch's autograd
error) and the tests' rule (check_grads).
    tolerance_from_dumps.py CASES.pt [CASES.pt ...]"""
import sys

import torch

sys.path.insert(0, ".")
from tests.gpu import test_bwd as T  # noqa: E402

worst = 0.0
for path in sys.argv[1:]:
    for key, cases in torch.load(path).items():
        causal = ".causal" in key
        for seed, c in cases.items():
            q, k, v, dout, out = (c[n] for n in ("q", "k", "v", "dout", "out"))
            ref, errors = T.reference_errors(q, k, v, dout, out, causal)
            cells = []
            for name, r, (e_low, e_recipe) in zip(("dq", "dk", "dv"), ref, errors):
                err = (c[name].float() - r).abs().max().item()
                test = err / (2 * max(e_low, e_recipe) + 1e-5)
                worst = max(worst, test)
                cells.append(f"{name} low {err / (2 * e_low + 1e-5):.2f} test {test:.2f}")
            print(key, seed, " | ".join(cells))
print(f"worst err/tol under the tests' rule: {worst:.3f}")
