"""Decode's input checks (fa4_aot.forward_kvcache): every bad argument is a typed error
before any launch; a good call packs the decode kernel's plan (and the combine's where
it splits); the split heuristic and the workspace size."""

import itertools

import pytest

from fa4_aot import policy
from fa4_aot.launch.arrays import DeviceArray
from fa4_aot.errors import DTypeError, Fa4AotError, LayoutError, OptionError, ShapeError
from fa4_aot.decode import check_forward_kvcache, check_limits, forward_kvcache, forward_kvcache_workspace_bytes

# the decode rows' limits (checked against the build in test_the_rows_limits_are_the_builds)
LIMITS = {"max_splits": 128, "max_seqlen_q": 128, "page_align": 16}
MAX_SEQLEN_Q = LIMITS["max_seqlen_q"]

BASE = 0x7F0000000000
_ARRAYS = itertools.count(1)


def fresh() -> int:
    """An address no other array of these tests takes: each array its own memory."""
    return BASE + next(_ARRAYS) * (1 << 36)


def bshd(b, s, h, d, dtype="bf16", strides=None, ptr=None):
    ptr = fresh() if ptr is None else ptr
    return DeviceArray(ptr, (b, s, h, d), strides or (s * h * d, h * d, d, 1), dtype, 0)


def ints(shape, ptr=None, dtype="i32", strides=None):
    ptr = fresh() if ptr is None else ptr
    shape = tuple(shape)
    contiguous = tuple(1 if i == len(shape) - 1 else shape[-1] for i in range(len(shape)))
    return DeviceArray(ptr, shape, strides or contiguous, dtype, 0)


def arrays(paged=False, **over):
    a = {"q": bshd(4, 1, 32, 128), "out": bshd(4, 1, 32, 128), "lse": DeviceArray(BASE, (4, 32, 1), (32, 1, 1), "fp32", 0),
         "cache_seqlens": ints((4,))}
    if paged:
        a.update(k_cache=bshd(40, 64, 8, 128), v_cache=bshd(40, 64, 8, 128), page_table=ints((4, 10)))
    else:
        a.update(k_cache=bshd(4, 1000, 8, 128), v_cache=bshd(4, 1000, 8, 128))
    a.update(over)
    return {n: x for n, x in a.items() if x is not None}


def test_good_problems_pass():
    sizes = check_forward_kvcache(arrays())
    assert (sizes["batch"], sizes["heads_kv"], sizes["max_seqlen_k"], sizes["paged"]) == (4, 8, 1000, 0)
    sizes = check_forward_kvcache(arrays(paged=True))
    assert (sizes["cache_rows"], sizes["cache_pages"], sizes["max_pages"], sizes["max_seqlen_k"]) == (64, 40, 10, 640)


@pytest.mark.parametrize("over, paged, error, message", [
    ({"q": bshd(4, 1, 32, 128, "fp32")}, False, DTypeError, "bf16 or fp16"),
    ({"k_cache": bshd(4, 1000, 8, 128, "fp16")}, False, DTypeError, "one dtype"),
    ({"k_cache": bshd(3, 1000, 8, 128), "v_cache": bshd(3, 1000, 8, 128)}, False, ShapeError, "without a page_table"),
    ({"v_cache": bshd(4, 999, 8, 128)}, False, ShapeError, "k_cache's"),
    ({"k_cache": bshd(4, 1000, 8, 64), "v_cache": bshd(4, 1000, 8, 64)}, False, ShapeError, "head_dim"),
    ({"k_cache": bshd(4, 1000, 5, 128), "v_cache": bshd(4, 1000, 5, 128)}, False, ShapeError, "multiple of heads_kv"),
    ({"q": bshd(4, MAX_SEQLEN_Q + 1, 32, 128), "out": bshd(4, MAX_SEQLEN_Q + 1, 32, 128),
      "lse": DeviceArray(BASE, (4, 32, MAX_SEQLEN_Q + 1), (32 * (MAX_SEQLEN_Q + 1), MAX_SEQLEN_Q + 1, 1), "fp32", 0)},
     False, ShapeError, "seqlen_q"),
    ({"out": bshd(4, 2, 32, 128)}, False, ShapeError, "q's .batch, seqlen_q, heads_q"),
    ({"lse": DeviceArray(BASE, (4, 1, 32), (32, 32, 1), "fp32", 0)}, False, ShapeError, "batch, heads_q, seqlen_q"),
    ({"lse": DeviceArray(BASE, (4, 32, 1), (32, 1, 1), "bf16", 0)}, False, DTypeError, "fp32"),
    ({"cache_seqlens": ints((4,), dtype="fp32")}, False, DTypeError, "int32"),
    ({"cache_seqlens": ints((5,))}, False, ShapeError, r"\(4,\)"),
    ({"cache_seqlens": ints((4,), strides=(2,))}, False, LayoutError, "contiguous"),
    ({"cache_seqlens": ints((4,), ptr=BASE + 2)}, False, LayoutError, "4-byte"),
    ({"page_table": ints((3, 10))}, True, ShapeError, "page_table"),
    ({"page_table": ints((4, 10), dtype="fp32")}, True, DTypeError, "int32"),
    ({"page_table": ints((4, 10), strides=(20, 1))}, True, LayoutError, "contiguous"),
    ({"k_cache": bshd(40, 40, 8, 128), "v_cache": bshd(40, 40, 8, 128)}, True, ShapeError, "multiple of 16"),
    ({"k_cache": bshd(4, 1000, 8, 128, strides=(1000 * 1024, 1024, 128, 2))}, False, LayoutError, "contiguous"),
    ({"q": bshd(4, 1, 32, 128, ptr=BASE + 8)}, False, LayoutError, "16-byte"),
])
def test_bad_inputs(over, paged, error, message):
    with pytest.raises(error, match=message):
        check_limits(check_forward_kvcache(arrays(paged, **over)), LIMITS)


def test_the_rows_limits_are_the_builds(built):
    from fa4_aot.launch.manifest import Manifest

    assert Manifest(built[0]).rows["decode.sm90a.bf16.d128"]["limits"] == LIMITS


class _FakeLibrary:
    """Records the launches instead of making them (no driver, no GPU)."""

    def __init__(self, manifest):
        self.manifest = manifest
        self.launches = []

    def arch(self, device):
        return "sm90a"

    def launch_again(self, key, waits=(), aliases=()):
        return False

    def sm_count(self, device):
        return 132

    def launch(self, row, device, stream, values, tensors, key=None, waits=(), aliases=(), then=()):
        self.issue(self.prepare(row, device, stream, values, tensors, then), key, waits, aliases)

    def prepare(self, row, device, stream, values, tensors, then=()):
        return [(row, values, tensors), *then]

    def issue(self, prepared, key=None, waits=(), aliases=()):
        self.launches += prepared
        self.kept = getattr(self, "kept", []) + [(key, aliases, len(prepared) - 1)]


def _every_slot_given(row, values, tensors):
    from fa4_aot.launch.loader import launch_values, missing_sources

    assert not missing_sources(row["launches"][0], launch_values(row, values), tensors)


def _call(a, library, **options):
    forward_kvcache(a["q"], a["k_cache"], a["v_cache"], a["out"], a["lse"], a.get("cache_seqlens"), a.get("workspace"),
                    page_table=a.get("page_table"), library=library, **options)


def test_one_split_launches_the_decode_alone(built):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    _call(arrays(), library, num_splits=1)
    (row, values, tensors), = library.launches
    assert row["name"] == "decode.sm90a.bf16.d128"
    _every_slot_given(row, values, tensors)
    from fa4_aot.launch.loader import grid_of, launch_values

    assert (values["splits"], values["paged"], launch_values(row, values)["piece_rows"]) == (1, 0, 128)
    assert grid_of(row["launches"][0], values) == (1, 8, 4)  # 4 query heads x 1 token of a KV head: one tile


def test_splits_launch_the_combine_on_a_carved_workspace(built):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    need = forward_kvcache_workspace_bytes(4, 1, 32, 8, 128, 640, num_splits=3, library=library)
    space = DeviceArray(BASE + 4096, (need,), (1,), "u8", 0)
    _call(arrays(paged=True, workspace=space), library, num_splits=3)
    (decode, values, tensors), (combine, _, _) = library.launches
    assert (decode["name"], combine["name"]) == ("decode.sm90a.bf16.d128", "combine.sm90a.bf16.d128")
    _every_slot_given(decode, values, tensors)
    _every_slot_given(combine, values, tensors)
    from fa4_aot.launch.loader import launch_values

    assert launch_values(decode, values)["piece_rows"] == 64 and values["paged"] == 1 and values["splits"] == 3
    assert decode["tensormaps"]["k_cache"]["box"][1] == "piece_rows"  # pieces of the pages' 64 rows
    assert tensors["lse_partial"]["ptr"] - tensors["o_partial"]["ptr"] >= 3 * 4 * 32 * 128 * 4
    with pytest.raises(ShapeError, match="workspace"):
        _call(arrays(paged=True), _FakeLibrary(Manifest(folder)), num_splits=3)
    with pytest.raises(ShapeError, match="bytes"):
        small = DeviceArray(BASE + 4096, (need - 1,), (1,), "u8", 0)
        _call(arrays(paged=True, workspace=small), _FakeLibrary(Manifest(folder)), num_splits=3)


@pytest.mark.parametrize("splits", [0, -1, 129, 2.0, True, "2"])  # 129: past the rows' max_splits
def test_bad_split_counts(built, splits):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    with pytest.raises(OptionError, match="num_splits"):
        _call(arrays(), _FakeLibrary(Manifest(folder)), num_splits=splits)


def test_everything_is_a_typed_error(built):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    for bad in ({"causal": "yes"}, {"softmax_scale": float("nan")}, {"stream": -1}):
        with pytest.raises(Fa4AotError):
            _call(arrays(), _FakeLibrary(Manifest(folder)), **bad)


@pytest.mark.parametrize("ctas, tiles, want", [
    (64, 256, 2),  # 8 sequences x 8 KV heads x 32k keys: one wave of 128
    (8, 1024, 16),  # 1 x 8 x 128k keys
    (512, 32, 1),  # 64 x 8 x 4k keys: the SMs are full already
    (1, 1, 1),  # one key tile cannot split
    (16, 4, 1),  # 512 keys (or a 128-key window's tiles) on 16 CTAs: the combine costs more than it saves
    (32, 9, 3),  # a 1024-key window on 32 CTAs: split
])
def test_split_heuristic(ctas, tiles, want):
    assert policy.decode_splits(ctas, tiles, 132, LIMITS["max_splits"]) == want
    assert policy.decode_splits(ctas, tiles, 132, LIMITS["max_splits"]) <= max(tiles, 1)


def test_a_split_call_is_kept_as_one_plan_under_its_values_and_ids(built):
    """The decode and its combine under one key (one launch call of both rows), with the raw
    API's id key as an alias pinning the arrays (fa4_aot.launch.calls.repeat_key)."""
    from fa4_aot.launch.calls import repeat_key
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    need = forward_kvcache_workspace_bytes(4, 1, 32, 8, 128, 1000, num_splits=2, library=library)
    a = arrays(workspace=DeviceArray(BASE + 4096, (need,), (1,), "u8", 0))
    _call(a, library, num_splits=2)
    (key, aliases, rows_after), = library.kept  # one launch call: the decode, then the combine
    assert rows_after == 1 and [r["name"] for r, _, _ in library.launches] == ["decode.sm90a.bf16.d128",
                                                                               "combine.sm90a.bf16.d128"]
    given = tuple(a[n] for n in ("q", "k_cache", "v_cache", "out", "lse", "cache_seqlens", "workspace"))
    (alias, pinned), = aliases
    assert pinned == given
    assert alias == repeat_key("decode", given, (False, True, True, True, True, False, None, 2, (-1, -1), 0.0,
                                                 policy.DECODE_TURN_STRIDE), 0)


def test_the_workspace_size_needs_no_gpu(built):
    """Without sm_count and num_splits, forward_kvcache_workspace_bytes asks no GPU: it
    sizes for the most splits the call could pick on any GPU, so at least what it picks
    on the H200's 132 SMs or any other count."""
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    library.sm_count = None  # asked: a TypeError
    for b, hkv, keys in ((1, 8, 32768), (8, 8, 32768), (64, 8, 4096), (4, 1, 100)):
        bound = forward_kvcache_workspace_bytes(b, 1, hkv * 4, hkv, 128, keys, library=library)
        for sms in (1, 78, 132, 1000):
            assert forward_kvcache_workspace_bytes(b, 1, hkv * 4, hkv, 128, keys, library=library,
                                                   sm_count=sms) <= bound


def test_without_lengths_the_kernel_reads_the_whole_cache(built):
    """cache_seqlens None: full_cache 1 (the kernel reads no lengths); given: 0."""
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    for lengths, full in ((None, 1), (ints((4,)), 0)):
        library.launches = []
        _call(arrays(cache_seqlens=lengths), library, num_splits=1)
        (row, values, tensors), = library.launches
        _every_slot_given(row, values, tensors)
        assert values["full_cache"] == full


def _dense(b, sq, hq, hkv, d, sk, **over):
    a = {"q": bshd(b, sq, hq, d), "k": bshd(b, sk, hkv, d), "v": bshd(b, sk, hkv, d), "out": bshd(b, sq, hq, d),
         "lse": DeviceArray(fresh(), (b, hq, sq), (hq * sq, sq, 1), "fp32", 0)}
    a.update(over)
    return a


def test_dense_decode_shapes_take_the_decode_kernel(built):
    """fa4_aot.forward of a decode shape (policy.dense_decode): the decode kernel on the
    whole k, v (full_cache 1), split with a workspace of forward_workspace_bytes, its
    combine after; a call that names q_tiles, or without the workspace a split shape, or a
    prefill shape: the prefill kernel."""
    from fa4_aot import forward, forward_workspace_bytes
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    shape = (2, 1, 32, 8, 128, 8192)
    need = forward_workspace_bytes(*shape, sm_count=132, library=library)
    assert need > 0 and need <= forward_workspace_bytes(*shape, library=library)  # no GPU asked: the most
    space = DeviceArray(fresh(), (need,), (1,), "u8", 0)
    a = _dense(*shape)
    forward(*a.values(), workspace=space, library=library)
    (row, values, tensors), (combine, _, _) = library.launches
    assert (row["name"], combine["name"]) == ("decode.sm90a.bf16.d128", "combine.sm90a.bf16.d128")
    _every_slot_given(row, values, tensors)
    assert values["full_cache"] == 1 and values["splits"] > 1 and values["max_seqlen_k"] == 8192
    for call in (dict(workspace=space, q_tiles=1), {}):  # prefill asked for; no workspace for the splits
        library.launches = []
        forward(*_dense(*shape).values(), library=library, **call)
        assert [r["name"] for r, _, _ in library.launches] == ["fwd.sm90a.bf16.d128"], call
    for prefill in ((2, 128, 32, 8, 128, 8192), (2, 1, 32, 8, 128, 256)):  # rows; keys
        assert forward_workspace_bytes(*prefill, sm_count=132, library=library) == 0
        library.launches = []
        forward(*_dense(*prefill).values(), workspace=space, library=library)
        assert [r["name"] for r, _, _ in library.launches] == ["fwd.sm90a.bf16.d128"], prefill
    # enough sequences to fill the GPU unsplit: the decode kernel without a workspace
    wide = (64, 1, 32, 8, 128, 4096)
    assert forward_workspace_bytes(*wide, sm_count=132, library=library) == 0
    library.launches = []
    forward(*_dense(*wide).values(), library=library)
    (row, values, _), = library.launches
    assert row["name"] == "decode.sm90a.bf16.d128" and values["splits"] == 1


def test_a_dense_decode_call_with_too_small_a_workspace_is_refused(built):
    from fa4_aot import forward, forward_workspace_bytes
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    shape = (2, 1, 32, 8, 128, 8192)
    need = forward_workspace_bytes(*shape, sm_count=132, library=library)
    with pytest.raises(ShapeError):
        forward(*_dense(*shape).values(), workspace=DeviceArray(fresh(), (need - 256,), (1,), "u8", 0),
                library=library)
    assert library.launches == []


@pytest.mark.parametrize("shape, sm_count, want", [
    ((16, 1, 32, 8, 32768), 132, True),  # group 4, GPU full: reuse
    ((16, 64, 32, 8, 32768), 132, False),  # group 4 x 64 tokens: 4 row tiles, more than half the group
    ((16, 32, 64, 8, 8192), 132, True),  # group 8 x 32: 4 tiles, half the group
    ((16, 16, 32, 16, 8192), 132, True),  # group 2, one tile
    ((16, 1, 16, 16, 32768), 132, False),  # MHA with the GPU full
    ((2, 1, 16, 16, 8192), 132, True),  # MHA, 32 prefill CTAs: the splits fill the GPU
    ((2, 1, 16, 16, 2048), 132, False),  # ... not at 2048 keys
    ((2, 1, 32, 8, 512), 132, False),  # group 4 below a full GPU: too few keys for the splits
    ((2, 1, 32, 8, 2048), 132, True),
    ((2, 1, 16, 16, 2048), None, False),  # on any GPU: neither regime
    ((2, 1, 32, 8, 512), None, True),  # a GPU small enough is full
])
def test_dense_decode_policy(shape, sm_count, want):
    assert policy.dense_decode(*shape, sm_count) is want


def test_no_decode_shape_has_more_query_tokens_than_the_callers_ask_for():
    """torch's flash_attn_fwd asks no workspace past DENSE_DECODE_MAX_SEQLEN_Q query tokens."""
    most = policy.DENSE_DECODE_MAX_SEQLEN_Q
    for group in (1, 2, 3, 4, 8, 16, 64):
        for sq in range(most + 1, most + 200):
            for batch, sms in ((1, None), (1, 132), (64, 132)):
                assert not policy.dense_decode(batch, sq, group * 2, 2, 1 << 20, sms), (group, sq, batch, sms)


# ------------------------------------------------------------------ an FP8 cache
def fp8(paged=False, **over):
    """arrays() with e4m3 caches."""
    cache = (40, 64, 8, 128) if paged else (4, 1000, 8, 128)
    return arrays(paged=paged, **{"k_cache": bshd(*cache, "e4m3"), "v_cache": bshd(*cache, "e4m3"), **over})


def scales(shape=(4, 8), dtype="fp32", strides=None, ptr=None):
    ptr = fresh() if ptr is None else ptr
    strides = strides if strides is not None else tuple(1 if i == len(shape) - 1 else shape[-1]
                                                        for i in range(len(shape)))
    return DeviceArray(ptr, tuple(shape), strides, dtype, 0)


@pytest.mark.parametrize("descale", [None, scales(), scales(()), scales((1,)), scales(strides=(0, 0)),
                                     scales(strides=(1, 4))])
def test_fp8_caches_with_scales_pass(descale):
    given = {"k_descale": descale, "v_descale": descale}
    assert check_forward_kvcache(fp8(**given))["kv_dtype"] == "e4m3"
    assert check_forward_kvcache(fp8(paged=True, **given))["kv_dtype"] == "e4m3"
    assert check_forward_kvcache(arrays())["kv_dtype"] == "same"


@pytest.mark.parametrize("over, error, message", [
    ({"v_cache": bshd(4, 1000, 8, 128)}, DTypeError, "one dtype"),  # k e4m3, v bf16
    ({"q": bshd(4, 1, 32, 128, "e4m3")}, DTypeError, "q and out must be bf16 or fp16"),
    ({"out": bshd(4, 1, 32, 128, "e4m3")}, DTypeError, "q and out must be bf16 or fp16"),
    ({"k_descale": scales((4, 9))}, ShapeError, "batch, heads_kv"),
    ({"v_descale": scales((4,))}, ShapeError, "batch, heads_kv"),
    ({"k_descale": scales(dtype="fp16")}, DTypeError, "float32"),
    ({"v_descale": scales(strides=(-8, 1))}, LayoutError, "negative"),
    ({"k_descale": scales(ptr=BASE + 2)}, LayoutError, "4-byte"),
])
def test_fp8_refusals(over, error, message):
    with pytest.raises(error, match=message):
        check_forward_kvcache(fp8(**over))


def test_scales_for_a_16_bit_cache_are_refused():
    with pytest.raises(DTypeError, match="FP8"):
        check_forward_kvcache(arrays(k_descale=scales()))


def test_an_fp8_row_must_be_whole_16_byte_units():
    from fa4_aot.errors import UnsupportedVariantError

    with pytest.raises(UnsupportedVariantError, match="multiples of 16"):
        check_forward_kvcache(arrays(q=bshd(4, 1, 32, 72), out=bshd(4, 1, 32, 72), k_cache=bshd(4, 1000, 8, 72, "e4m3"),
                                     v_cache=bshd(4, 1000, 8, 72, "e4m3")))


@pytest.mark.parametrize("descale, want", [(None, (0, 0, 0)), (scales(), (8, 1, 1)), (scales(()), (0, 0, 1)),
                                           (scales(strides=(0, 0)), (0, 0, 1))])
def test_an_fp8_call_launches_the_fp8_row_with_its_scales(built, descale, want):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    a = fp8()
    forward_kvcache(a["q"], a["k_cache"], a["v_cache"], a["out"], a["lse"], a["cache_seqlens"], library=library,
                    num_splits=1, k_descale=descale, v_descale=descale)
    (row, values, tensors), = library.launches
    assert row["name"] == "decode.sm90a.bf16.d128.kv_e4m3"
    assert row["tensormaps"]["k_cache"]["dtype"] == "e4m3"
    _every_slot_given(row, values, tensors)
    for name in ("k_descale", "v_descale"):
        assert (values[f"{name}_sb"], values[f"{name}_sh"], values[f"use_{name}"]) == want
        assert tensors[name]["ptr"] == (descale.ptr if descale is not None else a["lse"].ptr)


def _narrow(b=4, sq=1, hq=32, hkv=8, d=64, keys=1000, **over):
    """A decode call of a narrow head (d <= 64: 128-byte rows a head)."""
    a = {"q": bshd(b, sq, hq, d), "out": bshd(b, sq, hq, d),
         "lse": DeviceArray(fresh(), (b, hq, sq), (hq * sq, sq, 1), "fp32", 0), "cache_seqlens": ints((b,)),
         "k_cache": bshd(b, keys, hkv, d), "v_cache": bshd(b, keys, hkv, d)}
    a.update(over)
    return {n: x for n, x in a.items() if x is not None}


def test_narrow_heads_are_read_in_pairs(built):
    """A cache of head dim <= 64 with adjacent heads and a pair's rows in one row tile
    (policy.decode_pairs): the kernel built for pairs, its K and V viewed as half the heads
    of twice the width, pair_heads 2, the grid over the pairs; q's and v's own columns."""
    from fa4_aot.launch.loader import grid_of
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    for d in (64, 32):
        library.launches = []
        a = _narrow(d=d)
        _call(a, library, num_splits=1)
        (row, values, tensors), = library.launches
        _every_slot_given(row, values, tensors)
        assert row["config"]["pairs"] and row["config"]["head_dim"] == 128
        assert (values["pair_heads"], values["heads_kv"], values["columns"], values["columns_v"]) == (2, 4, d, d)
        for name in ("k_cache", "v_cache"):
            t = tensors[name]
            assert t["ptr"] == a[name].ptr and t["shape"] == (4, 1000, 4, 2 * d)
            assert t["strides"] == (1000 * 8 * d, 8 * d, 2 * d, 1)
        assert grid_of(row["launches"][0], values) == (1, 4, 4)  # 8 rows of a pair: one tile, 4 pairs, 4 sequences


def test_narrow_fp8_heads_are_read_in_pairs_with_their_scales(built):
    """An FP8 cache of narrow heads is paired too, on the FP8 kernel built for pairs: the
    descale tensors go as given, over the cache's own (batch, heads_kv), for each row to
    take its own head's (the kernel's ``row_descales``)."""
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    b, hkv, d = 4, 8, 64
    a = _narrow(k_cache=bshd(b, 1000, hkv, d, "e4m3"), v_cache=bshd(b, 1000, hkv, d, "e4m3"))
    k_scale, v_scale = scales((b, hkv)), scales((b, hkv), strides=(1, b))
    _call(a, library, num_splits=1, k_descale=k_scale, v_descale=v_scale)
    (row, values, tensors), = library.launches
    _every_slot_given(row, values, tensors)
    assert row["name"] == "decode.sm90a.bf16.d128.kv_e4m3" and row["config"]["pairs"]
    assert (values["pair_heads"], values["heads_kv"], values["columns"]) == (2, hkv // 2, d)
    assert tensors["k_cache"]["shape"] == (b, 1000, hkv // 2, 2 * d)
    for name, t in (("k_descale", k_scale), ("v_descale", v_scale)):
        assert tensors[name]["ptr"] == t.ptr
        assert (values[f"{name}_sb"], values[f"{name}_sh"], values[f"use_{name}"]) == (*t.strides, 1)


@pytest.mark.parametrize("what, over", [
    ("MQA: one KV head", dict(hq=8, hkv=1)),
    ("odd KV heads", dict(hq=12, hkv=3)),
    ("a pair's rows past one tile", dict(sq=16, hq=32, hkv=8)),  # 2 x 4 heads x 16 tokens = 128 rows
    ("a head past 64 columns", dict(d=96)),
])
def test_calls_that_are_not_paired(built, what, over):
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    a = _narrow(**over)
    _call(a, library, num_splits=1)
    (row, values, tensors), = library.launches
    _every_slot_given(row, values, tensors)
    assert values.get("pair_heads", 1) == 1 and values["heads_kv"] == a["k_cache"].shape[2], what
    assert tensors["k_cache"]["shape"] == a["k_cache"].shape, what


def test_heads_that_are_not_adjacent_are_read_one_by_one(built):
    """A cache whose heads lie apart (a view of every other head of a wider one): no pair
    is one row, so each head is read alone; a window (the local kernels) likewise."""
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    b, keys, hkv, d = 4, 1000, 8, 64
    apart = (keys * 2 * hkv * d, 2 * hkv * d, 2 * d, 1)  # head stride 2 d
    for over in (dict(k_cache=bshd(b, keys, hkv, d, strides=apart)), dict(v_cache=bshd(b, keys, hkv, d, strides=apart))):
        library.launches = []
        _call(_narrow(**over), library, num_splits=1)
        (row, values, tensors), = library.launches
        assert values.get("pair_heads", 1) == 1 and values["heads_kv"] == hkv
        assert tensors["k_cache"]["shape"] == (b, keys, hkv, d)


def test_a_paired_split_call_fits_the_workspace_asked_for(built):
    """forward_kvcache_workspace_bytes sizes for the pairs' kernels too (their partial rows
    are the kernel's width, and half the CTAs may take more splits): a split paired call
    on the workspace it asked for is taken, and one byte less is refused."""
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    for b, keys in ((8, 32768), (32, 16384), (1, 131072)):
        need = forward_kvcache_workspace_bytes(b, 1, 16, 2, 64, keys, library=library, sm_count=132)
        assert need <= forward_kvcache_workspace_bytes(b, 1, 16, 2, 64, keys, library=library)
        library.launches = []
        space = DeviceArray(fresh(), (need,), (1,), "u8", 0)
        _call(_narrow(b=b, hq=16, hkv=2, keys=keys, workspace=space), library)
        decode, values, tensors = library.launches[0]
        assert values["pair_heads"] == 2 and values["splits"] > 1, (b, keys)
        assert [r["name"] for r, _, _ in library.launches[1:]] == ["combine.sm90a.bf16.d128"]
        with pytest.raises(ShapeError, match="bytes"):
            small = DeviceArray(fresh(), (need - 1,), (1,), "u8", 0)
            _call(_narrow(b=b, hq=16, hkv=2, keys=keys, workspace=small), _FakeLibrary(Manifest(built[0])))


def test_dense_decode_shapes_of_narrow_heads_are_read_in_pairs(built):
    """fa4_aot.forward of a decode shape at head dim 64: the paired decode, split as its
    own policy says, on a workspace of forward_workspace_bytes."""
    from fa4_aot import forward, forward_workspace_bytes
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    shape = (8, 1, 32, 8, 64, 32768)
    need = forward_workspace_bytes(*shape, sm_count=132, library=library)
    assert 0 < need <= forward_workspace_bytes(*shape, library=library)
    forward(*_dense(*shape).values(), workspace=DeviceArray(fresh(), (need,), (1,), "u8", 0), library=library)
    (row, values, tensors), (combine, _, _) = library.launches
    _every_slot_given(row, values, tensors)
    assert row["name"] == "decode.sm90a.bf16.d128" and values["pair_heads"] == 2 and values["heads_kv"] == 4
    assert values["splits"] == policy.decode_splits(4 * 8, 32768 // 128, 132, 128)


@pytest.mark.parametrize("sizes, want", [
    ((64, 32, 8, 1), True), ((32, 32, 8, 1), True), ((72, 32, 8, 1), False), ((64, 8, 1, 1), False),
    ((64, 12, 3, 1), False), ((64, 32, 8, 8), True), ((64, 32, 8, 9), False), ((64, 16, 16, 32), True),
])
def test_decode_pairs_policy(sizes, want):
    assert policy.decode_pairs(*sizes) is want


# the local decode kernels beside each other (tests/conftest.SUBSET has none: its d64 calls
# run on the d128 kernels), for the choice between the span-narrow and span-any ones
WINDOWED = ("decode.sm90a.bf16.d64", "decode.sm90a.bf16.d64.local", "decode.sm90a.bf16.d64.local.narrow",
            "decode.sm90a.bf16.d64.local.softcap", "decode.sm90a.bf16.d128.local", "combine.sm90a.bf16.d64",
            "combine.sm90a.bf16.d128", "fwd.sm90a.bf16.d64.local")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A Manifest of WINDOWED, built into a temporary folder."""
    import subprocess
    import sys
    from pathlib import Path

    from fa4_aot.launch.manifest import Manifest

    pytest.importorskip("cutlass", reason="the CuTe DSL is needed to build kernels")
    out = tmp_path_factory.mktemp("windowed")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "build_kernels.py"), "--out", str(out), "--jobs", "2"]
    proc = subprocess.run(cmd + [x for name in WINDOWED for x in ("--only", name)], capture_output=True, text=True,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Manifest(out)


@pytest.mark.parametrize("b, sq, window, cap, d, keys, want, pair", [
    (64, 1, (128, 0), 0.0, 64, 32768, "decode.sm90a.bf16.d64.local.narrow", 1),  # gpt-oss's window, 512 CTAs
    (64, 4, (127, -1), 0.0, 64, 32768, "decode.sm90a.bf16.d64.local.narrow", 1),
    (64, 1, (8191, 0), 0.0, 64, 32768, "decode.sm90a.bf16.d64.local.narrow", 1),  # 8191 + 1 keys: the last
    (64, 1, (8192, 0), 0.0, 64, 32768, "decode.sm90a.bf16.d64.local", 1),
    (50, 1, (128, 0), 0.0, 64, 32768, "decode.sm90a.bf16.d64.local.narrow", 1),  # 400 CTAs: 3 an SM
    (49, 1, (128, 0), 0.0, 64, 32768, "decode.sm90a.bf16.d64.local", 1),  # 392: fewer, split
    (8, 1, (128, 0), 0.0, 64, 131072, "decode.sm90a.bf16.d64.local", 1),  # a window: never in pairs
    (8, 1, (-1, -1), 0.0, 64, 131072, "decode.sm90a.bf16.d128.local", 2),  # sinks over a 128k cache: in pairs
    (8, 1, (-1, 0), 0.0, 64, 131072, "decode.sm90a.bf16.d128.local", 2),
    (8, 1, (-1, -1), 0.0, 64, 131071, "decode.sm90a.bf16.d64.local", 1),  # a shorter cache: one by one
    (8, 1, (-1, -1), 30.0, 64, 131072, "decode.sm90a.bf16.d64.local.softcap", 1),  # capped: one by one
    (64, 1, (128, 0), 30.0, 64, 32768, "decode.sm90a.bf16.d64.local.softcap", 1),  # no narrow kernel capped
    (64, 1, (128, 0), 0.0, 128, 32768, "decode.sm90a.bf16.d128.local", 1),  # nor at head_dim 128
])
def test_windows_take_the_kernel_of_their_span(windowed, b, sq, window, cap, d, keys, want, pair):
    """A decode whose window covers at most policy.DECODE_NARROW_MAX_SPAN keys, with CTAs
    enough for three a multiprocessor, takes the span-narrow kernel where one is built
    (head_dim 64, no cap); sinks over a cache of policy.DECODE_LOCAL_PAIR_MIN_KEYS keys or
    more (no window behind) read narrow heads in pairs on the d128 local kernel; others the
    span-any kernel; each on the workspace forward_kvcache_workspace_bytes asked for (for
    132 SMs, or any GPU)."""
    hq, hkv = 64, 8
    sinks = DeviceArray(fresh(), (hq,), (1,), "fp32", 0)
    for count in (None, 132):
        library = _FakeLibrary(windowed)
        need = forward_kvcache_workspace_bytes(b, sq, hq, hkv, d, keys, library=library, sm_count=count)
        space = DeviceArray(fresh(), (max(need, 1),), (1,), "u8", 0)
        a = _narrow(b=b, sq=sq, hq=hq, hkv=hkv, d=d, keys=keys, workspace=space if need else None)
        _call(a, library, window_size=window, softcap=cap, learnable_sink=sinks)
        row, values, tensors = library.launches[0]
        _every_slot_given(row, values, tensors)
        assert row["name"] == want and values.get("pair_heads", 1) == pair
        assert values["heads_kv"] == hkv // pair and tensors["k_cache"]["shape"][2:] == (hkv // pair, d * pair)
        assert row["config"]["tile_n"] == (32 if want.endswith("narrow") else 64 if want.startswith(
            "decode.sm90a.bf16.d64") else 128)


def test_dense_decode_shapes_with_a_narrow_window_take_the_span_narrow_kernel(windowed):
    """fa4_aot.forward of a decode shape with gpt-oss's window and sinks: the span-narrow
    decode, on a workspace of forward_workspace_bytes."""
    from fa4_aot import forward, forward_workspace_bytes

    library = _FakeLibrary(windowed)
    shape = (64, 1, 64, 8, 64, 32768)
    need = forward_workspace_bytes(*shape, sm_count=132, library=library, window_size=(128, 0), learnable_sink=True)
    sinks = DeviceArray(fresh(), (64,), (1,), "fp32", 0)
    space = DeviceArray(fresh(), (need,), (1,), "u8", 0) if need else None
    forward(*_dense(*shape).values(), workspace=space, library=library, window_size=(128, 0), learnable_sink=sinks)
    row, values, tensors = library.launches[0]
    _every_slot_given(row, values, tensors)
    assert row["name"] == "decode.sm90a.bf16.d64.local.narrow"


def test_windowed_decode_reads_its_window_in_pieces():
    """The local decode kernels of a 16-bit cache load K and V in TMA pieces of
    LOCAL_PIECE_ROWS keys, so those wholly outside a window are not read (decode/config
    ``piece_rows``, kernel._piece_place); every other decode kernel in pieces of its key
    tile; a paged cache in pieces that divide the page."""
    import math

    from fa4_aot.launch.rules import evaluate
    from fa4_aot.src.sm90.decode import config
    from fa4_aot.variants import matrix

    decodes = [v for v in matrix() if v.kind == "decode"]
    assert any(v.local and v.kv_dtype == "same" for v in decodes)
    for v in decodes:
        cfg = config.DecodeConfig.of(v)
        rule = config.launch_values(cfg)["piece_rows"]
        piece = config.LOCAL_PIECE_ROWS if v.local and v.kv_dtype == "same" else cfg.tile_n
        assert cfg.tile_n % piece == 0 and piece % 8 == 0, v.name  # whole 8-row swizzle atoms
        assert evaluate(rule, {"paged": 0, "cache_rows": 0}) == piece, v.name
        for page in (16, 48, 64, 256):
            assert evaluate(rule, {"paged": 1, "cache_rows": page}) == math.gcd(page, piece), v.name
