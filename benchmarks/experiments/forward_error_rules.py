"""The forward's errors against references, per row and in LSE, to set the tests' rules
(tests/gpu/test_fwd.py) and show what they catch.

For every dense forward variant over the tests' shapes and a few seeds, against the
float64 reference of the same 16-bit inputs:
- out, per query row: the kernel's largest error and the low-precision twin's (PyTorch
  in the inputs' dtype); the largest ratio of the two over rows;
- lse: the kernel's largest error, and PyTorch's float32 LSE's (the kernel's own math is
  float32: scores accumulated in float32 from 16-bit products);
- planted bugs: lse + 1e-3, and the last query tile's rows x 1.01: their errors beside.
On the H200 from the repository root:  PYTHONPATH=. python benchmarks/experiments/forward_error_rules.py OUT.json
"""

import json
import math
import sys

import torch

from fa4_aot.torch import flash_attn_fwd
from fa4_aot.variants import MATRIX
from tests.gpu.test_fwd import DTYPES, SHAPES, _inputs, _poisoned
from tests.reference import attention_ref


def ref64(q, k, v, causal):
    out, lse = attention_ref(q.double(), k.double(), v.double(), causal, 1.0 / math.sqrt(q.shape[-1]), upcast=False)
    return out, lse


def rows(x):
    """(b, s, h, d) -> per (b, s, h) row maxima of |x| over d."""
    return x.abs().amax(-1)


def main(path):
    results = []
    for variant in [v for v in MATRIX if v.kind == "fwd" and not v.varlen]:
        dtype = DTYPES[variant.dtype]
        for shape in SHAPES:
            for seed in range(3):
                gen = torch.Generator(device="cuda").manual_seed(seed)
                q, k, v = _inputs(shape, variant.head_dim, dtype, gen)
                out, lse = _poisoned(q)
                flash_attn_fwd(q, k, v, causal=variant.causal, out=out, lse=lse, q_tiles=variant.q_tiles)
                torch.cuda.synchronize()
                o64, l64 = ref64(q, k, v, variant.causal)
                low, _ = attention_ref(q, k, v, variant.causal, upcast=False)
                _, l32 = attention_ref(q, k, v, variant.causal, upcast=True)
                err = rows(out.double() - o64)
                err_low = rows(low.double() - o64)
                rms = (out.double() - o64).square().mean(-1).sqrt()
                rms_low = (low.double() - o64).square().mean(-1).sqrt()
                seen = err_low > 0
                finite = torch.isfinite(l64)
                lse_err = (lse.double() - l64)[finite].abs().max().item() if finite.any() else 0.0
                lse32_err = (l32.double() - l64)[finite].abs().max().item() if finite.any() else 0.0
                tile = 192 if variant.head_dim == 64 else 128  # FwdConfig.tile_m
                last = ((shape[1] - 1) // tile) * tile  # the last query tile's first row
                planted = out.double().clone()
                planted[:, last:] *= 1.01
                err_planted = rows(planted - o64)
                results.append({
                    "variant": variant.name, "shape": shape, "seed": seed,
                    "row_ratio_max": (err[seen] / err_low[seen]).max().item() if seen.any() else 0.0,
                    "rms_ratio_max": (rms[seen] / rms_low[seen]).max().item() if seen.any() else 0.0,
                    "planted_rms_caught": bool(((planted - o64).square().mean(-1).sqrt()
                                                > 2 * rms_low + 1e-6).any()),
                    "rows_over_2x": int((err > 2 * err_low + 1e-6).sum().item()),
                    "zero_low_rows_err_max": err[~seen].max().item() if (~seen).any() else 0.0,
                    "planted_rows_over_2x": int((err_planted > 2 * err_low + 1e-6).sum().item()),
                    "whole_err": err.max().item(), "whole_low": err_low.max().item(),
                    "planted_whole_over": err_planted.max().item() > 2 * err_low.max().item(),
                    "lse_err": lse_err, "lse32_err": lse32_err,
                    # the tests' rule (tests/reference.check_attention): err / tolerance, per element
                    "lse_rule_ratio_max": ((lse.double() - l64)[finite].abs() / (
                        2 * lse32_err + 8 * 2.0**-23 * (l64[finite].abs() + 1))).max().item() if finite.any() else 0.0,
                    "lse_abs_max": l64[finite].abs().max().item() if finite.any() else 0.0,
                })
        print(variant.name, max(r["row_ratio_max"] for r in results if r["variant"] == variant.name),
              max(r["lse_err"] for r in results if r["variant"] == variant.name), flush=True)
    json.dump(results, open(path, "w"), indent=0)


if __name__ == "__main__":
    main(sys.argv[1])
