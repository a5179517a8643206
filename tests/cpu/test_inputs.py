"""Every bad input is refused with a typed error before anything touches a GPU."""

import pytest

from fa4_aot.arrays import DeviceArray, as_device_array
from fa4_aot.checks import check_forward
from fa4_aot.errors import DeviceError, DTypeError, InputError, LayoutError, ShapeError

BASE = 0x7F0000000000


def bshd(b, s, h, d, dtype="bf16", strides=None, ptr=BASE):
    strides = strides or (s * h * d, h * d, d, 1)
    return DeviceArray(ptr, (b, s, h, d), strides, dtype)


def problem(**over):
    args = {
        "q": bshd(2, 100, 8, 128), "k": bshd(2, 300, 2, 128), "v": bshd(2, 300, 2, 128),
        "out": bshd(2, 100, 8, 128), "lse": DeviceArray(BASE, (2, 8, 100), (800, 100, 1), "fp32"),
    }
    args.update(over)
    return args


def test_a_good_problem_passes():
    p = check_forward(**problem())
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim) == (2, 100, 300, 8, 2, 128)


@pytest.mark.parametrize("over, error, message", [
    ({"q": bshd(2, 100, 8, 128, "fp32")}, DTypeError, "bf16 or fp16"),
    ({"k": bshd(2, 300, 2, 128, "fp16"), "v": bshd(2, 300, 2, 128, "fp16")}, DTypeError, "share one dtype"),
    ({"lse": DeviceArray(BASE, (2, 8, 100), (800, 100, 1), "bf16")}, DTypeError, "lse must be fp32"),
    ({"q": DeviceArray(BASE, (2, 100, 1024), (102400, 1024, 1), "bf16")}, ShapeError, "rank 4"),
    ({"q": bshd(2, 0, 8, 128), "out": bshd(2, 0, 8, 128)}, ShapeError, "zero or negative"),
    ({"k": bshd(2, -3, 2, 128)}, ShapeError, "zero or negative"),
    ({"k": bshd(2, 300, 3, 128), "v": bshd(2, 300, 3, 128)}, ShapeError, "multiple of heads_kv"),
    ({"k": bshd(3, 300, 2, 128), "v": bshd(3, 300, 2, 128)}, ShapeError, "batch=2"),
    ({"v": bshd(2, 299, 2, 128)}, ShapeError, "v .* must have k's shape"),
    ({"out": bshd(2, 100, 8, 64)}, ShapeError, "out .* must have q's shape"),
    ({"lse": DeviceArray(BASE, (2, 100, 8), (800, 8, 1), "fp32")}, ShapeError, "lse"),
    ({"lse": DeviceArray(BASE, (2, 8, 100), (1600, 200, 1), "fp32")}, LayoutError, "lse must be contiguous"),
    ({"lse": DeviceArray(BASE + 2, (2, 8, 100), (800, 100, 1), "fp32")}, LayoutError, "4-byte"),
    ({"q": bshd(2, 100, 8, 128, strides=(102400, 1024, 1, 8))}, LayoutError, "last dimension must be contiguous"),
    ({"q": bshd(2, 100, 8, 128, strides=(102400, 1028, 129, 1))}, LayoutError, "multiples of 16 bytes"),
    ({"k": bshd(2, 300, 2, 128, ptr=BASE + 8)}, LayoutError, "16-byte aligned"),
    ({"q": bshd(2, 100, 8, 128, strides=(-102400, 1024, 128, 1))}, LayoutError, "positive"),
    ({"q": bshd(1, 2**31, 1, 64), "out": bshd(1, 2**31, 1, 64),
      "k": bshd(1, 8, 1, 64), "v": bshd(1, 8, 1, 64)}, ShapeError, "2\\*\\*31-1"),
    ({"q": bshd(70000, 1, 1, 64), "out": bshd(70000, 1, 1, 64), "k": bshd(70000, 8, 1, 64),
      "v": bshd(70000, 8, 1, 64), "lse": DeviceArray(BASE, (70000, 1, 1), (1, 1, 1), "fp32")}, ShapeError, "grid"),
])
def test_bad_inputs(over, error, message):
    with pytest.raises(error, match=message):
        check_forward(**problem(**over))


def test_lse_index_overflow_is_refused():
    b, s, h = 64, 2**20, 64
    over = {"q": bshd(b, s, h, 64), "out": bshd(b, s, h, 64), "k": bshd(b, 8, h, 64), "v": bshd(b, 8, h, 64),
            "lse": DeviceArray(BASE, (b, h, s), (h * s, s, 1), "fp32")}
    with pytest.raises(ShapeError, match="int32"):
        check_forward(**problem(**over))


def test_errors_are_value_errors_too():
    assert issubclass(InputError, ValueError) and issubclass(DTypeError, TypeError)


def test_host_arrays_are_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(DeviceError, match="not a CUDA device"):
        as_device_array(np.zeros((2, 3), dtype=np.float16))
    with pytest.raises(DeviceError, match="not a device array"):
        as_device_array([1, 2, 3])


def test_cuda_array_interface_is_read_without_the_framework():
    class Fake:
        __cuda_array_interface__ = {"data": (BASE, False), "shape": (2, 5, 3, 64), "typestr": "<f2",
                                    "strides": (5 * 3 * 64 * 2, 3 * 64 * 2, 64 * 2, 2), "version": 3}
    a = as_device_array(Fake())
    assert a == DeviceArray(BASE, (2, 5, 3, 64), (960, 192, 64, 1), "fp16")


def test_dlpack_of_a_torch_cpu_tensor_is_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(DeviceError):
        as_device_array(torch.zeros(2, 3, dtype=torch.bfloat16))


def test_backward_checks_gradients_like_their_inputs():
    from fa4_aot.checks import check_backward

    p = problem()
    good = dict(q=p["q"], k=p["k"], v=p["v"], out=p["out"], lse=p["lse"], dout=bshd(2, 100, 8, 128),
                dq=bshd(2, 100, 8, 128), dk=bshd(2, 300, 2, 128), dv=bshd(2, 300, 2, 128))
    assert check_backward(**good).seqlen_k == 300
    with pytest.raises(ShapeError, match="dk"):
        check_backward(**{**good, "dk": bshd(2, 300, 8, 128)})
    with pytest.raises(DTypeError, match="dout"):
        check_backward(**{**good, "dout": bshd(2, 100, 8, 128, "fp16")})
    with pytest.raises(LayoutError, match="dq"):
        check_backward(**{**good, "dq": bshd(2, 100, 8, 128, ptr=BASE + 2)})


def test_workspace_is_carved_aligned_and_checked():
    from fa4_aot.api import _carve, backward_workspace_bytes
    from fa4_aot.checks import check_forward

    p = check_forward(**problem())
    need = backward_workspace_bytes(p.batch, p.seqlen_q, p.heads_q, p.head_dim, seqlen_k=p.seqlen_k,
                                    heads_kv=p.heads_kv)
    regions = _carve(DeviceArray(BASE, (need,), (1,), "u8"), p, False, False)
    starts = sorted(r["ptr"] for r in regions.values())
    assert all(s % 256 == 0 for s in starts) and starts[0] == BASE
    assert regions["dq_accum"]["shape"] == (2, 100, 8, 128)
    with pytest.raises(ShapeError, match="workspace has"):
        _carve(DeviceArray(BASE, (need - 1,), (1,), "u8"), p, False, False)
    with pytest.raises(LayoutError, match="256-byte"):
        _carve(DeviceArray(BASE + 16, (need,), (1,), "u8"), p, False, False)


def test_deterministic_non_causal_workspace_holds_every_dq_copy():
    """The deterministic non-causal backward adds dQ into dq_chains copies (batch-major in
    one tensor) with as many semaphores; a workspace sized for another mode is refused."""
    from fa4_aot.api import _carve, backward_workspace_bytes
    from fa4_aot.checks import check_forward
    from fa4_aot.variants import dq_chains

    p = check_forward(**problem())
    chains = dq_chains(False, True)
    assert chains > 1 and dq_chains(True, True) == dq_chains(False, False) == 1
    causal = backward_workspace_bytes(p.batch, p.seqlen_q, p.heads_q, p.head_dim, causal=True)
    assert backward_workspace_bytes(p.batch, p.seqlen_q, p.heads_q, p.head_dim, causal=True, deterministic=True) \
        == causal
    need = backward_workspace_bytes(p.batch, p.seqlen_q, p.heads_q, p.head_dim, deterministic=True)
    assert need > causal
    regions = _carve(DeviceArray(BASE, (need,), (1,), "u8"), p, False, True)
    assert regions["dq_accum"]["shape"] == (2 * chains, 100, 8, 128)
    assert regions["dq_semaphore"]["ptr"] - regions["dq_accum"]["ptr"] >= chains * 2 * 100 * 8 * 128 * 4
    with pytest.raises(ShapeError, match="same causal and deterministic"):
        _carve(DeviceArray(BASE, (causal,), (1,), "u8"), p, False, True)


@pytest.mark.parametrize("causal", [False, True])
def test_workspace_statistics_rows_are_padded_to_whole_query_tiles(causal):
    """The kernel copies each query tile's LSE2 / D values with one bulk copy (4 * tile_m
    bytes): every (batch, head) row of them must be a whole number of tiles, 16-byte
    aligned."""
    from fa4_aot.api import _workspace_regions
    from fa4_aot.variants import bwd_query_rows

    tile_m = bwd_query_rows(128, causal)  # 80, 64
    for seqlen_q in (1, 63, 64, 65, 79, 80, 81, 100, 1000):
        regions = dict(_workspace_regions(2, seqlen_q, 8, 128, causal, False))
        padded = -(-seqlen_q // tile_m) * tile_m
        assert regions["lse2"] == regions["dsum"] == 2 * 8 * padded * 4
        assert padded * 4 % 16 == 0
        assert regions["dq_semaphore"] == 2 * 8 * (padded // tile_m) * 4


@pytest.mark.parametrize("causal", [False, True])
def test_workspace_accumulator_holds_whole_query_tiles(causal):
    """At head_dim 96 and 128 the dQ writer adds whole query tiles (fragment order) into
    the accumulator, the last one past seqlen_q: every copy must hold them all, and still
    the (b * copies, s_q, h, d) rows the 2D TMA reduce of the other head dims addresses."""
    from fa4_aot.api import _workspace_regions
    from fa4_aot.variants import bwd_query_rows, dq_chains

    tile_m = bwd_query_rows(128, causal)
    for seqlen_q in (1, 63, 64, 65, 81, 1000):
        for deterministic in (False, True):
            chains = dq_chains(causal, deterministic)
            regions = dict(_workspace_regions(3, seqlen_q, 4, 128, causal, deterministic))
            padded = -(-seqlen_q // tile_m) * tile_m
            assert regions["dq_accum"] == chains * 3 * 4 * padded * 128 * 4
            assert regions["dq_accum"] >= chains * 3 * seqlen_q * 4 * 128 * 4


def test_workspace_is_sized_by_the_variants_query_tile():
    """head_dim 128 not causal takes 80-row query tiles, causal 64: the size the API
    reports follows the tile the matrix builds, and so does the manifest."""
    from fa4_aot.api import _workspace_bytes, _workspace_regions, backward_workspace_bytes
    from fa4_aot.variants import MATRIX, bwd_query_rows

    assert bwd_query_rows(128, False) == 80 and bwd_query_rows(128, True) == 64
    assert {v.tiling.tile_m for v in MATRIX if v.kind == "bwd" and v.head_dim == 128 and not v.causal} == {80}
    assert {v.tiling.tile_m for v in MATRIX if v.kind == "bwd" and v.head_dim != 128} == {64}
    for causal, rows in ((False, 80), (True, 64)):
        regions = _workspace_regions(2, 1000, 8, 128, causal, False)
        assert backward_workspace_bytes(2, 1000, 8, 128, causal=causal) == _workspace_bytes(regions)
        assert dict(regions)["lse2"] == 2 * 8 * -(-1000 // rows) * rows * 4


def test_workspace_regions_fit_the_reported_size():
    """_carve starts every region at a 256-byte boundary: the size the API reports must
    count that padding, or the last region would run past a workspace of exactly that
    size."""
    from fa4_aot.api import _carve, _workspace_regions, backward_workspace_bytes

    for b, s, h, d in ((1, 1, 1, 64), (3, 17, 3, 96), (2, 1000, 5, 128), (1, 257, 7, 256)):
        for causal, deterministic in ((False, False), (True, True), (False, True)):
            size = backward_workspace_bytes(b, s, h, d, causal=causal, deterministic=deterministic)
            lse = DeviceArray(BASE, (b, h, s), (h * s, s, 1), "fp32")
            p = check_forward(**problem(q=bshd(b, s, h, d), k=bshd(b, s, h, d), v=bshd(b, s, h, d),
                                        out=bshd(b, s, h, d), lse=lse))
            regions = _carve(DeviceArray(BASE, (size,), (1,), "u8"), p, causal, deterministic)
            assert all(r["ptr"] % 256 == 0 for r in regions.values())
            for name, bytes_ in _workspace_regions(b, s, h, d, causal, deterministic):
                assert regions[name]["ptr"] + bytes_ <= BASE + size


def test_size_one_axes_get_a_valid_descriptor_stride():
    from fa4_aot.api import _tma_tensor

    t = _tma_tensor(DeviceArray(BASE, (1, 1, 1, 64), (0, 0, 0, 1), "bf16"))
    assert all(s * 2 % 16 == 0 and s > 0 for s in t["strides"][:3])


def test_workspace_partial_sums_are_sized_by_the_problem_when_told():
    """backward_workspace_bytes with seqlen_k and heads_kv sizes the split last wave's
    partial sums for the problem's key tiles (fewer than TAIL_MAX_TILES when it has fewer,
    none with GQA); without them, for the most. A workspace of either size is taken, and one
    byte less than the exact size is refused."""
    from fa4_aot.api import _carve, backward_workspace_bytes
    from fa4_aot.variants import TAIL_MAX_TILES

    for heads_kv in (2, 8):  # GQA: no split; MHA: 3 key tiles x 8 heads x 2 = 48 tiles
        p = check_forward(**problem(k=bshd(2, 300, heads_kv, 128), v=bshd(2, 300, heads_kv, 128)))
        most = backward_workspace_bytes(p.batch, p.seqlen_q, p.heads_q, p.head_dim)
        exact = backward_workspace_bytes(p.batch, p.seqlen_q, p.heads_q, p.head_dim, seqlen_k=p.seqlen_k,
                                         heads_kv=p.heads_kv)
        tiles = min(TAIL_MAX_TILES, 3 * heads_kv * 2) if heads_kv == 8 else 0
        assert most - exact == (TAIL_MAX_TILES - tiles) * 2 * 128 * 128 * 4
        for size in (most, exact):
            _carve(DeviceArray(BASE, (size,), (1,), "u8"), p, False, False)
        with pytest.raises(ShapeError, match="workspace has"):
            _carve(DeviceArray(BASE, (exact - 1,), (1,), "u8"), p, False, False)
    # causal and deterministic variants keep no partial sums: the same size either way
    for causal, det in ((True, False), (False, True)):
        assert backward_workspace_bytes(p.batch, p.seqlen_q, p.heads_q, p.head_dim, causal=causal,
                                        deterministic=det) == backward_workspace_bytes(
            p.batch, p.seqlen_q, p.heads_q, p.head_dim, causal=causal, deterministic=det, seqlen_k=p.seqlen_k,
            heads_kv=p.heads_kv)
