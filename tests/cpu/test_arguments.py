"""Every bad argument is a fa4_aot.Fa4AotError, raised before anything launches; no GPU.

A fuzz over the argument space of the raw API and the torch adapter: ranks, dtypes,
strides, sizes (0, negative, past the index limits), mismatched shapes, options of the
wrong type or value (non-finite and non-float scales), lists, None and host arrays. Each
case draws one to three bad arguments into a good call; the launch is recorded instead of
made (tests/cpu/test_loader.py's stand-in library), and none may happen.
"""

import itertools
import math
import random

import numpy as np

import pytest

import fa4_aot.dense as api
from fa4_aot.launch.arrays import DeviceArray
from fa4_aot.errors import DTypeError, Fa4AotError, OptionError, ShapeError, UnsupportedVariantError
from fa4_aot.launch.loader import KernelLibrary

from .test_loader import _RecordingLibrary

BASE = 0x7F0000000000
_ARRAYS = itertools.count(1)


def fresh() -> int:
    """An address no other array of these tests takes: each array its own memory."""
    return BASE + next(_ARRAYS) * (1 << 36)
B, SQ, SK, HQ, HKV, D = 2, 100, 300, 4, 2, 64  # fwd.sm90a.bf16.d64, bwd.sm90a.fp16.d64 (built in SUBSET)


def arr(shape, dtype, strides=None, ptr=None, device=0):
    ptr = fresh() if ptr is None else ptr
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    return DeviceArray(ptr, tuple(shape), tuple(strides), dtype, device)


def good_forward(dtype="bf16"):
    return {"q": arr((B, SQ, HQ, D), dtype), "k": arr((B, SK, HKV, D), dtype), "v": arr((B, SK, HKV, D), dtype),
            "out": arr((B, SQ, HQ, D), dtype), "lse": arr((B, HQ, SQ), "fp32")}


def good_backward(library):
    f = good_forward("fp16")
    size = api.backward_workspace_bytes(B, SQ, HQ, D, seqlen_k=SK, heads_kv=HKV, library=library)
    grads = {"dout": arr((B, SQ, HQ, D), "fp16"), "dq": arr((B, SQ, HQ, D), "fp16"), "dk": arr((B, SK, HKV, D), "fp16"),
             "dv": arr((B, SK, HKV, D), "fp16")}
    return {"q": f["q"], "k": f["k"], "v": f["v"], "out": f["out"], "dout": grads["dout"], "lse": f["lse"],
            "dq": grads["dq"], "dk": grads["dk"], "dv": grads["dv"], "workspace": arr((size,), "u8")}


class Fake:
    """An object that looks like an array but is not one any protocol reads."""

    shape = (B, SQ, HQ, D)


def bad_tensors(name: str, t: DeviceArray) -> list:
    """Replacements for tensor ``name`` (good: ``t``) that no kernel can take."""
    shape, strides, dtype = t.shape, t.strides, t.dtype
    out = [None, [1, 2, 3], 3, "q", Fake(), np.zeros(shape[:2], dtype=np.float16)]
    if name == "workspace":
        return out + [arr((shape[0] - 1,), "u8"), arr(shape, "u8", ptr=BASE + 16), arr((2, shape[0]), "u8",
                                                                                        strides=(1, 2))]
    out += [arr(shape[:-1], dtype), arr((*shape, 1), dtype), arr(shape, "u8")]
    if name != "lse":
        out += [arr(shape, "fp32"), arr(shape, "fp16" if dtype == "bf16" else "bf16")]
        for axis in range(4):
            for n in (0, -1):
                out.append(arr(tuple(n if i == axis else s for i, s in enumerate(shape)), dtype))
        out += [arr((shape[0], 2**31, *shape[2:]), dtype),  # past the int32 index limit
                arr(shape, dtype, strides=(*strides[:3], 2)),  # last dim not contiguous
                arr(shape, dtype, strides=(strides[0], strides[1] + 1, strides[2], 1)),  # not 16-byte strides
                arr(shape, dtype, strides=(-strides[0], *strides[1:])),  # negative stride
                arr(shape, dtype, strides=(2**40, *strides[1:])),  # stride past the TMA limit
                arr(shape, dtype, ptr=BASE + 8),  # misaligned
                arr((shape[0] + 1, *shape[1:]), dtype),  # another batch
                arr((*shape[:3], shape[3] * 2), dtype)]  # another head dim
        if name in ("k", "v", "dk", "dv"):
            out.append(arr((shape[0], shape[1], 3, shape[3]), dtype))  # heads_q not a multiple
        else:
            out.append(arr((shape[0], shape[1] + 1, *shape[2:]), dtype))  # another seqlen_q
    else:
        out += [arr(shape, "bf16"), arr((shape[0], shape[2], shape[1]), "fp32"),
                arr(shape, "fp32", strides=(strides[0] * 2, strides[1] * 2, 1)), arr(shape, "fp32", ptr=BASE + 2)]
    return out


NOT_A_SCALE = [math.nan, math.inf, -math.inf, "1", b"1", True, [1.0], complex(1, 0), object()]
BAD_OPTIONS = {
    "softmax_scale": NOT_A_SCALE,
    "causal": ["yes", 2, None, [True], 0.5],
    "q_tiles": [0, 3, "2", 1.5, True, [1]],
    "stream": [-1, "0", 1.5, None, [0], object()],
}


def cases(good: dict, options: tuple, seed: int, count: int):
    rng = random.Random(seed)
    pool = [("tensor", name, bad) for name, t in good.items() for bad in bad_tensors(name, t)]
    pool += [("option", name, bad) for name in options for bad in BAD_OPTIONS[name]]
    for _ in range(count):
        arrays, kwargs = dict(good), {}
        for kind, name, bad in rng.sample(pool, rng.randint(1, 3)):
            (arrays if kind == "tensor" else kwargs)[name] = bad
        yield arrays, kwargs


def refused(fn, arrays, kwargs, library):
    before = len(library.launched)
    with pytest.raises(BaseException) as info:
        fn(*arrays.values(), **kwargs, library=library)
    assert isinstance(info.value, Fa4AotError), (arrays, kwargs, info.value)
    assert len(library.launched) == before, "a refused call launched"
    return info.value


@pytest.fixture
def library(built):
    return _RecordingLibrary(built[0])


def test_the_good_calls_launch(library):
    api.forward(*good_forward().values(), library=library)
    api.backward(*good_backward(library).values(), library=library)
    assert [name for name, _ in library.launched] == ["fwd.sm90a.bf16.d64", "bwd.sm90a.fp16.d64"]


def test_a_head_dim_between_the_built_ones_runs_on_the_next_wider(library):
    """head_dim 40: the d64 kernels (the narrowest built at least as wide), told the
    tensors' 40 columns; the default scale 1/sqrt(40); the backward's workspace sized as
    for 64; every value the kernels' plans name given."""
    from fa4_aot.launch import loader

    d = 40
    f = {n: arr(a.shape[:-1] + (d,), a.dtype) if n != "lse" else a for n, a in good_forward().items()}
    api.forward(*f.values(), library=library)
    values = library.last["values"]
    assert library.launched[-1][0] == "fwd.sm90a.bf16.d64"
    assert (values["head_dim"], values["columns"]) == (64, 40)
    assert values["scale_log2"] == pytest.approx(math.log2(math.e) / math.sqrt(40))
    size = api.backward_workspace_bytes(B, SQ, HQ, d, library=library)
    assert size == api.backward_workspace_bytes(B, SQ, HQ, 64, library=library)
    g = {n: arr(a.shape[:-1] + (d,), a.dtype) if n not in ("lse", "workspace") else a
         for n, a in good_backward(library).items()}
    api.backward(*g.values(), library=library)
    values, tensors = library.last["values"], library.last["tensors"]
    assert library.launched[-1][0] == "bwd.sm90a.fp16.d64"
    assert (values["head_dim"], values["columns"]) == (64, 40)
    for launch in library.last["row"]["launches"]:
        assert not loader.missing_sources(launch, values, tensors), launch["symbol"]


def test_v_of_its_own_head_dim_runs_on_the_wider_ones_kernels(library):
    """q, k at 64 and v, out at 128: the d128 forward, told both head dims, the default scale
    q's 1/sqrt(64); q at 64 and v at 256 (fp16): the d256 backward, its workspace sized for
    256, every value its plans name given."""
    from fa4_aot.launch import loader

    f = good_forward()
    f["v"], f["out"] = arr((B, SK, HKV, 128), "bf16"), arr((B, SQ, HQ, 128), "bf16")
    api.forward(*f.values(), library=library)
    values = library.last["values"]
    assert library.launched[-1][0] == "fwd.sm90a.bf16.d128"
    assert (values["head_dim"], values["columns"], values["columns_v"]) == (128, 64, 128)
    assert values["scale_log2"] == pytest.approx(math.log2(math.e) / math.sqrt(64))
    size = api.backward_workspace_bytes(B, SQ, HQ, 64, head_dim_v=256, library=library)
    assert size == api.backward_workspace_bytes(B, SQ, HQ, 256, library=library)
    g = good_backward(library)
    for name, like in (("v", (B, SK, HKV)), ("out", (B, SQ, HQ)), ("dout", (B, SQ, HQ)), ("dv", (B, SK, HKV))):
        g[name] = arr(like + (256,), "fp16")
    g["workspace"] = arr((size,), "u8")
    api.backward(*g.values(), library=library)
    values, tensors = library.last["values"], library.last["tensors"]
    assert library.launched[-1][0] == "bwd.sm90a.fp16.d256"
    assert (values["head_dim"], values["columns"], values["columns_v"]) == (256, 64, 256)
    for launch in library.last["row"]["launches"]:
        assert not loader.missing_sources(launch, values, tensors), launch["symbol"]
    g["dv"] = arr((B, SK, HKV, 64), "fp16")  # dv takes v's head dim
    refused(api.backward, g, {}, library)


@pytest.mark.parametrize("seed", range(4))
def test_forward_fuzz(library, seed):
    for arrays, kwargs in cases(good_forward(), ("softmax_scale", "causal", "q_tiles", "stream"), seed, 150):
        refused(api.forward, arrays, kwargs, library)


@pytest.mark.parametrize("seed", range(4))
def test_backward_fuzz(library, seed):
    options = ("softmax_scale", "causal", "q_tiles", "stream")
    for arrays, kwargs in cases(good_backward(library), options, seed, 150):
        refused(api.backward, arrays, kwargs, library)
    for bad in ["yes", 2, None]:
        refused(api.backward, good_backward(library), {"deterministic": bad}, library)


@pytest.mark.parametrize("scale", NOT_A_SCALE)
def test_a_bad_scale_is_an_option_error_and_a_value_error(library, scale):
    error = refused(api.forward, good_forward(), {"softmax_scale": scale}, library)
    assert isinstance(error, OptionError) and isinstance(error, ValueError)


def test_good_scales_and_streams_are_taken(library):
    for scale in (None, 0.125, 1, np.float32(0.5)):
        api.forward(*good_forward().values(), softmax_scale=scale, library=library)
    for stream in (0, 1, 2, 0x5555_0000):
        api.forward(*good_forward().values(), stream=stream, library=library)
        assert library.last["stream"] == stream
    assert len(library.launched) == 8


def test_a_head_dim_not_built_is_unsupported_before_any_device_is_asked(built, monkeypatch):
    """head_dim 264 (past the widest built) on a machine without a GPU:
    UnsupportedVariantError, not NoDeviceError (the variant is checked against the
    manifest's built archs before the device's)."""
    import fa4_aot.launch.checks as checks

    def no_driver(*_):
        raise AssertionError("the driver was asked")

    monkeypatch.setattr(checks, "call", no_driver)
    library = KernelLibrary(built[0])
    monkeypatch.setattr(library, "arch", no_driver)
    d = 264
    arrays = {"q": arr((B, SQ, HQ, d), "bf16", device=None), "k": arr((B, SK, HKV, d), "bf16", device=None),
              "v": arr((B, SK, HKV, d), "bf16", device=None), "out": arr((B, SQ, HQ, d), "bf16", device=None),
              "lse": arr((B, HQ, SQ), "fp32", device=None)}
    with pytest.raises(UnsupportedVariantError, match="head_dim 264"):
        api.forward(*arrays.values(), library=library)
    d256 = {n: arr(a.shape[:-1] + (256,), "bf16", device=None) if n != "lse" else a for n, a in arrays.items()}
    with pytest.raises(UnsupportedVariantError, match="fwd.sm90a.bf16.d256 is not built"):  # causal only here
        api.forward(*d256.values(), library=library)
    with pytest.raises(UnsupportedVariantError, match="d64.q2 is not built"):  # not in this build
        api.forward(*good_forward().values(), q_tiles=2, library=library)


def test_workspace_size_arguments_are_checked(library):
    for bad in (0, -1, "1", 1.5, None, True, 2**31):
        with pytest.raises(ShapeError):
            api.backward_workspace_bytes(bad, SQ, HQ, D, library=library)
    with pytest.raises(ShapeError):
        api.backward_workspace_bytes(B, SQ, HQ, D, seqlen_k=0, heads_kv=HKV, library=library)
    for head_dim in (36, 264, 512):  # not a multiple of 8; past the widest built
        with pytest.raises(UnsupportedVariantError):
            api.backward_workspace_bytes(B, SQ, HQ, head_dim, library=library)
    with pytest.raises(OptionError):
        api.backward_workspace_bytes(B, SQ, HQ, D, causal="no", library=library)


# ---------------------------------------------------------------- the torch adapter
torch = pytest.importorskip("torch")


@pytest.fixture
def adapter(library, monkeypatch):
    """fa4_aot.torch with CPU tensors taken as device 0's (their host pointers stand in
    for device ones) and the recording library as the default one."""
    import fa4_aot
    import fa4_aot.torch as T
    from fa4_aot.torch import dense, tensors

    real = tensors.as_device_array

    def as_device_array(t):
        if t.device.type != "cpu":
            return real(t)
        if t.dtype not in tensors.DTYPES:
            raise DTypeError(f"tensor dtype {t.dtype} is not bf16, fp16 or fp32")  # as the real one
        return DeviceArray(t.data_ptr(), tuple(t.shape), tuple(t.stride()), tensors.DTYPES[t.dtype], 0)

    monkeypatch.setattr(dense, "as_device_array", as_device_array)
    monkeypatch.setattr(dense, "stream_of", lambda t: 0)
    monkeypatch.setattr(fa4_aot.launch.calls, "_library", library)
    return T


def torch_bad(name, t):
    out = [None, [1.0], 3, np.zeros((B, SQ, HQ, D), dtype=np.float16), t[0], t[None], t.float(), t.to(torch.int64),
           t.transpose(1, 3), t[:, :0], t.narrow(3, 1, D - 1)]
    if name in ("k", "v"):
        out.append(t[:, :, :1].expand(B, SK, 3, D))  # heads_q not a multiple of heads_kv
    return out


def test_the_torch_adapter_launches_good_calls_and_refuses_bad_ones(adapter, library):
    q = torch.zeros(B, SQ, HQ, D, dtype=torch.bfloat16)
    k, v = (torch.zeros(B, SK, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    adapter.flash_attn_fwd(q, k, v)
    assert library.launched == [("fwd.sm90a.bf16.d64", 0)]
    good = {"q": q, "k": k, "v": v}
    rng = random.Random(0)
    pool = [("tensor", n, bad) for n, t in good.items() for bad in torch_bad(n, t)]
    pool += [("option", "softmax_scale", s) for s in NOT_A_SCALE] + [("option", "causal", c) for c in ("yes", 2)]
    for fn in (adapter.flash_attn_fwd, adapter.flash_attn_func):
        for _ in range(150):
            arrays, kwargs = dict(good), {}
            for kind, name, bad in rng.sample(pool, rng.randint(1, 3)):
                (arrays if kind == "tensor" else kwargs)[name] = bad
            with pytest.raises(BaseException) as info:
                fn(*arrays.values(), **kwargs)
            assert isinstance(info.value, Fa4AotError), (fn.__name__, kwargs, info.value)
    assert len(library.launched) == 1


def test_torch_backward_refuses_bad_arguments(adapter, library):
    q, dout = (torch.zeros(B, SQ, HQ, D, dtype=torch.float16) for _ in range(2))
    k, v = (torch.zeros(B, SK, HKV, D, dtype=torch.float16) for _ in range(2))
    out, lse = torch.zeros_like(q), torch.zeros(B, HQ, SQ)  # fwd.sm90a.fp16.d64 is not in this build
    size = api.backward_workspace_bytes(B, SQ, HQ, D, seqlen_k=SK, heads_kv=HKV, library=library)
    buffer = torch.zeros(size + 256, dtype=torch.uint8)
    workspace = buffer[-buffer.data_ptr() % 256:][:size]  # host memory is 64-byte aligned; the kernels want 256
    adapter.flash_attn_bwd(q, k, v, out, dout, lse, workspace=workspace)
    assert [name for name, _ in library.launched] == ["bwd.sm90a.fp16.d64"]
    good = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse}
    for name in good:
        for bad in [None, [1.0], np.zeros(3), good[name][0], good[name].to(torch.int64)]:
            with pytest.raises(Fa4AotError):
                adapter.flash_attn_bwd(*{**good, name: bad}.values(), workspace=workspace)
    for kwargs in ({"softmax_scale": math.nan}, {"softmax_scale": "1"}, {"deterministic": "yes"},
                   {"workspace": torch.zeros(16, dtype=torch.uint8)}, {"dq": [1]}):
        with pytest.raises(Fa4AotError):
            adapter.flash_attn_bwd(*good.values(), **{"workspace": workspace, **kwargs})
    assert len(library.launched) == 1


def test_plain_cpu_tensors_are_a_device_error():
    import fa4_aot.torch as T
    from fa4_aot.errors import DeviceError

    q = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    for fn in (T.flash_attn_func, T.flash_attn_fwd):
        with pytest.raises(DeviceError):
            fn(q, q, q)
    with pytest.raises(ShapeError):
        T.flash_attn_func(q[0], q[0], q[0])
