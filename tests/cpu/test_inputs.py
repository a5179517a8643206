"""Every bad input is refused with a typed error before anything touches a GPU."""

import itertools

import pytest

from fa4_aot.launch.arrays import DeviceArray, as_device_array
from fa4_aot.launch.checks import check_forward
from fa4_aot.errors import DeviceError, DTypeError, InputError, LayoutError, ShapeError

BASE = 0x7F0000000000
_ARRAYS = itertools.count(1)


def fresh() -> int:
    """An address no other array of these tests takes: each array its own memory."""
    return BASE + next(_ARRAYS) * (1 << 36)


def bshd(b, s, h, d, dtype="bf16", strides=None, ptr=None):
    ptr = fresh() if ptr is None else ptr
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
    ({"v": bshd(2, 299, 2, 128)}, ShapeError, "v .* like k"),
    ({"out": bshd(2, 100, 8, 64)}, ShapeError, "out .* with v's head_dim"),  # v's head dim is 128
    ({"out": bshd(2, 100, 4, 128)}, ShapeError, "out .* must be q's"),
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
    from fa4_aot.launch.checks import check_backward

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


def test_size_one_axes_get_a_valid_descriptor_stride():
    from fa4_aot.launch.tma import _descriptor_strides

    assert all(s * 2 % 16 == 0 and s > 0 for s in _descriptor_strides((1, 1, 1, 64), (0, 0, 0, 1), 2))
    # an axis of more than one keeps its stride
    assert _descriptor_strides((2, 1, 4, 64), (7 * 256, 3, 64, 1), 2) == [64, 64, 7 * 256]


def test_a_backward_takes_whatever_dout_autograd_hands_it():
    """The torch layers' backward inputs: a dout the kernels can read is passed as it is;
    an expanded one, one with a stride that is no 16-byte multiple, and one 8 bytes past
    alignment (a contiguous view: contiguous() would keep its pointer) become a fresh
    contiguous copy, same values."""
    torch = pytest.importorskip("torch")
    from fa4_aot.torch.tensors import kernel_ready_dout

    good = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    assert kernel_ready_dout(good) is good
    flat = torch.randn(2 * 64 * 4 * 64 + 4, dtype=torch.bfloat16)
    cases = [torch.ones((), dtype=torch.bfloat16).expand(2, 64, 4, 64),
             torch.randn(2, 64, 4, 68, dtype=torch.bfloat16)[..., :64],  # 136-byte head rows
             flat[4:].view(2, 64, 4, 64)]  # 8 bytes past the block's start
    for dout in cases:
        ready = kernel_ready_dout(dout)
        assert ready.is_contiguous() and ready.data_ptr() % 16 == 0 and ready.data_ptr() != dout.data_ptr()
        assert torch.equal(ready, dout)
    packed = flat[4:].view(128, 4, 64)  # varlen's (total, heads, head_dim)
    assert kernel_ready_dout(packed).data_ptr() % 16 == 0


def _pairwise_overlap(outputs: dict, inputs: dict) -> bool:
    """The overlap rule pair by pair: an output that may share a byte (checks.may_share)
    with another output or with an input."""
    from fa4_aot.launch.checks import may_share

    names = list(outputs)
    return any(may_share(outputs[a], t) for i, a in enumerate(names)
               for t in [outputs[b] for b in names[i + 1:]] + list(inputs.values()))


def test_overlap_check_refuses_exactly_the_pairs_that_share_memory():
    """check_no_overlap (a sweep over the arrays' byte ranges) against the rule pair by pair
    on random calls: arrays of a dozen kinds at nearby addresses, views of one packed
    (b, s, 3, h, d) buffer, the same array given twice, empty arrays; outputs that meet
    only inputs, inputs that meet each other (allowed). Refused exactly where the pairwise
    rule finds a shared byte."""
    import random

    from fa4_aot.errors import OverlapError
    from fa4_aot.launch.checks import check_no_overlap

    rng = random.Random(7)

    def array(base):
        kind = rng.randrange(4)
        if kind == 0:  # a view of a packed (b, s, 3, h, d) buffer
            b, s, h, d = rng.choice([(1, 8, 2, 16), (2, 4, 4, 8)])
            part = rng.randrange(3)
            return DeviceArray(base + part * h * d * 2, (b, s, h, d), (s * 3 * h * d, 3 * h * d, d, 1), "bf16", 0)
        if kind == 1:  # contiguous (b, s, h, d)
            shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(3)) + (8,)
            strides = (shape[1] * shape[2] * 8, shape[2] * 8, 8, 1)
            return DeviceArray(base, shape, strides, "bf16", 0)
        if kind == 2:  # fp32 statistics
            n = rng.choice([0, 1, 7, 64])
            return DeviceArray(base, (1, 2, n), (2 * n, n, 1), "fp32", 0)
        return DeviceArray(base, (rng.choice([0, 16, 256, 4096]),), (1,), "u8", 0)  # a workspace

    refused = passed = 0
    for _ in range(3000):
        pool = [array(rng.randrange(0, 4096, 2)) for _ in range(rng.randrange(2, 10))]
        if rng.random() < 0.2:
            pool.append(pool[0])  # the same array under two names
        rng.shuffle(pool)
        cut = rng.randrange(1, len(pool))
        outputs = {f"o{i}": t for i, t in enumerate(pool[:cut])}
        inputs = {f"i{i}": t for i, t in enumerate(pool[cut:])}
        if _pairwise_overlap(outputs, inputs):
            with pytest.raises(OverlapError):
                check_no_overlap(outputs, inputs)
            refused += 1
        else:
            check_no_overlap(outputs, inputs)
            passed += 1
    assert refused > 300 and passed > 300, (refused, passed)


@pytest.mark.parametrize("shape, strides, want", [
    ((2, 3, 4), (12, 4, 1), (0, 48)), ((2, 3), (-3, 1), (-6, 6)), ((4,), (-2,), (-12, 2)),
    ((3, 0, 2), (2, 2, 1), None), ((1, 1), (7, -5), (0, 2)), ((5, 2), (0, 1), (0, 4)),
])
def test_span_is_the_byte_range_of_the_elements(shape, strides, want):
    """checks._span: [lowest, highest + itemsize) of the elements' bytes (bf16 here), with
    negative and zero strides; None for an array with no element."""
    from fa4_aot.launch.checks import _span

    got = _span(DeviceArray(1 << 20, shape, strides, "bf16", 0))
    assert got == (None if want is None else ((1 << 20) + want[0], (1 << 20) + want[1]))
