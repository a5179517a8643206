"""Decode against a KV cache (fa4_aot.forward_kvcache / flash_attn_with_kvcache) against a
per-sequence float32 reference on the gathered cache (twice PyTorch's low-precision
error), fresh random inputs, outputs poisoned with NaN before each launch."""

import pytest
import torch

import fa4_aot
from fa4_aot.policy import decode_splits
from fa4_aot.torch import flash_attn_with_kvcache
from fa4_aot.variants import MATRIX

from ..reference import check_attention

# local: test_local.py; an FP8 cache: test_fp8_cache.py
DECODE = [v for v in MATRIX if v.kind == "decode" and not v.local and v.kv_dtype == "same"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# (batch, seqlen_q, heads_q, heads_kv, max_cache, page_size or None), each with its edge
CASES = [
    (4, 1, 32, 8, 1000, None),  # GQA 4, one token, cache not a multiple of the tile
    (3, 4, 8, 8, 640, 128),  # MHA, four tokens, pages of one key tile
    (4, 16, 16, 1, 300, 48),  # MQA: 16 heads x 16 tokens = 256 rows (4 row tiles); pages of 48 keys
    (5, 64, 4, 2, 2048, 16),  # 64 tokens (chunked decode), pages of 16
    (2, 128, 8, 8, 700, 64),  # the most query tokens decode takes: 128 rows, 2 row tiles
    (3, 128, 16, 2, 500, None),  # GQA 8 x 128 tokens: 1024 rows, 16 row tiles; causal rows past short caches
]


def _lengths(batch, max_cache, seqlen_q, gen):
    """Cache lengths with 0, 1, a full cache and random ones (at least seqlen_q where
    possible, as a decoder would have)."""
    fixed = [0, 1, max_cache]
    rand = torch.randint(1, max_cache + 1, (batch,), generator=gen, device="cuda").tolist()
    return torch.tensor((fixed + rand)[:batch], dtype=torch.int32, device="cuda")


def _cache(batch, max_cache, heads_kv, d, dtype, page_size, gen, d_v=None, make=None):
    """(k_cache, v_cache, page_table, contiguous views (batch, max_cache, h, d)) with pages
    permuted and spare pages between them; v's head dim ``d_v`` (None: d); ``make(lead,
    width)``: a tensor of fresh draws (None: torch.randn's)."""
    d_v = d if d_v is None else d_v
    if make is None:
        make = lambda lead, width: torch.randn(*lead, width, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    if page_size is None:
        k, v = make((batch, max_cache, heads_kv), d), make((batch, max_cache, heads_kv), d_v)
        return k, v, None, k, v
    max_pages = -(-max_cache // page_size)
    num_pages = batch * max_pages + 3
    k, v = make((num_pages, page_size, heads_kv), d), make((num_pages, page_size, heads_kv), d_v)
    table = torch.randperm(num_pages, generator=gen, device="cuda")[:batch * max_pages].view(batch, max_pages)
    table = table.to(torch.int32).contiguous()
    gathered = lambda c: c[table.long()].reshape(batch, max_pages * page_size, heads_kv, c.shape[-1])  # noqa: E731
    return k, v, table, gathered(k), gathered(v)


def _check(out, lse, q, k_full, v_full, lengths, causal, **mods):
    for b, n in enumerate(lengths.tolist()):
        qs, got, got_lse = q[b:b + 1], out[b:b + 1], lse[b:b + 1]
        if n:
            check_attention(got, got_lse, qs, k_full[b:b + 1, :n], v_full[b:b + 1, :n], causal,
                            what=f"sequence {b} ({n} keys): ", **mods)
        else:
            assert torch.equal(got, torch.zeros_like(got)) and (got_lse == float("-inf")).all(), \
                f"sequence {b} (no keys): out 0 and lse -inf"


def _run(q, k_cache, v_cache, lengths, table, causal, num_splits, out=None, **mods):
    """forward_kvcache into NaN-poisoned out (or the given ``out``) and lse, with a workspace
    of 0xff bytes of exactly the size asked for; ``mods``: window_size, softcap, learnable_sink."""
    b, sq, hq, d = q.shape
    out = torch.full((b, sq, hq, v_cache.shape[-1]), float("nan"), device="cuda", dtype=q.dtype) if out is None \
        else out
    lse = torch.full((b, hq, sq), float("nan"), device="cuda")
    reach = k_cache.shape[1] * (table.shape[1] if table is not None else 1)
    need = fa4_aot.forward_kvcache_workspace_bytes(b, sq, hq, k_cache.shape[2], d, reach, num_splits=num_splits,
                                                   head_dim_v=v_cache.shape[-1])
    space = torch.full((max(need, 1),), 255, dtype=torch.uint8, device="cuda")
    fa4_aot.forward_kvcache(q, k_cache, v_cache, out, lse, lengths, space if need else None, page_table=table,
                            causal=causal, num_splits=num_splits,
                            stream=torch.cuda.current_stream().cuda_stream, **mods)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("variant", DECODE, ids=lambda v: v.name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_q{c[1]}_h{c[2]}x{c[3]}_k{c[4]}_p{c[5]}")
def test_decode_matches_reference(variant, case, gen, monkeypatch):
    monkeypatch.setattr(fa4_aot.policy, "decode_pairs", lambda *sizes: False)  # each variant's own kernel
    batch, sq, hq, hkv, max_cache, page = case
    dtype, d = DTYPES[variant.dtype], variant.head_dim
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    k, v, table, k_full, v_full = _cache(batch, max_cache, hkv, d, dtype, page, gen)
    lengths = _lengths(batch, max_cache, sq, gen)
    for splits in (None, 1, 3):
        out, lse = _run(q, k, v, lengths, table, variant.causal, splits)
        _check(out, lse, q, k_full, v_full, lengths, variant.causal)


@pytest.mark.parametrize("causal", [False, True])
def test_every_split_count_agrees(causal, gen):
    """num_splits 1 .. the heuristic's choice and more, each against the reference by the
    forward's rule, and bitwise the same on a second run."""
    batch, sq, hq, hkv, d, max_cache = 2, 2, 16, 4, 128, 4096
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v, _, _, _ = _cache(batch, max_cache, hkv, d, torch.bfloat16, None, gen)
    lengths = torch.tensor([4096, 3001], dtype=torch.int32, device="cuda")
    most = max(decode_splits(batch * hkv, max_cache // 128, 132, 128), 8)  # 128: the rows' max_splits
    for splits in range(1, most + 1):
        out, lse = _run(q, k, v, lengths, None, causal, splits)
        again, again_lse = _run(q, k, v, lengths, None, causal, splits)
        assert torch.equal(out, again) and torch.equal(lse, again_lse), f"{splits} splits: not bitwise repeatable"
        _check(out, lse, q, k, v, lengths, causal)


def test_paged_equals_contiguous(gen):
    """The same cache paged (permuted pages of 64) and contiguous: the same bits."""
    batch, sq, hq, hkv, d, max_cache = 3, 1, 32, 8, 128, 1024
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v, table, k_full, v_full = _cache(batch, max_cache, hkv, d, torch.bfloat16, 64, gen)
    lengths = torch.tensor([1024, 77, 500], dtype=torch.int32, device="cuda")
    paged = _run(q, k, v, lengths, table, False, 2)
    contiguous = _run(q, k_full.contiguous(), v_full.contiguous(), lengths, None, False, 2)
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])


@pytest.mark.parametrize("page", [None, 32])
def test_append_then_attend(page, gen):
    """flash_attn_with_kvcache with k, v: written into the cache at cache_seqlens, then
    attended over cache_seqlens + new keys."""
    batch, new, hq, hkv, d, max_cache = 3, 3, 8, 2, 64, 256
    q = torch.randn(batch, new, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache, table, _, _ = _cache(batch, max_cache, hkv, d, torch.bfloat16, page, gen)
    k_new = torch.randn(batch, new, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_new = torch.randn(batch, new, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    lengths = torch.tensor([0, 100, 250], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, page_table=table,
                                       causal=True, return_lse=True)
    torch.cuda.synchronize()
    if table is None:
        k_full, v_full = k_cache, v_cache
    else:
        k_full = k_cache[table.long()].reshape(batch, -1, hkv, d)
        v_full = v_cache[table.long()].reshape(batch, -1, hkv, d)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(k_full[b, n:n + new], k_new[b]) and torch.equal(v_full[b, n:n + new], v_new[b])
    assert torch.equal(lengths, torch.tensor([0, 100, 250], dtype=torch.int32, device="cuda"))
    _check(out, lse, q, k_full, v_full, lengths + new, True)


def test_cuda_graph_replays_with_new_lengths(gen):
    """Captured once; the device-side cache_seqlens changed between replays."""
    batch, sq, hq, hkv, d, max_cache = 4, 1, 32, 8, 128, 2048
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v, _, _, _ = _cache(batch, max_cache, hkv, d, torch.bfloat16, None, gen)
    lengths = torch.tensor([2048, 1, 700, 1500], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, sq, device="cuda")
    need = fa4_aot.forward_kvcache_workspace_bytes(batch, sq, hq, hkv, d, max_cache)
    space = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
    fa4_aot.default_library().preload([v.name for v in MATRIX if v.kind in ("decode", "combine")
                                       and v.dtype == "bf16" and v.head_dim == 128])
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fa4_aot.forward_kvcache(q, k, v, out, lse, lengths, space if need else None,
                                stream=torch.cuda.current_stream().cuda_stream)
    for new in ([2048, 1, 700, 1500], [5, 2000, 0, 129]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, q, k, v, lengths, False)


@pytest.mark.parametrize("page", [None, 32])
def test_kvcache_with_append_traces_and_captures(page, gen):
    """flash_attn_with_kvcache with k, v appended: under torch.compile(fullgraph=True) (the
    fa4_aot::kvcache custom op, the caches declared mutated) and replayed from a CUDA
    graph with the device-side lengths changed, the eager call's outputs and caches, bit
    for bit."""
    batch, new, hq, hkv, d, max_cache = 3, 2, 8, 2, 64, 256
    q = torch.randn(batch, new, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache, table, _, _ = _cache(batch, max_cache, hkv, d, torch.bfloat16, page, gen)
    k_new, v_new = (torch.randn(batch, new, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))

    def step(q, kc, vc, k, v, lengths):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, page_table=table, causal=True,
                                       num_splits=2, window_size=(100, 0), return_lse=True)

    def eager(lengths):
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = step(q, kc, vc, k_new, v_new, lengths)
        return out, lse, kc, vc

    lengths = torch.tensor([0, 100, 250], dtype=torch.int32, device="cuda")
    want = eager(lengths)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = (*torch.compile(step, fullgraph=True)(q, kc, vc, k_new, v_new, lengths), kc, vc)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), got, want):
        assert torch.equal(a, b), f"compiled: {name}"
    kc, vc = k_cache.clone(), v_cache.clone()
    static = lengths.clone()
    step(q, kc.clone(), vc.clone(), k_new, v_new, static)  # warm: modules loaded, launches packed
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(q, kc, vc, k_new, v_new, static)
    for lens in ([7, 0, 200], [250, 3, 60]):
        kc.copy_(k_cache)
        vc.copy_(v_cache)
        static.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = eager(static.clone())
        for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), (*outs, kc, vc), want):
            assert torch.equal(a, b), f"graph replay {lens}: {name}"


def test_a_repeated_call_launches_decode_and_combine_again(gen):
    """DeviceArrays on an int stream: the second call repeats the kept launches (both the
    split decode and its combine): the outputs, poisoned in between, come back the same."""
    from fa4_aot.torch import as_device_array

    batch, sq, hq, hkv, d, max_cache = 2, 1, 32, 8, 128, 8192
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v, _, _, _ = _cache(batch, max_cache, hkv, d, torch.bfloat16, None, gen)
    lengths = torch.tensor([8192, 5000], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq, sq), float("nan"), device="cuda")
    need = fa4_aot.forward_kvcache_workspace_bytes(batch, sq, hq, hkv, d, max_cache, num_splits=4)
    space = torch.empty(need, dtype=torch.uint8, device="cuda")
    args = [as_device_array(t) for t in (q, k, v, out, lse, lengths, space)]
    stream = torch.cuda.current_stream().cuda_stream
    fa4_aot.forward_kvcache(*args, num_splits=4, stream=stream)
    torch.cuda.synchronize()
    first, first_lse = out.clone(), lse.clone()
    _check(out, lse, q, k, v, lengths, False)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    fa4_aot.forward_kvcache(*args, num_splits=4, stream=stream)
    torch.cuda.synchronize()
    assert torch.equal(out, first) and torch.equal(lse, first_lse)


def test_a_serving_loop_repeats_the_kept_launches(gen, monkeypatch):
    """flash_attn_with_kvcache step after step (append one token, attend): from the second
    step the same tensors' addresses repeat the kept launches after the append, and each
    step's out and lse are the reference's on the cache as appended."""
    from fa4_aot.launch.calls import default_library

    library = default_library()
    repeated = []
    real = library.launch_again

    def spy(key, *args, **kwargs):
        done = real(key, *args, **kwargs)
        if key[0] == "kvcache":
            repeated.append(done)
        return done

    monkeypatch.setattr(library, "launch_again", spy)
    batch, hq, hkv, d, max_cache = 2, 16, 4, 128, 600
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v, _, _, _ = _cache(batch, max_cache, hkv, d, torch.bfloat16, None, gen)
    lengths = torch.tensor([300, 7], dtype=torch.int32, device="cuda")
    for step in range(4):
        k_new = torch.randn(batch, 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v_new = torch.randn(batch, 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        out, lse = flash_attn_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=lengths, causal=True,
                                           return_lse=True)
        torch.cuda.synchronize()
        rows = torch.arange(batch, device="cuda")
        assert torch.equal(k[rows, lengths.long()], k_new[:, 0]) and torch.equal(v[rows, lengths.long()], v_new[:, 0])
        _check(out, lse, q, k, v, lengths + 1, True)
        lengths += 1
        del out, lse, k_new, v_new  # a loop that keeps nothing: the next step's tensors take the same addresses
    assert any(repeated), f"no step repeated the kept launches: {repeated}"


# (batch, seqlen_q, heads_q, heads_kv, max_cache, page_size or None): a pair's rows within one tile
PAIRED = [
    (4, 1, 32, 8, 1000, None),  # GQA 4, one token: 8 rows a pair
    (3, 4, 16, 4, 640, 64),  # 4 tokens x 4 heads x 2: 32 rows; pages of 64
    (5, 8, 8, 2, 2048, 16),  # 8 tokens x 4 heads x 2: 64 rows, the whole tile; pages of 16
    (6, 1, 16, 2, 3000, None),  # issue 38's GQA 16:2 at one token, ragged lengths
]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 48, 32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PAIRED, ids=lambda c: f"b{c[0]}_q{c[1]}_h{c[2]}x{c[3]}_k{c[4]}_p{c[5]}")
def test_paired_heads_match_reference(case, causal, d, dtype, gen, monkeypatch):
    """Narrow heads read in pairs (decode.pair_sizes: two adjacent KV heads as one head of
    twice the width on the pairs' kernel, each row's Q and O in its own head's columns):
    against the reference, every split count; the pairing shown taken."""
    import fa4_aot.decode as decode

    views = []
    monkeypatch.setattr(decode, "_pair_view", lambda t, view=decode._pair_view: views.append(t) or view(t))
    batch, sq, hq, hkv, max_cache, page = case
    dtype = DTYPES[dtype]
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    k, v, table, k_full, v_full = _cache(batch, max_cache, hkv, d, dtype, page, gen)
    lengths = _lengths(batch, max_cache, sq, gen)
    for splits in (None, 1, 3):
        views.clear()
        out, lse = _run(q, k, v, lengths, table, causal, splits)
        assert len(views) == 2, "the call was not paired"
        _check(out, lse, q, k_full, v_full, lengths, causal)


def test_heads_apart_are_not_paired(gen):
    """A cache whose heads are not adjacent (every other head of a wider one) is read head
    by head, and right."""
    batch, hq, hkv, d, max_cache = 3, 16, 4, 64, 700
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    wide_k, wide_v = (torch.randn(batch, max_cache, 2 * hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                      for _ in range(2))
    k, v = wide_k[:, :, ::2], wide_v[:, :, ::2]
    lengths = _lengths(batch, max_cache, 1, gen)
    for splits in (1, 2):
        out, lse = _run(q, k, v, lengths, None, False, splits)
        _check(out, lse, q, k, v, lengths, False)
