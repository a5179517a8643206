"""Every public entry point, fuzzed with bad arguments on the real KernelLibrary (its
manifest, rows, parameter packing and kept launches) over a faked driver: each refusal is
a Fa4AotError, nothing is launched, and no caller array (torch's caches included) is
written. Each draw starts from a good call and spoils one or two of its arguments; the
good call itself must launch."""

import ctypes
import itertools
import math
import random

import pytest

import fa4_aot
from fa4_aot.errors import CudaError, Fa4AotError
from fa4_aot.launch import checks, loader, tma
from fa4_aot.launch.arrays import DeviceArray

BASE = 0x7E0000000000
_ARRAYS = itertools.count(1)


def fresh() -> int:
    return BASE + next(_ARRAYS) * (1 << 36)


def arr(shape, dtype, strides=None, ptr=None):
    if strides is None:
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DeviceArray(fresh() if ptr is None else ptr, tuple(shape), tuple(strides), dtype, 0)


class FakeDriver:
    """The driver as the loader, tensor maps and checks call it: modules load, functions
    are found, launches are recorded, nothing runs."""

    def __init__(self):
        self.launched = []
        self._descriptor = ctypes.create_string_buffer(128)

    def call(self, fn, *args):
        name = fn.__name__
        if fn == self.launch:  # the loader's first launch of a call, through ``call``
            self.launched.append(args[1])
            return None
        if name == "cuModuleGetFunction":
            return f"fn:{args[1].decode()[:40]}"
        if name == "cuFuncGetParamInfo":
            raise CudaError(name, "not reported")  # the loader then checks nothing more
        if name == "cuPointerGetAttributes":
            return int(loader.cu.CUmemorytype.CU_MEMORYTYPE_DEVICE), 0
        if name == "cuTensorMapEncodeTiled":
            descriptor = self._descriptor

            class Map:
                def getPtr(self):
                    return ctypes.addressof(descriptor)

            return Map()
        return name

    def launch(self, config, fn, address, extra):
        self.launched.append(fn)
        return (loader.SUCCESS,)


class Context:
    handle, id = 7, 70

    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def driver(built, monkeypatch):
    fake = FakeDriver()
    for module in (loader, tma, checks):
        monkeypatch.setattr(module, "call", fake.call)
    monkeypatch.setattr(checks, "init", lambda: 13000)
    monkeypatch.setattr(loader, "init", lambda: 13000)
    monkeypatch.setattr(loader, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(loader, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(loader, "device_name", lambda device: "fake H200")
    monkeypatch.setattr(loader, "_Context", Context)
    monkeypatch.setattr(loader.cu, "cuLaunchKernelEx", fake.launch)
    monkeypatch.setattr(loader.cu, "cuCtxGetCurrent", lambda: (loader.SUCCESS, 7))
    monkeypatch.setattr(loader.cu, "cuCtxGetId", lambda ctx: (loader.SUCCESS, 70))
    tma._encode.cache_clear()
    library = loader.KernelLibrary(built[0])
    fa4_aot.set_default_library(library)
    yield fake, library
    fa4_aot.set_default_library(None)
    tma._encode.cache_clear()


# ------------------------------------------------------------------ the good calls
# SUBSET's variants: fwd bf16 d64, bwd fp16 d64, varlen fwd bf16 d128 causal, varlen bwd
# bf16 d128 causal det, decode and combine bf16 d128.
def dense_forward():
    b, sq, sk, hq, hkv, d = 2, 100, 300, 4, 2, 64
    arrays = {"q": arr((b, sq, hq, d), "bf16"), "k": arr((b, sk, hkv, d), "bf16"), "v": arr((b, sk, hkv, d), "bf16"),
              "out": arr((b, sq, hq, d), "bf16"), "lse": arr((b, hq, sq), "fp32")}
    return fa4_aot.forward, arrays, {"softmax_scale": None, "causal": False}


def dense_backward():
    b, sq, sk, hq, hkv, d = 2, 100, 300, 4, 2, 64
    size = fa4_aot.backward_workspace_bytes(b, sq, hq, d, seqlen_k=sk, heads_kv=hkv)
    q, out, dout, dq = (arr((b, sq, hq, d), "fp16") for _ in range(4))
    k, v, dk, dv = (arr((b, sk, hkv, d), "fp16") for _ in range(4))
    arrays = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": arr((b, hq, sq), "fp32"), "dq": dq, "dk": dk,
              "dv": dv, "workspace": arr((size,), "u8")}
    return fa4_aot.backward, arrays, {"softmax_scale": None, "causal": False, "deterministic": False}


def varlen_forward():
    tq, tk, b = 100, 300, 3
    arrays = {"q": arr((tq, 8, 128), "bf16"), "k": arr((tk, 2, 128), "bf16"), "v": arr((tk, 2, 128), "bf16"),
              "out": arr((tq, 8, 128), "bf16"), "lse": arr((8, tq), "fp32"), "cu_seqlens_q": arr((b + 1,), "i32"),
              "cu_seqlens_k": arr((b + 1,), "i32"), "max_seqlen_q": 60, "max_seqlen_k": 200}
    options = {"causal": True, "workspace": arr((fa4_aot.forward_varlen_workspace_bytes(b),), "u8"), "order": None}
    return fa4_aot.forward_varlen, arrays, options


def varlen_backward():
    tq, tk, b = 100, 300, 3
    size = fa4_aot.backward_varlen_workspace_bytes(tq, b, 8, 128, causal=True, deterministic=True)
    arrays = {"q": arr((tq, 8, 128), "bf16"), "k": arr((tk, 2, 128), "bf16"), "v": arr((tk, 2, 128), "bf16"),
              "out": arr((tq, 8, 128), "bf16"), "dout": arr((tq, 8, 128), "bf16"), "lse": arr((8, tq), "fp32"),
              "dq": arr((tq, 8, 128), "bf16"), "dk": arr((tk, 2, 128), "bf16"), "dv": arr((tk, 2, 128), "bf16"),
              "cu_seqlens_q": arr((b + 1,), "i32"), "cu_seqlens_k": arr((b + 1,), "i32"), "max_seqlen_q": 60,
              "max_seqlen_k": 200, "workspace": arr((size,), "u8")}
    return fa4_aot.backward_varlen, arrays, {"causal": True, "deterministic": True, "order": None}


def decode():
    b, sq, hq, hkv, d = 4, 2, 32, 8, 128
    splits = 3
    size = fa4_aot.forward_kvcache_workspace_bytes(b, sq, hq, hkv, d, 640, num_splits=splits)
    arrays = {"q": arr((b, sq, hq, d), "bf16"), "k_cache": arr((40, 64, hkv, d), "bf16"),
              "v_cache": arr((40, 64, hkv, d), "bf16"), "out": arr((b, sq, hq, d), "bf16"),
              "lse": arr((b, hq, sq), "fp32"), "cache_seqlens": arr((b,), "i32"), "workspace": arr((size,), "u8")}
    options = {"page_table": arr((b, 10), "i32"), "causal": False, "num_splits": splits}
    return fa4_aot.forward_kvcache, arrays, options


def local_forward():
    fn, arrays, options = dense_forward()
    return fn, arrays, {**options, "window_size": (128, 0), "softcap": 30.0, "learnable_sink": arr((4,), "fp32")}


def local_varlen_forward():
    fn, arrays, options = varlen_forward()
    return fn, arrays, {**options, "window_size": (-1, 7), "learnable_sink": arr((8,), "fp32")}


def local_backward():
    """The capped local backward (SUBSET's bwd bf16 d64 local softcap) with sinks and their gradient."""
    b, sq, sk, hq, hkv, d = 2, 100, 300, 4, 2, 64
    size = fa4_aot.backward_workspace_bytes(b, sq, hq, d, local=True)
    q, out, dout, dq = (arr((b, sq, hq, d), "bf16") for _ in range(4))
    k, v, dk, dv = (arr((b, sk, hkv, d), "bf16") for _ in range(4))
    arrays = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": arr((b, hq, sq), "fp32"), "dq": dq, "dk": dk,
              "dv": dv, "workspace": arr((size,), "u8")}
    return fa4_aot.backward, arrays, {"window_size": (128, 0), "softcap": 30.0, "learnable_sink": arr((4,), "fp32"),
                                      "dsink": arr((4,), "fp32")}


CALLS = {"forward": dense_forward, "backward": dense_backward, "forward_varlen": varlen_forward,
         "backward_varlen": varlen_backward, "forward_kvcache": decode, "forward_local": local_forward,
         "forward_varlen_local": local_varlen_forward, "backward_local": local_backward}


# ------------------------------------------------------------------ spoiling
def spoiled_arrays(name: str, a, others: dict) -> list:
    """Replacements for array ``name`` (good: ``a``) that no launch can take, or that
    alias another argument."""
    if isinstance(a, int):  # a size (max_seqlen)
        return [0, -1, 300.9, True, "300", None, 2**31, [60]]
    shape, strides = a.shape, a.strides
    out = [None, 3, "q", [1, 2], object(), arr(shape, "u8" if a.dtype != "u8" else "fp32"),
           arr(shape[:-1] or (1,), a.dtype), arr((*shape, 1), a.dtype), arr(shape, a.dtype, ptr=fresh() + 2),
           arr(tuple(0 if i == 0 else n for i, n in enumerate(shape)), a.dtype),
           arr(tuple(n + 1 if i == 0 else n for i, n in enumerate(shape)), a.dtype),
           arr(shape, a.dtype, strides=tuple(-s for s in strides)),
           arr(shape, a.dtype, strides=tuple(s * 2 for s in strides))]
    if len(shape) > 1:
        out.append(arr(shape, a.dtype, strides=(*strides[:-1], 2)))  # last dim not contiguous
        out.append(arr(shape, a.dtype, strides=(strides[0] + 1, *strides[1:])))  # not 16-byte strides
    out += [o for o in others.values() if isinstance(o, DeviceArray) and o is not a]  # aliases
    out.append(DeviceArray(a.ptr, shape, strides, a.dtype, 1))  # on another device
    return out


SPOILED_OPTIONS = {
    "softmax_scale": [float("nan"), float("inf"), 1e39, -1e39, "1", [1.0], True, {}],
    "causal": ["False", None, [True], 2, 0.5],
    "deterministic": ["yes", None, [False], 3],
    "stream": [-1, 2**64, "0", 1.5, None, [0]],
    "q_tiles": [0, 3, True, "1", 1.5, [1]],
    "num_splits": [0, -1, 129, True, "2", 2.0, [2]],
    "order": ["heaviest", 1, [None], "LPT"],
    "page_table": [3, "table", arr((4, 10), "fp32"), arr((5, 10), "i32"), arr((4, 10), "i32", strides=(20, 1))],
    "workspace": [3, arr((8,), "u8"), arr((1 << 16,), "u8", ptr=fresh() + 2), arr((64, 64), "u8", strides=(1, 64))],
    "window_size": [(-2, 0), (0, -3), (1.5, 0), (True, 0), "128", (1, 2, 3), 128, [None], (2**31, 0)],
    "softcap": [float("inf"), float("nan"), -1.0, True, "50", [50.0], 1e39],
    "learnable_sink": [3, "sink", arr((3,), "fp32"), arr((4, 1), "fp32"), arr((4,), "bf16"),
                       arr((4,), "fp32", strides=(2,)), arr((4,), "fp32", ptr=fresh() + 2)],
    "dsink": [3, "dsink", arr((3,), "fp32"), arr((4, 1), "fp32"), arr((4,), "bf16"),
              arr((4,), "fp32", strides=(2,)), arr((4,), "fp32", ptr=fresh() + 2)],
}


def draw(rng: random.Random, name: str):
    """A good call of entry point ``name`` with one or two arguments spoilt: (function,
    args, kwargs, what was spoilt)."""
    fn, arrays, options = CALLS[name]()
    spoilt = []
    for _ in range(rng.choice((1, 1, 2))):
        pool = list(arrays) + [o for o in options if o in SPOILED_OPTIONS or o == "stream"] + ["stream"]
        target = rng.choice(pool)
        if target in arrays:
            arrays[target] = rng.choice(spoiled_arrays(target, arrays[target], arrays))
        else:
            options[target] = rng.choice(SPOILED_OPTIONS.get(target, SPOILED_OPTIONS["stream"]))
        spoilt.append(target)
    return fn, list(arrays.values()), options, spoilt


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_good_call_launches(driver, name):
    fake, _ = driver
    fn, arrays, options = CALLS[name]()
    fn(*arrays.values(), **options)
    assert fake.launched


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("seed", range(3))
def test_every_refusal_is_typed_and_launches_nothing(driver, name, seed):
    fake, library = driver
    rng = random.Random(f"{name}-{seed}")
    refused = 0
    for _ in range(60):
        fn, args, kwargs, spoilt = draw(rng, name)
        fake.launched.clear()
        try:
            fn(*args, **kwargs)
        except Fa4AotError:
            refused += 1
            assert not fake.launched, (spoilt, fake.launched)
        except Exception as e:  # noqa: BLE001 - the point: nothing but Fa4AotError escapes
            pytest.fail(f"{name} spoilt at {spoilt}: {type(e).__name__}: {e}")
    assert refused > 30  # most spoilt calls are refusals


# ------------------------------------------------------------------ the torch adapters
torch = pytest.importorskip("torch")


@pytest.fixture
def adapters(driver, monkeypatch):
    """fa4_aot.torch with CPU tensors taken as device 0's (their host pointers stand in
    for device ones): the adapters' own checks and allocations run, the launches are
    the faked driver's."""
    from fa4_aot.torch import kvcache as torch_decode  # flash_attn_with_kvcache's launches
    from fa4_aot.torch import dense as torch_dense
    from fa4_aot.torch import tensors
    from fa4_aot.torch import varlen as torch_varlen

    real, bases = tensors.as_device_array, {}

    def as_device_array(t):
        """A CPU tensor as device 0's, each storage at an address of its own (aligned as
        the GPU's allocator aligns), its views at their offsets from it."""
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in tensors.DTYPES:
            storage = t.untyped_storage().data_ptr()
            base = bases.setdefault(storage, fresh())
            return DeviceArray(base + t.data_ptr() - storage, tuple(t.shape), tuple(t.stride()),
                               tensors.DTYPES[t.dtype], 0)
        return real(t)

    for module in (torch_dense, torch_decode, torch_varlen):
        monkeypatch.setattr(module, "as_device_array", as_device_array)
    monkeypatch.setattr(torch_dense, "stream_of", lambda t: 0)
    monkeypatch.setattr(torch_dense, "current_stream", lambda device: 0)
    monkeypatch.setattr(torch_decode, "current_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    return driver


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)


def torch_calls():
    from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd, flash_attn_varlen_bwd, flash_attn_varlen_fwd
    from fa4_aot.torch import flash_attn_with_kvcache

    b, sq, sk, hq, hkv = 2, 100, 300, 4, 2
    q, k, v = _t(b, sq, hq, 64), _t(b, sk, hkv, 64), _t(b, sk, hkv, 64)
    h = torch.float16
    fq, fk, fv, fo, fdo = _t(b, sq, hq, 64, dtype=h), _t(b, sk, hkv, 64, dtype=h), _t(b, sk, hkv, 64, dtype=h), \
        _t(b, sq, hq, 64, dtype=h), _t(b, sq, hq, 64, dtype=h)
    lse = _t(b, hq, sq, dtype=torch.float32)
    tq, tk = 100, 300
    cu_q = torch.tensor([0, 30, 60, 100], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 200, 300], dtype=torch.int32)
    pq, pk, pv, pout, pdout = _t(tq, 8, 128), _t(tk, 2, 128), _t(tk, 2, 128), _t(tq, 8, 128), _t(tq, 8, 128)
    plse = _t(8, tq, dtype=torch.float32)
    cache_k, cache_v = _t(40, 64, 8, 128), _t(40, 64, 8, 128)
    table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    lengths = torch.tensor([10, 100, 300, 500], dtype=torch.int32)
    return {
        "flash_attn_fwd": (flash_attn_fwd, [q, k, v], {"causal": False}),
        "flash_attn_bwd": (flash_attn_bwd, [fq, fk, fv, fo, fdo, lse], {}),
        "flash_attn_varlen_fwd": (flash_attn_varlen_fwd, [pq, pk, pv, cu_q, cu_k, 60, 200], {"causal": True}),
        "flash_attn_varlen_bwd": (flash_attn_varlen_bwd, [pq, pk, pv, pout, pdout, plse, cu_q, cu_k, 60, 200],
                                  {"causal": True, "deterministic": True}),
        "flash_attn_with_kvcache": (flash_attn_with_kvcache, [_t(4, 2, 32, 128), cache_k, cache_v, _t(4, 2, 8, 128),
                                                              _t(4, 2, 8, 128)],
                                    {"cache_seqlens": lengths, "page_table": table,
                                     "num_splits": 3, "causal": False}),
    }


def spoiled_tensor(rng, t):
    if not isinstance(t, torch.Tensor):  # a size
        return rng.choice([0, -1, 300.9, True, "300", None, 2**31])
    choices = [None, 3, "q", t.tolist() if t.numel() < 50 else [1.0], t.to(torch.float64), t[..., :-1], t[None],
               t.reshape(-1), t.transpose(0, -1), t[:0]]
    if t.dim() > 1:
        choices.append(t.narrow(-1, 1, t.shape[-1] - 1))
    return rng.choice(choices)


TORCH_OPTIONS = {"softmax_scale": [float("nan"), 1e39, "1", [1.0], True], "causal": ["False", None, [True], 2],
                 "window_size": [(-2, 0), (1.5, 0), "128", (1, 2, 3)], "softcap": [float("inf"), -1.0, True, "50"],
                 "deterministic": ["yes", [False], 2], "num_splits": [0, 129, True, "2", 2.0],
                 "q_tiles": [0, 3, True, "1"], "order": ["heaviest", 1]}


@pytest.mark.parametrize("seed", range(2))
def test_the_torch_adapters_refuse_with_typed_errors_and_leave_every_tensor_as_it_was(adapters, seed):
    fake, _ = adapters
    rng = random.Random(f"torch-{seed}")
    for name, (fn, args, kwargs) in torch_calls().items():  # the good calls launch
        fake.launched.clear()
        fn(*args, **kwargs)
        assert fake.launched, name
    refused = 0
    for _ in range(150):
        calls = torch_calls()
        name = rng.choice(sorted(calls))
        fn, args, kwargs = calls[name]
        if rng.random() < 0.6:
            i = rng.randrange(len(args))
            args[i] = spoiled_tensor(rng, args[i])
            spoilt = f"argument {i}"
        else:
            option = rng.choice(sorted(TORCH_OPTIONS))
            kwargs[option] = rng.choice(TORCH_OPTIONS[option])
            spoilt = option
        before = [t.clone() for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
        fake.launched.clear()
        try:
            fn(*args, **kwargs)
        except Fa4AotError:  # first: DTypeError is a TypeError too
            refused += 1
            assert not fake.launched, (name, spoilt)
            after = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
            assert all(torch.equal(x, y) for x, y in zip(before, after)), f"{name} spoilt at {spoilt} wrote"
        except TypeError as e:
            if "unexpected keyword" not in str(e):  # an option this function has not: Python's own
                pytest.fail(f"{name} spoilt at {spoilt}: TypeError: {e}")
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{name} spoilt at {spoilt}: {type(e).__name__}: {e}")
    assert refused > 60


def test_a_repeated_torch_forward_with_sinks_takes_the_repeat_path(adapters, monkeypatch):
    """flash_attn_fwd with outputs and sinks given, called again with the same tensors:
    launched again from its kept plan, not checked and packed anew (gpt-oss gives sinks
    on every layer); a sink at another address is a new call."""
    from fa4_aot.torch import dense as torch_dense

    fake, _ = adapters
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch_dense, "current_stream", lambda device: 0)
    checked, run_forward = [], torch_dense.run_forward
    monkeypatch.setattr(torch_dense, "run_forward", lambda *a: (checked.append(a[-1]), run_forward(*a)))
    q, k, v, out = _t(2, 100, 4, 64), _t(2, 300, 2, 64), _t(2, 300, 2, 64), _t(2, 100, 4, 64)
    lse, sink = _t(2, 4, 100, dtype=torch.float32), _t(4, dtype=torch.float32)
    for _ in range(3):
        torch_dense.flash_attn_fwd(q, k, v, out=out, lse=lse, softcap=30.0, learnable_sink=sink)
    assert len(checked) == 1 and len(fake.launched) == 3
    torch_dense.flash_attn_fwd(q, k, v, out=out, lse=lse, softcap=30.0, learnable_sink=_t(4, dtype=torch.float32))
    assert len(checked) == 2


def test_the_torch_layer_takes_local_gradients(adapters):
    """flash_attn_func with a window, sinks and a cap: autograd launches the local
    backward and its sinks' gradient (the fourth launch, sink_grad), and hands each input
    a gradient of its shape; with sinks that need no gradient, no sink_grad is launched.
    (flash_attn_varlen_func refuses CPU tensors: its gradients are tests/gpu's.)"""
    from fa4_aot.torch import flash_attn_func

    fake, _ = adapters
    for sink_grad in (True, False):
        q, k, v = (_t(1, 64, 2, 64).requires_grad_() for _ in range(3))
        sink = _t(2, dtype=torch.float32).requires_grad_(sink_grad)
        out = flash_attn_func(q, k, v, window_size=(16, 0), softcap=30.0, learnable_sink=sink)
        fake.launched.clear()
        out.sum().backward()
        assert fake.launched and any("sink_grad" in str(fn) for fn in fake.launched) == sink_grad, fake.launched
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
        assert (sink.grad is not None and sink.grad.shape == (2,)) == sink_grad


def test_every_bad_sink_gradient_is_refused(driver):
    """The local backward's dsink: each bad one (not an array, wrong shape, dtype, stride
    or alignment, over dq or q, or without the sinks it is the gradient of) is refused with a
    typed error and nothing launched; the good call launches the sinks' gradient too."""
    fake, _ = driver
    fn, arrays, options = local_backward()
    over = [DeviceArray(arrays[n].ptr, (4,), (1,), "fp32", arrays[n].device) for n in ("dq", "q")]
    bad = [dict(options, dsink=x) for x in SPOILED_OPTIONS["dsink"] + over]
    bad.append({k: x for k, x in options.items() if k != "learnable_sink"})
    for kwargs in bad:
        fake.launched.clear()
        with pytest.raises(Fa4AotError):
            fn(*arrays.values(), **kwargs)
        assert not fake.launched, kwargs
    fn(*arrays.values(), **options)
    assert any("sink_grad" in str(f) for f in fake.launched), fake.launched
