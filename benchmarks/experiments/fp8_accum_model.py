"""Models of the tensor cores' FP8 accumulation, fitted to what the H200 returned
(fp8_s_dump.py's ``hw`` section) and then used to replay the FP8 decode kernel's S
(docs/design.md, "FP8 cache"). Runs anywhere (CPU).

A model sums a chain of 32-column k-blocks (one wgmma each) into an accumulator ``c``.
Every e4m3 x e4m3 product is exact in units of 2^-18 (the smallest product), so the
arithmetic is integers (int64). Per k-block, in groups of ``group`` columns: the group's
products (and ``c`` where ``with_acc``) are aligned to the largest of their exponents and
cut to ``bits`` bits below it (toward zero, or toward minus infinity), summed exactly, and
the sum goes back to ``c`` rounded to float32 (``out="fp32"``) or cut to ``out_bits``
significant bits.

    PYTHONPATH=$PWD python benchmarks/experiments/fp8_accum_model.py --fit dump.pt
    PYTHONPATH=$PWD python benchmarks/experiments/fp8_accum_model.py --selftest
"""

import argparse
import itertools
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
UNIT = 2.0 ** -18  # the smallest e4m3 product: 2^-9 x 2^-9


@dataclass(frozen=True)
class Model:
    bits: int = 13  # bits kept below the largest exponent of an aligned group
    with_acc: bool = True  # the accumulator takes part in the alignment
    group: int = 32  # products aligned together (within one 32-column k-block)
    toward: str = "zero"  # how the cut rounds: "zero" or "floor"
    out: str = "fp32"  # the accumulator after each group: "fp32" (nearest) or "cut" (out_bits)
    out_bits: int = 24

    def __str__(self):
        tail = "fp32" if self.out == "fp32" else f"cut{self.out_bits}"
        return f"bits={self.bits} acc={'in' if self.with_acc else 'out'} group={self.group} {self.toward} {tail}"


def exponent(x):
    """floor(log2 |x|) of int64 x (elementwise; 0 where x == 0): exact through float64, the
    values staying below 2^53."""
    return torch.where(x != 0, torch.frexp(x.abs().double()).exponent.long() - 1, torch.zeros_like(x))


def cut(x, shift, toward):
    """x (int64) to a multiple of 2^shift (shift >= 0 elementwise), toward zero or -inf."""
    shift = shift.clamp(min=0, max=62)
    if toward == "zero":
        return x.sign() * ((x.abs() >> shift) << shift)
    return (x >> shift) << shift


def round_significant(x, bits, mode):
    """x (int64) to ``bits`` significant bits: nearest even ("near") or toward zero ("zero")."""
    e = exponent(x)
    shift = (e - (bits - 1)).clamp(min=0)
    if mode == "zero":
        return cut(x, shift, "zero")
    ax = x.abs()
    q = ax >> shift
    rem = ax - (q << shift)
    half = torch.where(shift > 0, torch.ones_like(shift) << (shift - 1).clamp(min=0), torch.zeros_like(shift))
    up = (rem > half) | ((rem == half) & (shift > 0) & (q & 1 == 1))
    q = q + up.long()
    return x.sign() * (q << shift)


def products(a, b):
    """a (n, K), b (n, K) e4m3 -> (n, K) int64 products in units of 2^-18."""
    pa = (a.double() * 2 ** 9).round().long()
    pb = (b.double() * 2 ** 9).round().long()
    return pa * pb


def chain(p, model, c=None):
    """The accumulator after summing products p (n, K) (k-blocks of 32 in order) into c (n,)
    int64 (None: a fresh accumulator). Returns int64 in units of 2^-18."""
    n, k_dim = p.shape
    c = torch.zeros(n, dtype=torch.long) if c is None else c.clone()
    for g0 in range(0, k_dim, model.group):
        grp = p[:, g0:g0 + model.group]
        members = torch.cat([grp, c[:, None]], 1) if model.with_acc else grp
        emax = exponent(members).amax(1, keepdim=True)
        shift = emax - model.bits
        grp_cut = cut(grp, shift, model.toward).sum(1)
        if model.with_acc:
            total = grp_cut + cut(c[:, None], shift, model.toward)[:, 0]
        else:
            total = grp_cut + c
        c = round_significant(total, 24, "near") if model.out == "fp32" else round_significant(total, model.out_bits,
                                                                                                 "zero")
    return c


def candidates():
    # bits 30: nothing cut (products within 2^30 of the largest: exact); out_bits 14: a
    # float with 13 stored mantissa bits, which one public probe of H100 wgmma reports, with
    # truncation (huweim/emulation_sys's README)
    for bits, with_acc, group, toward in itertools.product(list(range(10, 27)) + [30], (True, False), (4, 8, 16, 32),
                                                             ("zero", "floor")):
        yield Model(bits, with_acc, group, toward, "fp32")
        for out_bits in (12, 13, 14, 15, 22, 23):
            yield Model(bits, with_acc, group, toward, "cut", out_bits)


def gemm_rows(entry):
    """A hw entry's GEMMs (g, 16, K) as every (i, j) dot product: (n, K) a and b, (n,) results."""
    a = entry["a"].view(E4M3)
    b = entry["b"].view(E4M3)
    g, m, k_dim = a.shape
    aa = a[:, :, None, :].expand(g, m, b.shape[1], k_dim).reshape(-1, k_dim)
    bb = b[:, None, :, :].expand(g, m, b.shape[1], k_dim).reshape(-1, k_dim)
    return aa, bb


def fit(hw, which="fast", top=8, rows=1024):
    """Each candidate model's share of the hw results (``rows`` dot products of each entry) it
    reproduces bit for bit."""
    data = []
    for key, entry in hw.items():
        aa, bb = gemm_rows(entry)
        got = (entry[which].reshape(-1).double() / UNIT).round().long()
        pick = torch.randperm(got.numel(), generator=torch.Generator().manual_seed(0))[:rows]
        data.append((key, products(aa[pick], bb[pick]), got[pick]))
    scores = []
    for model in candidates():
        hits = total = 0
        for key, p, got in data:
            hits += (chain(p, model) == got).sum().item()
            total += got.numel()
        scores.append((hits / total, str(model)))
    scores.sort(reverse=True)
    for share, name in scores[:top]:
        print(f"{share:.4f}  {name}")
    return scores


def debias(c, steps):
    """c (int64 accumulator) plus half of a 14-significant-bit unit per cut it took (``steps``
    k-blocks of the first term, each result cut toward zero): the cuts' expected loss."""
    return c + c.sign() * steps * (torch.ones_like(c) << (exponent(c) - 14).clamp(min=0))


def kernel_s(first, rest, k8, model, chain_len, own_remainder=False, debiased=False):
    """S as the FP8 decode kernel forms it (sm90/primitives.wgmma_two_terms): the remainder's
    k-blocks, then the first term's first ``chain_len`` into accumulator 0; the first term's
    later k-blocks ``chain_len`` to a fresh accumulator; the accumulators added in float32 in
    order. first, rest, k8: (n, d) e4m3. Returns (n,) float64 (before the row's scale).
    Candidate fixes, tried in session 40 (neither helped): ``own_remainder``, the
    remainder's k-blocks in an accumulator of their own, added last (no cut of its products
    against the first term's); ``debiased``, each first-term accumulator's expected loss
    to the cuts added back (debias) before the sum."""
    blocks = first.shape[1] // 32
    pr, pf = products(rest, k8), products(first, k8)
    starts = range(0, blocks, chain_len)
    acc = [pf[:, 32 * j:32 * (j + chain_len)] for j in starts]
    if not own_remainder:
        acc[0] = torch.cat([pr, acc[0]], 1)
    acc = [chain(p, model) for p in acc]
    if debiased:
        acc = [debias(c, min(chain_len, blocks - j)) for c, j in zip(acc, starts)]
    if own_remainder:
        acc.append(chain(pr, model))
    total = acc[0].double() * UNIT
    for other in acc[1:]:
        total = (total.float() + (other.double() * UNIT).float()).double()
    return total.float().double()


# the fp8g kernels' chains (decode/config.py): packed rows <= 16 take the transposed consumer
NARROW_CHAIN = 1
ROW_MAJOR_CHAIN = {64: 1, 96: 2, 128: 2, 192: 2, 256: 4}


def first_chain_columns(rows, d):
    """The columns of Q's first S chain (the remainder's accumulator) of a KV head of ``rows``
    packed rows at head dim ``d``: the transposed consumer's to 16 rows, else the row-major's."""
    return 32 * (NARROW_CHAIN if rows <= 16 else ROW_MAJOR_CHAIN[d])


def read_back(first, rest, columns):
    """q_j's terms (float64) as one-key decodes against basis keys read them: in the first
    chain's ``columns`` the remainder is cut toward zero on the grid 2^(e(first) - 13) (the
    wgmma adds the two products in one accumulator), past them the sum is exact (measured
    bit for bit on an H100, docs/history/2026-12-05-session39.md)."""
    big = torch.where(first != 0, first, rest).abs()
    grid = torch.pow(2.0, torch.floor(torch.log2(big.clamp_min(2.0 ** -30))) - 13)
    cut_rest = first + torch.trunc(rest / grid) * grid
    return torch.where(torch.arange(first.shape[-1], device=first.device) < columns, cut_rest, first + rest)


def replay(scores, model):
    """The kernel's S of fp8_s_dump.py's ``scores`` entries against the model's, and both
    against exact (logits)."""
    import math
    from fp8_s_probe import q_terms
    for key, r in scores.items():
        q, k8, s = r["q"], r["k8"].view(E4M3), r["s"]
        b, hq, d = q.shape
        kk = k8.repeat_interleave(hq // k8.shape[1], dim=1).reshape(-1, d)
        first, rest, rs = q_terms(q)
        rows = hq if k8.shape[1] == 1 else 1
        chain_len = NARROW_CHAIN if rows <= 16 else ROW_MAJOR_CHAIN[d]
        mod = kernel_s(first.reshape(-1, d), rest.reshape(-1, d), kk, model, chain_len)
        mod = (mod.float() * rs.reshape(-1).float()).double()
        exact = ((first.double() + rest.double()).reshape(-1, d) * kk.double()).sum(1) * rs.reshape(-1).double()
        got = s.reshape(-1)
        unit = math.sqrt(d)
        same = ((got - mod).abs() <= 4e-6 * got.abs().clamp_min(1e-3)).double().mean().item()
        st = lambda e: f"rms {(e / unit).square().mean().sqrt():.2e} max {(e / unit).abs().max():.2e}"  # noqa: E731
        print(f"{key} (chain {chain_len}): model equals kernel {same:.3f}; kernel {st(got - exact)}; model {st(mod - exact)}")


def selftest():
    gen = torch.Generator().manual_seed(0)
    truth = Model(13, True, 16, "zero", "cut", 22)
    hw = {}
    for k_dim in (32, 64, 128):
        q = torch.randn(4, 16, k_dim, generator=gen)
        x = q * (448.0 / q.abs().amax(-1, keepdim=True))
        a = x.to(E4M3)
        b = torch.randn(4, 16, k_dim, generator=gen).to(E4M3)
        aa, bb = gemm_rows({"a": a.view(torch.uint8), "b": b.view(torch.uint8)})
        out = chain(products(aa, bb), truth).double() * UNIT
        hw[f"k{k_dim}"] = {"a": a.view(torch.uint8), "b": b.view(torch.uint8), "fast": out.view(4, 16, 16).float()}
    # exactness of the integer machinery against float64 where nothing is cut
    p = products(aa, bb)
    exact = chain(p, Model(60, False, 32, "zero", "cut", 62))
    assert torch.equal(exact, p.sum(1)), "uncut chain is not the exact sum"
    scores = fit(hw, top=3)
    best = [name for share, name in scores if share == 1.0]
    assert str(truth) in best, scores[:3]
    print(f"selftest: {truth} among the {len(best)} models that reproduce every result")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", default=None, help="a file of fp8_s_dump.py: fit its hw section")
    ap.add_argument("--selftest", action="store_true")
    args = ap.parse_args()
    if args.selftest:
        selftest()
    if args.fit:
        res = torch.load(args.fit)
        hw = {k: v for k, v in res["hw"].items() if k.startswith("random")}
        for which in ("slow", "fast"):
            print(f"== {which}")
            scores = fit(hw, which)
        best = next(m for m in candidates() if str(m) == scores[0][1])
        print(f"== the kernel's S against the best fast model ({best})")
        replay(res["scores"], best)


if __name__ == "__main__":
    main()
