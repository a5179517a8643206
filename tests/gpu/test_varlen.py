"""The varlen forward against a per-sequence float32 reference (the dense forward's rule:
twice PyTorch's low-precision error), on fresh random inputs, outputs poisoned with NaN
before each launch: rows of no sequence must stay NaN (nothing written there)."""

import pytest
import torch

from fa4_aot.torch import flash_attn_varlen_func, flash_attn_varlen_fwd
from fa4_aot.variants import MATRIX

from ..reference import attention_ref

VARLEN = [v for v in MATRIX if v.kind == "fwd" and v.varlen]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# (query lengths, key lengths, heads_q, heads_kv), each mix with its edge
MIXES = [
    ([1, 0, 130, 257, 64], [1, 5, 130, 300, 1000], 4, 4),  # one-token, empty, tile +-1, sq != sk
    ([700, 3, 0, 191], [700, 3, 0, 193], 6, 2),  # GQA; an empty sequence in both q and k
    ([129, 40], [20, 511], 8, 1),  # MQA; causal rows that see no key (sq > sk)
]


def _lengths_to_cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    return cu


def _packed(lengths, heads, d, dtype, gen):
    return torch.randn(sum(lengths), heads, d, device="cuda", dtype=dtype, generator=gen)


def _check_sequences(out, lse, q, k, v, lq, lk, used_q, used_k, causal):
    """Every used row of every sequence against the reference; every other row unwritten."""
    written = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    at_q = at_k = 0
    for sq, sk, uq, uk in zip(lq, lk, used_q, used_k):
        if uq:
            qs, ks, vs = q[at_q:at_q + uq][None], k[at_k:at_k + uk][None], v[at_k:at_k + uk][None]
            if uk:
                ref, lse_ref = attention_ref(qs, ks, vs, causal, upcast=True)
                low, lse_low = attention_ref(qs, ks, vs, causal, upcast=False)
            else:  # no key at all: out 0, lse -inf
                ref = low = torch.zeros_like(qs)
                lse_ref = lse_low = torch.full((1, q.shape[1], uq), float("-inf"), device="cuda")
            got = out[at_q:at_q + uq][None]
            assert not got.isnan().any(), "unwritten or NaN output rows"
            err = (got.float() - ref.float()).abs().max().item()
            tol = 2 * (low.float() - ref.float()).abs().max().item() + 1e-5
            assert err <= tol, f"out max error {err:.3e} > {tol:.3e} (sequence of {uq} x {uk})"
            got_lse = lse[:, at_q:at_q + uq][None]
            finite = torch.isfinite(lse_ref)
            assert torch.equal(torch.isfinite(got_lse), finite), "LSE is -inf exactly where a row sees no key"
            if finite.any():
                lse_err = (got_lse - lse_ref)[finite].abs().max().item()
                lse_tol = 2 * (lse_low - lse_ref)[finite].abs().max().item() + 1e-4
                assert lse_err <= lse_tol, f"lse max error {lse_err:.3e} > {lse_tol:.3e}"
            written[at_q:at_q + uq] = True
        at_q, at_k = at_q + sq, at_k + sk
    assert out[~written].isnan().all() and lse[:, ~written].isnan().all(), "wrote rows of no sequence"


@pytest.mark.parametrize("variant", VARLEN, ids=lambda v: v.name)
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: f"{len(m[0])}seqs_h{m[2]}x{m[3]}")
def test_varlen_forward_matches_reference(variant, mix, gen):
    lq, lk, hq, hkv = mix
    dtype, d = DTYPES[variant.dtype], variant.head_dim
    q, k, v = _packed(lq, hq, d, dtype, gen), _packed(lk, hkv, d, dtype, gen), _packed(lk, hkv, d, dtype, gen)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda")
    flash_attn_varlen_fwd(q, k, v, _lengths_to_cu(lq), _lengths_to_cu(lk), max(lq), max(lk), causal=variant.causal,
                          out=out, lse=lse)
    torch.cuda.synchronize()
    _check_sequences(out, lse, q, k, v, lq, lk, lq, lk, variant.causal)


@pytest.mark.parametrize("variant", [v for v in VARLEN if v.dtype == "bf16"], ids=lambda v: v.name)
def test_varlen_seqused_cuts_sequences_short(variant, gen):
    """seqused: only a sequence's first rows are used (the packed rows after them are
    neither read as keys nor written as queries)."""
    lq, lk, used_q, used_k = [300, 77, 5], [400, 90, 8], [250, 77, 0], [399, 1, 8]
    d = variant.head_dim
    q, k, v = (_packed(n, 4, d, torch.bfloat16, gen) for n in (lq, lk, lk))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, q.shape[0]), float("nan"), device="cuda")
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    flash_attn_varlen_fwd(q, k, v, _lengths_to_cu(lq), _lengths_to_cu(lk), max(lq), max(lk), causal=variant.causal,
                          seqused_q=as_i32(used_q), seqused_k=as_i32(used_k), out=out, lse=lse)
    torch.cuda.synchronize()
    _check_sequences(out, lse, q, k, v, lq, lk, used_q, used_k, variant.causal)


def test_varlen_lying_metadata_stays_in_bounds():
    """cu_seqlens decreasing and past the totals, max_seqlen too small: wrong numbers are
    allowed, touching memory outside the tensors is not (checked in full under
    compute-sanitizer by test_sanitizer; here: the guard rows around out stay NaN)."""
    d, hq = 128, 2
    big = torch.full((300, hq, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = big[100:200]
    q = torch.randn(100, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(50, hq, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 90, 30, 5000], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([-7, 10, 2**30, 3], dtype=torch.int32, device="cuda")
    lse = torch.full((hq, 100), float("nan"), device="cuda")
    flash_attn_varlen_fwd(q, k, k, cu_q, cu_k, 64, 1 << 20, out=out, lse=lse)
    torch.cuda.synchronize()
    assert big[:100].isnan().all() and big[200:].isnan().all(), "wrote outside out"


def test_varlen_matches_the_dense_kernel_on_equal_lengths(gen):
    """Equal lengths: the varlen forward gives the dense forward's bits (same tiles, same
    order of key tiles)."""
    from fa4_aot.torch import flash_attn_fwd

    b, s, h, d = 3, 333, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    dense, dense_lse = flash_attn_fwd(q, k, v, causal=True, q_tiles=1)
    cu = _lengths_to_cu([s] * b)
    out, lse = flash_attn_varlen_fwd(*(x.reshape(b * s, h, d) for x in (q, k, v)), cu, cu, s, s, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(out.view(b, s, h, d), dense)
    assert torch.equal(lse.view(h, b, s).transpose(0, 1), dense_lse)


def test_varlen_under_cuda_graph_with_lengths_changing_between_replays(gen):
    lq, lk, hq, d = [200, 57], [300, 90], 4, 64
    q, k, v = (_packed(n, hq, d, torch.bfloat16, gen) for n in (lq, lk, lk))
    cu_q, cu_k = _lengths_to_cu(lq), _lengths_to_cu(lk)
    from fa4_aot import default_library

    default_library().preload()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda")
    flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, 300, 300, out=out, lse=lse)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, 300, 300, out=out, lse=lse)
    for new_q, new_k in (([100, 157], [10, 380]), (lq, lk)):
        cu_q.copy_(_lengths_to_cu(new_q))
        cu_k.copy_(_lengths_to_cu(new_k))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_sequences(out, lse, q, k, v, new_q, new_k, new_q, new_k, False)


def test_varlen_func_is_traceable_and_says_its_backward_is_not_built(gen):
    from fa4_aot.errors import UnsupportedVariantError

    lq = [100, 50]
    q, k, v = (_packed(lq, 2, 128, torch.bfloat16, gen) for _ in range(3))
    cu = _lengths_to_cu(lq)
    compiled = torch.compile(lambda *a: flash_attn_varlen_func(*a, causal=True), fullgraph=True)
    out = compiled(q, k, v, cu, cu, 100, 100)
    eager = flash_attn_varlen_func(q, k, v, cu, cu, 100, 100, causal=True)
    assert torch.equal(out, eager)
    q.requires_grad_(True)
    with pytest.raises(UnsupportedVariantError, match="backward"):
        flash_attn_varlen_func(q, k, v, cu, cu, 100, 100).sum().backward()
