"""The FP8 decode's accuracy checks, emulated off the GPU (docs/design.md, "FP8 cache").

The two-term FP8 decode with chains (docs/history/2026-12-05-fp8-s-chains.patch) as a
model: S from fp8_accum_model's wgmma model (13 bits kept in a k-block's alignment, the
result cut to 14 significant bits; the chains of decode/config.py), times the row's q
scale in float32; the softmax at the running maximum over keys (a sink joins at the end),
P rounded to fp16 for P V, O in float32 normalized, rounded to fp16. Its out and LSE go
through the patch's ``check_attention(..., fp8_scores=True)`` on test_fp8_cache.py's
shapes (fresh inputs per seed, lengths 0, 1, the cache and random), with the margins kept
(``FA4_AOT_TEST_MARGINS``). ``--old-terms``: the references' q terms as the tests computed
them before (fp8_s_probe.q_terms' ``cuda_division``: the row's scale a multiply by fl(1/448)).
The rescaling at a stale maximum, splits and pages are not emulated.

    PYTHONPATH=$PWD FA4_AOT_TEST_MARGINS=m.jsonl python benchmarks/experiments/fp8_check_emulation.py \\
        --tree <a tree with the patch applied> --head-dim 128 --seeds 0:8 [--local --cap 30] [--old-terms]
"""

import argparse
import math
import sys

import torch

import fp8_accum_model as M
from fp8_s_probe import q_terms

FP8 = torch.float8_e4m3fn
MODEL = M.Model(13, True, 32, "zero", "cut", 14)
# test_fp8_cache.py's shapes (batch, seqlen_q, heads_q, heads_kv, max_cache), their windows
CASES = [(4, 1, 32, 8, 1000), (3, 4, 8, 8, 640), (4, 16, 16, 1, 300), (3, 2, 16, 2, 777)]
WINDOWS = [(100, 0), (37, 5), (0, 0), (64, 3)]
def masked(logits, causal, window):
    """``logits`` (s_q, n) under the causal mask and the window, by the reference's own
    rules (tests/reference.py of the tree given: imported once that is on the path)."""
    from tests.reference import _causal_masked, _window_masked
    if causal:
        logits = _causal_masked(logits)
    return logits if window is None else _window_masked(logits, *window)


S_FORM = {}  # kernel_s's candidate fixes (--own-remainder, --debias)


def kernel(terms, k8, v8, ks, vs, lengths, causal, d, window=None, cap=0.0, sinks=None, dtype=torch.float16):
    """(out (b, s_q, h_q, d) in ``dtype``, lse (b, h_q, s_q)) as the model kernel computes them."""
    first, rest, rs = terms
    b, sq, hq, _ = first.shape
    hkv = k8.shape[2]
    group = hq // hkv
    narrow = group * sq <= 16 and window is None and cap == 0 and d % 64 == 0
    chain = M.NARROW_CHAIN if narrow else M.ROW_MAJOR_CHAIN[d]
    out = torch.zeros(b, sq, hq, d, dtype=dtype)
    lse = torch.full((b, hq, sq), float("-inf"))
    scale = 1.0 / math.sqrt(d)
    for bi in range(b):
        n = int(lengths[bi])
        if n == 0:
            continue
        for h in range(hq):
            kv = h // group
            s = M.kernel_s(first[bi, :, h].repeat_interleave(n, 0), rest[bi, :, h].repeat_interleave(n, 0),
                           k8[bi, :n, kv].repeat(sq, 1), MODEL, chain, **S_FORM).view(sq, n).float()
            logits = (s * rs[bi, :, h].float()).double() * scale * ks[bi, kv].item()
            if cap:
                logits = cap * torch.tanh(logits / cap)
            logits = masked(logits, causal, window)
            m = logits.amax(-1, keepdim=True)
            none = torch.isinf(m)
            m0 = torch.where(none, torch.zeros_like(m), m)
            p = torch.exp(logits - m0)
            total = p.sum(-1, keepdim=True)
            acc = p.float().half().float() @ v8[bi, :n, kv].float().half().float()
            if sinks is not None:
                sink = float(sinks[h])
                top = torch.where(none, torch.full_like(m, sink), torch.maximum(m, torch.full_like(m, sink)))
                total = torch.where(none, torch.zeros_like(total), total * torch.exp(m0 - top)) + torch.exp(sink - top)
                o = acc * (torch.where(none, torch.zeros_like(m), torch.exp(m0 - top)) / total).float()
                row_lse = (top + torch.log(total))[:, 0]
            else:
                o = torch.where(none, torch.zeros_like(acc), acc / total.float().clamp_min(1e-30))
                row_lse = torch.where(none[:, 0], torch.full_like(total[:, 0], float("-inf")),
                                      (m0 + torch.log(total))[:, 0])
            out[bi, :, h] = (o * vs[bi, kv].item()).to(dtype)
            lse[bi, h] = row_lse.float()
    return out, lse


def run(seed, d, causal, local, cap, old, reference):
    check_attention, fp8_q_terms = reference
    gen = torch.Generator().manual_seed(seed)
    failures = []
    for case, window in zip(CASES, WINDOWS):
        batch, sq, hq, hkv, max_cache = case
        q = torch.randn(batch, sq, hq, d, generator=gen).half()
        k8 = torch.randn(batch, max_cache, hkv, d, generator=gen).to(FP8)
        v8 = torch.randn(batch, max_cache, hkv, d, generator=gen).to(FP8)
        ks = 2.0 ** torch.randint(-5, 3, (batch, hkv), generator=gen).float()
        vs = 2.0 ** torch.randint(-5, 3, (batch, hkv), generator=gen).float()
        lengths = ([0, 1, max_cache] + torch.randint(1, max_cache + 1, (batch,), generator=gen).tolist())[:batch]
        sinks = 2 * torch.randn(hq, generator=gen) if local else None
        mods = dict(window=window, softcap=cap, sink=sinks) if local else {}
        terms = fp8_q_terms(q)
        out, lse = kernel(terms, k8, v8, ks, vs, lengths, causal and not local, d, window if local else None, cap,
                          sinks)
        first, rest, rs = q_terms(q, cuda_division=True) if old else terms
        q_taken = (first.float() + rest.float()) * rs
        k_full, v_full = k8.float() * ks[:, None, :, None], v8.float() * vs[:, None, :, None]
        for bi, n in enumerate(lengths):
            if n:
                what = f"seed {seed} d{d} causal {causal} local {local} cap {cap} case {case} sequence {bi}: "
                try:
                    check_attention(out[bi:bi + 1], lse[bi:bi + 1], q_taken[bi:bi + 1], k_full[bi:bi + 1, :n],
                                    v_full[bi:bi + 1, :n], causal and not local, what=what, fp8_scores=True, **mods)
                except AssertionError as e:
                    failures.append(str(e)[:300])
    return failures


def replay(path, tree):
    """A check that failed on the GPU (test_fp8_cache.py's FA4_AOT_KEEP_FAILURES file): the
    kernel's out and LSE, the model's on the same inputs and the twin's, each against the
    float32 reference, per sequence and worst row: where the kernel is far worse than the
    model, the model lacks what the kernel does."""
    sys.path.insert(0, tree)
    from fa4_aot.variants import Variant
    from tests.reference import attention_ref, fp8_q_terms
    kept = torch.load(path)
    variant = Variant.from_name(kept["variant"])
    q, out, lse = kept["q"], kept["out"], kept["lse"]
    k8, v8 = kept["k_raw"].view(FP8), kept["v_raw"].view(FP8)
    ks, vs = kept["k_scale"].float(), kept["v_scale"].float()
    lengths = kept["lengths"].tolist()
    mods = kept["mods"]
    d = q.shape[-1]
    print(f"{path}: {kept['variant']}, splits {kept['splits']}, lengths {lengths}, mods "
          f"{ {n: (m if not isinstance(m, torch.Tensor) else 'tensor') for n, m in mods.items()} }")
    first, rest, rs = terms = fp8_q_terms(q)
    model_out, model_lse = kernel(terms, k8, v8, ks, vs, lengths, variant.causal, d, mods.get("window"),
                                  mods.get("softcap", 0.0), mods.get("sink"), q.dtype)
    q_taken = (first.float() + rest.float()) * rs
    k_full, v_full = k8.float() * ks[:, None, :, None], v8.float() * vs[:, None, :, None]
    for bi, n in enumerate(lengths):
        if not n:
            continue
        args = (q_taken[bi:bi + 1], k_full[bi:bi + 1, :n], v_full[bi:bi + 1, :n], variant.causal and not mods)
        ref, lse32 = attention_ref(*(a.float() for a in args[:3]), args[3], None, upcast=True, **mods)
        low, lse_low = attention_ref(*(a.to(q.dtype) for a in args[:3]), args[3], None, upcast=False, **mods)
        rms = lambda o: (o[0].float() - ref[0].float()).square().mean(-1).sqrt()  # noqa: E731  (s_q, h_q)
        e_kernel, e_model, e_twin = rms(out[bi:bi + 1]), rms(model_out[bi:bi + 1]), rms(low)
        worst = (e_kernel / (2 * e_twin + 1e-6)).flatten().argmax().item()
        t, h = divmod(worst, q.shape[2])
        finite = torch.isfinite(lse32[0])
        lse_err = lambda x: (x[0].double() - lse32[0].double())[finite].abs().max().item() if finite.any() else 0.0  # noqa: E731,E501
        print(f"  sequence {bi} ({n} keys): out RMS error, worst row (token {t}, head {h}): kernel "
              f"{e_kernel[t, h]:.2e}, model {e_model[t, h]:.2e}, twin {e_twin[t, h]:.2e}; largest LSE error: kernel "
              f"{lse_err(lse[bi:bi + 1]):.2e}, model {lse_err(model_lse[bi:bi + 1]):.2e}, twin {lse_err(lse_low):.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True, help="a checkout with the FP8 chains patch applied (its tests/)")
    ap.add_argument("--replay", nargs="*", default=(), help="FA4_AOT_KEEP_FAILURES files: replay them")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seeds", default="0:4")
    ap.add_argument("--local", action="store_true", help="the local variants' checks (windows, sinks)")
    ap.add_argument("--cap", type=float, default=0.0)
    ap.add_argument("--old-terms", action="store_true")
    ap.add_argument("--chain", type=int, default=0, help="the row-major consumer's chain at this head dim (k-blocks)")
    ap.add_argument("--debias", action="store_true", help="the model with the cuts' expected loss added back")
    ap.add_argument("--own-remainder", action="store_true",
                    help="the model with the remainder's products in an accumulator of their own")
    args = ap.parse_args()
    if args.chain:
        M.ROW_MAJOR_CHAIN[args.head_dim] = args.chain
    S_FORM.update(own_remainder=args.own_remainder, debiased=args.debias)
    if args.replay:
        for path in args.replay:
            replay(path, args.tree)
        return
    sys.path.insert(0, args.tree)
    from tests.reference import check_attention, fp8_q_terms
    lo, hi = (int(x) for x in args.seeds.split(":"))
    count = 0
    for seed in range(lo, hi):
        for causal in ((False,) if args.local else (False, True)):
            failures = run(seed, args.head_dim, causal, args.local, args.cap, args.old_terms,
                           (check_attention, fp8_q_terms))
            count += len(failures)
            for f in failures:
                print("FAIL", f)
        print(f"seed {seed} done, {count} failures so far", flush=True)


if __name__ == "__main__":
    main()
