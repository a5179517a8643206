"""The local forward kernels (sliding windows, attention sinks, softcap) against the
float32 reference with the window, sinks and cap applied, on an sm_90 GPU: dense and
varlen, every built local variant, windows at every edge (0, 1, inside a tile, off the
tile sizes, past the sequence, left-only, right-only, both, with causal), GQA/MQA,
seqlen_q != seqlen_k, rows that see no key (with a sink: out 0, lse the sink), varlen
mixes with empty sequences and windows wider than some of them. Outputs NaN-poisoned,
inputs fresh; the rule is reference.check_attention's."""

import pytest

torch = pytest.importorskip("torch")

import fa4_aot  # noqa: E402
from fa4_aot import decode, policy  # noqa: E402
from fa4_aot.src.sm90.fwd.config import FwdConfig  # noqa: E402
from fa4_aot.errors import OptionError, ShapeError, DTypeError, UnsupportedVariantError  # noqa: E402
from fa4_aot.torch import flash_attn_fwd  # noqa: E402
from fa4_aot.variants import MATRIX  # noqa: E402

from ..reference import check_attention  # noqa: E402
from .test_fwd import DTYPES, _inputs, _poisoned  # noqa: E402
from .test_varlen import _lengths_to_cu, _packed  # noqa: E402

LOCAL = [v for v in MATRIX if v.kind == "fwd" and v.local and not v.varlen]
LOCAL_VARLEN = [v for v in MATRIX if v.kind == "fwd" and v.local and v.varlen]

# (left, right, causal, sinks): each with its edge
CASES = [
    (0, 0, False, False),  # window 0: each query its diagonal key only; rows off the keys see none
    (1, 1, False, True),  # three keys, with sinks
    (5, -1, False, False),  # left-only, narrower than a tile
    (-1, 7, False, True),  # right-only
    (100, 37, False, False),  # both, off every tile size
    (128, 0, False, True),  # gpt-oss's sliding layers: 128 keys back, sinks
    (200, -1, True, False),  # causal with a window: right 0
    (5000, 5000, False, True),  # wider than every sequence
    (-1, -1, False, True),  # sinks alone (gpt-oss's full layers, not causal)
    (-1, -1, True, True),  # sinks alone, causal
]
CASE_IDS = ["w{}_{}{}{}".format(l, r, "_causal" if c else "", "_sink" if s else "") for l, r, c, s in CASES]

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
    (1, 1, 1, 2, 2),  # one token
    (7, 17, 17, 2, 1),  # batch 7, MQA, a partial tile
    (2, 1000, 1000, 4, 2),  # GQA, ragged last q and k tiles
    (2, 128, 1000, 2, 2),  # seqlen_q < seqlen_k: the windows far right
    (2, 1000, 128, 2, 2),  # seqlen_q > seqlen_k: rows that see no key
    (1, 300, 3000, 3, 1),  # many key tiles, most outside a narrow window: skipped
    (1, 500, 700, 4, 1),  # three query tiles at head_dim 64: two a CTA computes the middle one twice
]


def _cap(variant, case_index):
    """Gemma's cap (50: barely bends N(0, 1) scores) or one that bends them hard."""
    return (2.0 if case_index % 2 else 50.0) if variant.softcap else 0.0


def _sinks(heads_q, gen):
    return 2 * torch.randn(heads_q, device="cuda", dtype=torch.float32, generator=gen)


def _run_dense(variant, case, cap, shape, gen, scale=None):
    left, right, causal, sink = case
    q, k, v = _inputs(shape, variant.head_dim, DTYPES[variant.dtype], gen)
    sinks = _sinks(shape[3], gen) if sink else None
    out, lse = _poisoned(q)
    flash_attn_fwd(q, k, v, causal=causal, window_size=(left, right), softcap=cap, learnable_sink=sinks, out=out,
                   lse=lse, softmax_scale=scale, q_tiles=variant.q_tiles)
    torch.cuda.synchronize()
    return q, k, v, sinks, out, lse


def _assert_is_the_sink(lse, sinks):
    """The LSE of rows that see no key: the sink, within 2 float32 ulps."""
    assert ((lse - sinks).abs() <= 2 * 2.0**-23 * sinks.abs()).all(), (lse - sinks).abs().max()


def _mods(case, cap, sinks):
    left, right, causal, _ = case
    return {"window": (left, 0 if causal else right), "softcap": cap, "sink": sinks}


@pytest.mark.parametrize("variant", LOCAL, ids=lambda v: v.name)
@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_local_forward_matches_reference(variant, case, gen):
    cap = _cap(variant, case)
    for shape in SHAPES:
        q, k, v, sinks, out, lse = _run_dense(variant, CASES[case], cap, shape, gen)
        check_attention(out, lse, q, k, v, False, what=f"{shape}: ", **_mods(CASES[case], cap, sinks))


def test_the_local_kernel_is_the_one_launched(gen, monkeypatch):
    """A window takes the local kernel, an unbounded or causal one alone the plain ones,
    a softcap the softcap kernel (the rows each call launches)."""
    library = fa4_aot.default_library()
    launched, launch = [], library.launch
    monkeypatch.setattr(library, "launch", lambda row, *a, **kw: (launched.append(row["name"]), launch(row, *a, **kw)))
    monkeypatch.setattr(library, "launch_again", lambda *a, **kw: False)
    q, k, v = _inputs((1, 300, 300, 2, 2), 128, torch.bfloat16, gen)
    for options, name in (({"window_size": (64, 0)}, "fwd.sm90a.bf16.d128.local"),
                          ({"window_size": (-1, 0)}, "fwd.sm90a.bf16.d128.causal"),
                          ({"window_size": (None, None)}, "fwd.sm90a.bf16.d128"),
                          ({"window_size": (-1, 5), "causal": True}, "fwd.sm90a.bf16.d128.causal"),
                          ({"softcap": 30.0}, "fwd.sm90a.bf16.d128.local.softcap")):
        launched.clear()
        flash_attn_fwd(q, k, v, q_tiles=1, **options)
        assert launched == [name], (options, launched)
    torch.cuda.synchronize()


def _kv_head_order_keys(variant) -> int:
    return FwdConfig.of(variant).kv_head_order_keys


@pytest.mark.parametrize("variant", [v for v in LOCAL if _kv_head_order_keys(v)], ids=lambda v: v.name)
def test_local_long_sequences_launched_by_kv_head_groups(variant, gen):
    """Past the keys where a KV head's query heads launch together (the row's
    config.kv_head_order_keys; GQA 8, a partial last tile): every output row and LSE
    written, and row chunks at the start, middle and end against the reference of the keys
    their windows see: rows [a, b) with keys [a - left, b + right), where the bottom-right
    alignment puts row i's diagonal ``right`` keys further on, so the chunk's window is
    (left + right, 0) (at the sequence's end the keys stop at seqlen: the shift is less)."""
    # the built row's threshold (what its cubin compares with), not the source's
    order_keys = fa4_aot.default_library().manifest.row(variant)["config"]["kv_head_order_keys"]
    assert order_keys > 0, "the row takes no KV-head order"
    seqlen = order_keys + 300
    cap = _cap(variant, 1)
    for case in ((128, 0, False, True), (100, 37, False, False)):
        q, k, v, sinks, out, lse = _run_dense(variant, case, cap, (1, seqlen, seqlen, 16, 2), gen)
        assert not out.isnan().any() and not lse.isnan().any(), "unwritten output rows"
        left, right = case[:2]
        for a in (0, seqlen // 2, seqlen - 300):
            b = min(a + 300, seqlen)
            start, end = max(a - left, 0), min(b + right, seqlen)
            mods = {**_mods(case, cap, sinks), "window": (left + end - b, right - (end - b))}
            rows, keys = (slice(None), slice(a, b)), (slice(None), slice(start, end))
            check_attention(out[rows], lse[:, :, a:b], q[rows], k[keys], v[keys], False, what=f"rows {a}-{b}: ",
                            **mods)


@pytest.mark.parametrize("variant", [v for v in LOCAL if v.dtype == "bf16" and not v.softcap], ids=lambda v: v.name)
def test_local_rows_with_no_key_take_the_sink(variant, gen):
    """Window 0 with seqlen_q > seqlen_k: the first rows see no key: out 0 and lse the
    sink (taken as sink * log2(e), then back: within 2 float32 ulps), -inf without sinks."""
    shape = (1, 300, 100, 2, 2)
    for sink in (False, True):
        q, k, v, sinks, out, lse = _run_dense(variant, (0, 0, False, sink), 0.0, shape, gen)
        blind = 200  # rows i with i + 100 - 300 < 0
        assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
        if sink:
            _assert_is_the_sink(lse[:, :, :blind], sinks[None, :, None].expand(1, 2, blind))
        else:
            assert (lse[:, :, :blind] == float("-inf")).all()


@pytest.mark.parametrize("variant", [v for v in LOCAL if v.dtype == "bf16" and v.head_dim == 128], ids=lambda v: v.name)
def test_local_with_a_large_scale_takes_the_rescaling_paths(variant, gen):
    """Scores ~20x larger (softmax_scale 2.0): rows whose maximum moves past the rescaling
    threshold inside a window, and large sinks against them."""
    for case in (CASES[4], CASES[5]):
        cap = 50.0 if variant.softcap else 0.0
        q, k, v, sinks, out, lse = _run_dense(variant, case, cap, (2, 700, 900, 2, 1), gen, scale=2.0)
        check_attention(out, lse, q, k, v, False, 2.0, **_mods(case, cap, sinks))


# (query lengths, key lengths, heads_q, heads_kv), each mix with its edge
MIXES = [
    ([1, 0, 130, 257, 64], [1, 5, 130, 300, 1000], 4, 4),  # one-token, empty, tile +-1, sq != sk
    ([700, 3, 0, 191], [700, 3, 0, 193], 6, 2),  # GQA; an empty sequence in both q and k
    ([129, 40], [20, 511], 8, 1),  # MQA; rows that see no key (sq > sk)
]


@pytest.mark.parametrize("variant", LOCAL_VARLEN, ids=lambda v: v.name)
@pytest.mark.parametrize("case", [0, 1, 4, 5, 6, 7], ids=[CASE_IDS[i] for i in (0, 1, 4, 5, 6, 7)])
def test_local_varlen_matches_reference(variant, case, gen):
    """Each sequence's window within it (windows wider than some sequences); rows of no
    sequence unwritten."""
    from fa4_aot.torch import flash_attn_varlen_fwd

    left, right, causal, sink = CASES[case]
    cap = _cap(variant, case)
    dtype, d = DTYPES[variant.dtype], variant.head_dim
    for lq, lk, hq, hkv in MIXES:
        q, k, v = _packed(lq, hq, d, dtype, gen), _packed(lk, hkv, d, dtype, gen), _packed(lk, hkv, d, dtype, gen)
        sinks = _sinks(hq, gen) if sink else None
        out = torch.full_like(q, float("nan"))
        lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda")
        flash_attn_varlen_fwd(q, k, v, _lengths_to_cu(lq), _lengths_to_cu(lk), max(lq), max(lk), causal=causal,
                              window_size=(left, right), softcap=cap, learnable_sink=sinks, out=out, lse=lse)
        torch.cuda.synchronize()
        at_q = at_k = 0
        for sq, sk in zip(lq, lk):
            if sq:
                got, got_lse = out[at_q:at_q + sq][None], lse[:, at_q:at_q + sq][None]
                qs, ks, vs = q[at_q:at_q + sq][None], k[at_k:at_k + sk][None], v[at_k:at_k + sk][None]
                if sk:
                    check_attention(got, got_lse, qs, ks, vs, False, what=f"sequence {sq} x {sk}: ",
                                    **_mods(CASES[case], cap, sinks))
                else:  # no key: out 0, lse the sink or -inf
                    assert torch.equal(got, torch.zeros_like(got))
                    if sink:
                        _assert_is_the_sink(got_lse, sinks[None, :, None].expand_as(got_lse))
                    else:
                        assert (got_lse == float("-inf")).all()
            at_q, at_k = at_q + sq, at_k + sk


def test_local_bad_options_are_refused_before_launch(gen):
    """Typed errors for every bad window, cap and sink; out stays poisoned."""
    q, k, v = _inputs((1, 64, 64, 4, 2), 128, torch.bfloat16, gen)
    out, lse = _poisoned(q)
    good = torch.zeros(4, device="cuda")
    bad = [({"window_size": (-2, 0)}, OptionError), ({"window_size": (0, -5)}, OptionError),
           ({"window_size": (1.5, 0)}, OptionError), ({"window_size": (True, 0)}, OptionError),
           ({"window_size": (1, 2, 3)}, OptionError), ({"window_size": "128"}, OptionError),
           ({"softcap": float("inf")}, OptionError), ({"softcap": float("nan")}, OptionError),
           ({"softcap": -1.0}, OptionError), ({"softcap": True}, OptionError),
           ({"learnable_sink": torch.zeros(3, device="cuda")}, ShapeError),
           ({"learnable_sink": torch.zeros(4, 1, device="cuda")}, ShapeError),
           ({"learnable_sink": torch.zeros(4, device="cuda", dtype=torch.bfloat16)}, DTypeError),
           ({"learnable_sink": torch.zeros(8, device="cuda")[::2]}, fa4_aot.Fa4AotError),
           ({"learnable_sink": torch.zeros(4)}, fa4_aot.Fa4AotError),
           ({"learnable_sink": good, "q_tiles": 3}, OptionError),
           ({"learnable_sink": lse.view(-1)[:4]}, fa4_aot.Fa4AotError)]  # over lse, which is written
    for options, error in bad:
        with pytest.raises(error):
            flash_attn_fwd(q, k, v, out=out, lse=lse, **options)
        torch.cuda.synchronize()
        assert out.isnan().all() and lse.isnan().all(), options
    q, k, v = _inputs((1, 64, 64, 4, 2), 256, torch.bfloat16, gen)
    out, lse = _poisoned(q)
    with pytest.raises(UnsupportedVariantError, match="do not fit"):  # two Q buffers at head_dim 256
        flash_attn_fwd(q, k, v, out=out, lse=lse, learnable_sink=good, q_tiles=2)
    torch.cuda.synchronize()
    assert out.isnan().all() and lse.isnan().all()


def test_local_func_traces_under_torch_compile(gen):
    """flash_attn_func with a window, sinks and a cap under torch.compile(fullgraph=True):
    the custom op takes them (no graph break), with the eager call's results."""
    from fa4_aot.torch import flash_attn_func

    q, k, v = _inputs((2, 300, 300, 4, 2), 64, torch.bfloat16, gen)
    sinks = _sinks(4, gen)

    def attend(q, k, v, sinks):
        return flash_attn_func(q, k, v, causal=True, window_size=(100, 0), learnable_sink=sinks)

    with torch.no_grad():
        eager = attend(q, k, v, sinks)
        traced = torch.compile(attend, fullgraph=True)(q, k, v, sinks)
    assert torch.equal(eager, traced)


DECODE_LOCAL = [v for v in MATRIX if v.kind == "decode" and v.local and v.kv_dtype == "same"]  # FP8: test_fp8_cache
# (batch, seqlen_q, heads_q, heads_kv, max_cache, page_size or None), as test_decode's
DECODE_CASES = [(4, 1, 32, 8, 1000, None), (3, 4, 8, 8, 640, 128), (4, 16, 16, 1, 300, 48), (5, 64, 4, 2, 2048, 16),
                (6, 1, 24, 2, 900, None),  # 12 packed rows: a warp's rows 8-15 in use in some threads only
                (3, 16, 10, 2, 500, 32)]  # 80 packed rows: a second row tile of 16


def test_local_decode_matches_reference_where_built(gen, monkeypatch):
    """Decode with a window (starting mid-page, ragged cache lengths, random page tables),
    sinks and softcap, split and not, against the reference over each sequence's cache
    (its queries at the end); where no local decode is built, the call is refused before
    anything is written."""
    if not DECODE_LOCAL:
        q = torch.randn(1, 1, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((1, 4, 1), float("nan"), device="cuda")
        lengths = torch.tensor([64], dtype=torch.int32, device="cuda")
        with pytest.raises(UnsupportedVariantError):
            fa4_aot.forward_kvcache(q, k, k, out, lse, lengths, window_size=(16, 0),
                                    stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert out.isnan().all() and lse.isnan().all()
        return
    chosen, span_row = [], decode.span_row  # the rows the calls take
    monkeypatch.setattr(decode, "span_row", lambda *a: chosen.append(span_row(*a)) or chosen[-1])
    # kept launches are keyed by the arrays and options, not by the policy forced here: the
    # same call at the same addresses would repeat the last variant's kernel
    monkeypatch.setattr(fa4_aot.default_library(), "launch_again", lambda *a, **kw: False)
    for variant in DECODE_LOCAL:  # each on its own kernel: the span-narrow ones where the policy is told to
        monkeypatch.setattr(policy, "decode_narrow", lambda *_, narrow=variant.span == "narrow": narrow)
        chosen.clear()
        cap = 30.0 if variant.softcap else 0.0
        for case, window in zip(DECODE_CASES, [(100, 0), (37, 5), (0, 0), (200, 0), (50, 0), (20, 3)], strict=True):
            _decode_matches_reference(variant, case, window, gen, variant.head_dim, cap)
        assert {r["name"] for r in chosen} == {variant.name}, (variant.name, {r["name"] for r in chosen})


NARROW_LOCAL = [v for v in DECODE_LOCAL if v.span == "narrow"]


@pytest.mark.parametrize("variant", NARROW_LOCAL, ids=lambda v: v.name)
def test_local_decode_walks_more_items_than_ctas(variant, gen, monkeypatch):
    """The span-narrow kernels launch a CTA a slot at most (config persistent), each
    walking (row tile x split, KV head, sequence) items: a batch of over twice as many items
    as the GPU's slots, ragged cache lengths (0 and 1 among them), a window from mid-page,
    contiguous and paged, split and not, against the reference (two query tokens: eight
    query heads a KV head give each check several rows)."""
    cfg = fa4_aot.default_library().manifest.row(variant)["config"]
    assert cfg["persistent"]
    slots = torch.cuda.get_device_properties(0).multi_processor_count * cfg["ctas_per_sm"]
    chosen, span_row = [], decode.span_row  # the rows the calls take
    monkeypatch.setattr(decode, "span_row", lambda *a: chosen.append(span_row(*a)) or chosen[-1])
    monkeypatch.setattr(policy, "decode_narrow", lambda *_: True)
    monkeypatch.setattr(fa4_aot.default_library(), "launch_again", lambda *a, **kw: False)  # as above
    batch = 2 * slots // 8 + 5  # eight KV heads a sequence, one row tile: items = 8 x batch x splits
    # every output written; against the reference the first CTAs' first items (lengths 0, 1
    # and the whole cache among them) and sequences their second and third items reach
    second = slots // 8
    sequences = [0, 1, 2, 3, second - 1, second, second + 1, 2 * second, 2 * second + 1, batch - 1]
    for page, window in ((None, (100, 0)), (48, (37, 1))):
        _decode_matches_reference(variant, (batch, 2, 64, 8, 400, page), window, gen, 64, sequences=sequences)
    assert {r["name"] for r in chosen} == {variant.name}


# the local kernels that read two adjacent KV heads of 64 columns as one (config pairs)
PAIRED_LOCAL = [v for v in DECODE_LOCAL if v.head_dim == 128 and not v.softcap and v.span == "any"]
PAIR_CASES = [(4, 1, 64, 8, 1000, None), (3, 4, 32, 8, 700, 64), (5, 1, 16, 2, 2048, 16), (2, 2, 8, 4, 300, None)]


@pytest.mark.parametrize("variant", PAIRED_LOCAL, ids=lambda v: v.name)
def test_local_decode_reads_narrow_heads_in_pairs(variant, gen, monkeypatch):
    """Sinks with no window behind (gpt-oss's full layers) on a cache of 64-column heads:
    two adjacent KV heads read as one on the d128 local kernel (policy.decode_pairs, told
    to pair these short caches too), each row its own head's Q, O and sink, against the
    reference over ragged cache lengths; contiguous and paged (random page tables), split
    and not, one query token and more."""
    chosen, span_row = [], decode.span_row  # the rows the calls take
    monkeypatch.setattr(decode, "span_row", lambda *a: chosen.append(span_row(*a)) or chosen[-1])
    monkeypatch.setattr(policy, "DECODE_LOCAL_PAIR_MIN_KEYS", 0)  # pairs on these short caches too
    monkeypatch.setattr(fa4_aot.default_library(), "launch_again", lambda *a, **kw: False)  # as above

    def paired():  # each launch on the pairs' kernel
        assert [r["name"] for r in chosen] == [variant.name] and chosen[0]["config"]["pairs"]
        chosen.clear()

    for case, window in zip(PAIR_CASES, [(-1, -1), (-1, 0), (-1, -1), (-1, 3)]):
        _decode_matches_reference(variant, case, window, gen, 64, after=paired)


def _decode_matches_reference(variant, case, window, gen, d, cap=0.0, after=None, sequences=None):
    """A decode ``case`` (batch, seqlen_q, heads_q, heads_kv, max_cache, page size or None)
    of a cache ``d`` columns a head in ``variant``'s dtype, with ``window``, sinks and a cap
    ``cap``, split and not, against the reference over each sequence's cache (its queries at
    the end): a sequence with no key gives out 0 and its sink as LSE. ``after``: called
    after each launch. ``sequences``: those checked against the reference (None: all;
    every output is checked written either way)."""
    from .test_decode import _cache, _lengths

    batch, sq, hq, hkv, max_cache, page = case
    dtype = DTYPES[variant.dtype]
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    k, v, table, k_full, v_full = _cache(batch, max_cache, hkv, d, dtype, page, gen)
    lengths = _lengths(batch, max_cache, sq, gen)
    sinks = _sinks(hq, gen)
    for splits in (None, 1, 3):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((batch, hq, sq), float("nan"), device="cuda")
        reach = k.shape[1] * (table.shape[1] if table is not None else 1)
        need = fa4_aot.forward_kvcache_workspace_bytes(batch, sq, hq, hkv, d, reach, num_splits=splits)
        space = torch.full((max(need, 1),), 255, dtype=torch.uint8, device="cuda")
        fa4_aot.forward_kvcache(q, k, v, out, lse, lengths, space if need else None, page_table=table,
                                num_splits=splits, window_size=window, softcap=cap, learnable_sink=sinks,
                                stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        if after is not None:
            after()
        assert not out.isnan().any() and not lse.isnan().any(), (variant.name, window, splits)
        for b, n in enumerate(lengths.tolist()):
            if sequences is not None and b not in sequences:
                continue
            what = f"{variant.name} {window} splits {splits}, sequence {b} ({n} keys): "
            got, got_lse = out[b:b + 1], lse[b:b + 1]
            if n:
                check_attention(got, got_lse, q[b:b + 1], k_full[b:b + 1, :n], v_full[b:b + 1, :n], False,
                                what=what, window=window, softcap=cap, sink=sinks)
            else:  # no key: out 0, lse the sink
                assert torch.equal(got, torch.zeros_like(got)), what
                _assert_is_the_sink(got_lse, sinks[None, :, None].expand_as(got_lse))
