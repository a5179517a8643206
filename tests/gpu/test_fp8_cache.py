"""Decode against an FP8 (e4m3) KV cache with dequantization scales (k_descale, v_descale)
against the float32 reference on the dequantized cache (twice PyTorch's error with that
cache rounded to q's dtype), fresh random inputs, outputs poisoned with NaN before each
launch; the append's quantization; the refusals."""

import pytest
import torch

import fa4_aot
from fa4_aot.errors import DTypeError, ShapeError
from fa4_aot.torch import flash_attn_with_kvcache
from fa4_aot.variants import MATRIX

from ..reference import check_attention
from .test_decode import PAIRED, _check, _lengths, _run

FP8 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DECODE = [v for v in MATRIX if v.kind == "decode" and v.kv_dtype == "e4m3"]
# (batch, seqlen_q, heads_q, heads_kv, max_cache, page_size or None), as test_decode's
CASES = [
    (4, 1, 32, 8, 1000, None),  # GQA 4, one token, cache not a multiple of the tile
    (3, 4, 8, 8, 640, 64),  # MHA, four tokens, pages of 64
    (4, 16, 16, 1, 300, 48),  # MQA, 4 row tiles, pages of 48 (pieces of 16)
    (5, 64, 4, 2, 2048, 16),  # 64 tokens (chunked decode), pages of 16
]


def _scales(batch, heads_kv, gen, powers=True):
    """(batch, heads_kv) float32 scales that differ by 128x across heads and sequences:
    powers of two (2^-5 .. 2^2, so that the dequantized cache is exact in 16 bits and the
    reference is the kernel's exact problem), or any values in the same range."""
    if powers:
        return 2.0 ** torch.randint(-5, 3, (batch, heads_kv), generator=gen, device="cuda").float()
    return 2.0 ** (7 * torch.rand(batch, heads_kv, generator=gen, device="cuda") - 5)


def _fp8_cache(batch, max_cache, heads_kv, d, page_size, gen):
    """(k, v e4m3 caches, page_table, their contiguous (batch, max_cache, h, d) uint8 views):
    values of randn (some subnormal in e4m3), pages permuted
    with spare pages between them."""
    make = lambda lead: torch.randn(*lead, d, device="cuda", generator=gen).to(FP8)  # noqa: E731
    if page_size is None:
        k, v = make((batch, max_cache, heads_kv)), make((batch, max_cache, heads_kv))
        return k, v, None, k.view(torch.uint8), v.view(torch.uint8)
    max_pages = -(-max_cache // page_size)
    num_pages = batch * max_pages + 3
    k, v = make((num_pages, page_size, heads_kv)), make((num_pages, page_size, heads_kv))
    table = torch.randperm(num_pages, generator=gen, device="cuda")[:batch * max_pages].view(batch, max_pages)
    table = table.to(torch.int32).contiguous()
    gathered = lambda c: c.view(torch.uint8)[table.long()].reshape(batch, max_pages * page_size, heads_kv, d)  # noqa: E731
    return k, v, table, gathered(k), gathered(v)


def _dequantized(raw, scale):
    """A contiguous uint8 view of an e4m3 cache times its (batch, heads_kv) scales, float32."""
    return raw.view(FP8).float() * scale[:, None, :, None]


@pytest.mark.parametrize("variant", DECODE, ids=lambda v: v.name)
def test_fp8_decode_matches_reference(variant, gen):
    """Every FP8 variant, contiguous and paged, every split count asked (each bitwise
    repeatable), against the reference on the dequantized cache; local variants with a
    window starting mid-page, sinks and a cap where built."""
    dtype, d = DTYPES[variant.dtype], variant.head_dim
    for (batch, sq, hq, hkv, max_cache, page), window in zip(CASES, [(100, 0), (37, 5), (0, 0), (200, 0)]):
        q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
        k, v, table, k_raw, v_raw = _fp8_cache(batch, max_cache, hkv, d, page, gen)
        k_scale, v_scale = _scales(batch, hkv, gen), _scales(batch, hkv, gen)
        lengths = _lengths(batch, max_cache, sq, gen)
        mods, ref_mods = {}, {}
        if variant.local:
            sinks = 2 * torch.randn(hq, device="cuda", generator=gen)
            cap = 30.0 if variant.softcap else 0.0
            mods = {"window_size": window, "softcap": cap, "learnable_sink": sinks}
            ref_mods = {"window": window, "softcap": cap, "sink": sinks}
        k_full, v_full = _dequantized(k_raw, k_scale), _dequantized(v_raw, v_scale)
        for splits in (None, 1, 3):
            out, lse = _run(q, k, v, lengths, table, variant.causal, splits, k_descale=k_scale, v_descale=v_scale,
                            **mods)
            again = _run(q, k, v, lengths, table, variant.causal, splits, k_descale=k_scale, v_descale=v_scale, **mods)
            assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), f"{splits} splits: not repeatable"
            if variant.local:
                for b, n in enumerate(lengths.tolist()):
                    if n:
                        check_attention(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_full[b:b + 1, :n],
                                        v_full[b:b + 1, :n], False, what=f"{window} splits {splits}, sequence {b}: ",
                                        **ref_mods)
            else:
                _check(out, lse, q, k_full, v_full, lengths, variant.causal)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PAIRED, ids=lambda c: f"b{c[0]}_q{c[1]}_h{c[2]}x{c[3]}_k{c[4]}_p{c[5]}")
def test_fp8_paired_heads_match_reference(case, causal, d, dtype, gen, monkeypatch):
    """An FP8 cache of narrow heads read in pairs (decode.pair_sizes), each row with its own
    head's scales (up to 128x apart between a pair's two heads): against the reference on
    the dequantized cache, every split count; the pairing shown taken."""
    import fa4_aot.decode as decode

    views = []
    monkeypatch.setattr(decode, "_pair_view", lambda t, view=decode._pair_view: views.append(t) or view(t))
    batch, sq, hq, hkv, max_cache, page = case
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=DTYPES[dtype], generator=gen)
    k, v, table, k_raw, v_raw = _fp8_cache(batch, max_cache, hkv, d, page, gen)
    k_scale, v_scale = _scales(batch, hkv, gen), _scales(batch, hkv, gen)
    lengths = _lengths(batch, max_cache, sq, gen)
    k_full, v_full = _dequantized(k_raw, k_scale), _dequantized(v_raw, v_scale)
    for splits in (None, 1, 3):
        views.clear()
        out, lse = _run(q, k, v, lengths, table, causal, splits, k_descale=k_scale, v_descale=v_scale)
        assert len(views) == 2, "the call was not paired"
        _check(out, lse, q, k_full, v_full, lengths, causal)


@pytest.mark.parametrize("descale", ["given", "scalar", "broadcast", "none"])
def test_fp8_scales_any_values_and_forms(descale, gen):
    """Scales that are not powers of two (the reference: the exact dequantized cache in
    float32), as (batch, heads_kv), one value, a stride-0 broadcast, or none (1)."""
    batch, sq, hq, hkv, d, max_cache = 3, 2, 16, 4, 128, 777
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v, table, k_raw, v_raw = _fp8_cache(batch, max_cache, hkv, d, 32, gen)
    forms = {
        "given": lambda: _scales(batch, hkv, gen, powers=False),
        "scalar": lambda: torch.tensor(0.37, device="cuda"),
        "broadcast": lambda: torch.tensor([0.61], device="cuda").expand(batch, hkv),
        "none": lambda: None,
    }
    k_scale, v_scale = forms[descale](), forms[descale]()
    full = lambda s: torch.ones(batch, hkv, device="cuda") if s is None else s.expand(batch, hkv)  # noqa: E731
    lengths = _lengths(batch, max_cache, sq, gen)
    for splits in (1, 4):
        out, lse = _run(q, k, v, lengths, table, True, splits, k_descale=k_scale, v_descale=v_scale)
        _check(out, lse, q, _dequantized(k_raw, full(k_scale)), _dequantized(v_raw, full(v_scale)), lengths, True)


@pytest.mark.parametrize("page", [None, 16])
def test_fp8_append_quantizes_then_attends(page, gen):
    """flash_attn_with_kvcache with bf16 k, v into an FP8 cache: written as k / k_descale
    rounded to e4m3 (bitwise torch's conversion, saturated at 448), then attended over the
    cache and the new keys."""
    batch, new, hq, hkv, d, max_cache = 3, 3, 8, 2, 64, 256
    q = torch.randn(batch, new, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache, table, _, _ = _fp8_cache(batch, max_cache, hkv, d, page, gen)
    k_new, v_new = (100 * torch.randn(batch, new, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))  # some past 448 * scale: saturated
    k_scale, v_scale = _scales(batch, hkv, gen, powers=False), _scales(batch, hkv, gen, powers=False)
    lengths = torch.tensor([0, 100, 250], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, page_table=table,
                                       causal=True, return_lse=True, k_descale=k_scale, v_descale=v_scale)
    torch.cuda.synchronize()
    gather = (lambda c: c.view(torch.uint8)) if table is None else \
        (lambda c: c.view(torch.uint8)[table.long()].reshape(batch, -1, hkv, d))
    k_raw, v_raw = gather(k_cache), gather(v_cache)
    for raw, x, scale in ((k_raw, k_new, k_scale), (v_raw, v_new, v_scale)):
        want = (x.float() / scale[:, None, :, None]).clamp(-448, 448).to(FP8).view(torch.uint8)
        for b, n in enumerate(lengths.tolist()):
            assert torch.equal(raw[b, n:n + new], want[b]), f"sequence {b}: appended rows differ"
    _check(out, lse, q, _dequantized(k_raw, k_scale), _dequantized(v_raw, v_scale), lengths + new, True)


def test_fp8_refusals_leave_everything_as_it_was(gen):
    """Typed errors before anything is written or appended: scales of the wrong shape,
    dtype or device, scales for a 16-bit cache, an FP8 q, k and v to append of the wrong
    dtype."""
    batch, hq, hkv, d, max_cache = 2, 8, 2, 128, 64
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v, _, _, _ = _fp8_cache(batch, max_cache, hkv, d, None, gen)
    lengths = torch.tensor([10, 20], dtype=torch.int32, device="cuda")
    good = torch.ones(batch, hkv, device="cuda")
    k_new = torch.randn(batch, 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    bad = [
        (ShapeError, dict(k_descale=torch.ones(batch, hkv + 1, device="cuda"))),
        (ShapeError, dict(v_descale=torch.ones(batch, device="cuda"))),
        (DTypeError, dict(k_descale=good.half())),
        (DTypeError, dict(k_descale=good.double())),
        (fa4_aot.errors.DeviceError, dict(v_descale=good.cpu())),
    ]
    before = (k.view(torch.uint8).clone(), v.view(torch.uint8).clone())
    for error, kwargs in bad:
        for append in (False, True):
            extra = dict(k=k_new, v=k_new) if append else {}
            with pytest.raises(error):
                flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, **extra, **{"k_descale": good, **kwargs})
    with pytest.raises(DTypeError):  # k, v to append must be q's dtype, not the cache's
        flash_attn_with_kvcache(q, k, v, k.clone()[:, :1], v.clone()[:, :1], cache_seqlens=lengths)
    torch.cuda.synchronize()
    assert torch.equal(k.view(torch.uint8), before[0]) and torch.equal(v.view(torch.uint8), before[1])
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq, 1), float("nan"), device="cuda")
    k16 = torch.randn(batch, max_cache, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(DTypeError):  # scales for a 16-bit cache
        fa4_aot.forward_kvcache(q, k16, k16, out, lse, lengths, k_descale=good, stream=stream)
    with pytest.raises(DTypeError):  # an FP8 q
        fa4_aot.forward_kvcache(q.to(FP8), k, v, out, lse, lengths, stream=stream)
    with pytest.raises(DTypeError):  # k and v caches of different dtypes
        fa4_aot.forward_kvcache(q, k, k16, out, lse, lengths, stream=stream)
    torch.cuda.synchronize()
    assert out.isnan().all() and lse.isnan().all()
