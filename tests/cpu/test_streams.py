"""Streams of foreign arrays, without a GPU: what the launch asks DLPack producers for and
which __cuda_array_interface__ streams it waits on (fake producers record it).

DLPack: the consumer passes the stream it will use (1: the legacy default stream, 2: the
per-thread one, else the handle; never -1, which JAX refuses), and the producer orders its
work before that stream. __cuda_array_interface__ v3: the producer names its stream, and
the consumer makes its own stream wait for it (an event) where the two differ.
"""

import ctypes

import pytest

import fa4_aot.dense as api
from fa4_aot.launch import loader
from fa4_aot.launch.arrays import _DLTensor, as_device_array, as_device_arrays, dlpack_stream
from fa4_aot.errors import DeviceError

from .test_arguments import B, D, HKV, HQ, SK, SQ, good_forward
from .test_inputs import fresh
from .test_loader import _FakeContext, _RecordingLibrary


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype, _new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_NAME = ctypes.c_char_p(b"dltensor")  # the capsule keeps the pointer: the name must outlive it


class DLPackProducer:
    """A CUDA array behind __dlpack__ that records the ``stream`` each call asked for
    (``"none"`` where the call passed no stream)."""

    def __init__(self, shape, dtype_code=2, bits=16, refuse=None):
        n = len(shape)
        self.asked, self.refuse = [], refuse
        self._shape = (ctypes.c_int64 * n)(*shape)
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        self._strides = (ctypes.c_int64 * n)(*reversed(strides))
        self._managed = _DLManagedTensor()
        t = self._managed.dl_tensor
        t.data, t.device.device_type, t.device.device_id, t.ndim = fresh(), 2, 0, n
        t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype_code, bits, 1
        t.shape, t.strides, t.byte_offset = self._shape, self._strides, 0

    def __dlpack_device__(self):
        return 2, 0

    def __dlpack__(self, stream="none"):
        self.asked.append(stream)
        if self.refuse is not None and stream in self.refuse:
            raise ValueError(f"stream {stream} is not supported")  # as JAX refuses -1
        return _new_capsule(ctypes.addressof(self._managed), _NAME, None)


class CAIProducer:
    """A CUDA array behind __cuda_array_interface__ v3, made on ``stream``."""

    def __init__(self, shape, typestr="<f2", stream=None, version=3):
        self.interface = {"data": (fresh(), False), "shape": tuple(shape), "typestr": typestr, "strides": None,
                          "version": version}
        if stream is not None:
            self.interface["stream"] = stream

    @property
    def __cuda_array_interface__(self):
        return self.interface


def fp16_forward_arrays(make):
    return {"q": make((B, SQ, HQ, D)), "k": make((B, SK, HKV, D)), "v": make((B, SK, HKV, D)),
            "out": make((B, SQ, HQ, D)), "lse": good_forward()["lse"]}


def test_dlpack_stream_values():
    assert [dlpack_stream(h) for h in (0, 1, 2, 0x7F00_1234)] == [1, 1, 2, 0x7F00_1234]


@pytest.mark.parametrize("stream,asked", [(0, 1), (1, 1), (2, 2), (0x5555_0000, 0x5555_0000)])
def test_dlpack_producers_are_asked_for_the_launch_stream(built, stream, asked):
    """Every DLPack array of a launch is asked for on its stream, as the protocol spells
    it; a producer that refuses -1 (JAX) is served."""
    library = _RecordingLibrary(built[0])
    arrays = fp16_forward_arrays(lambda shape: DLPackProducer(shape, dtype_code=4, refuse=(-1,)))  # bf16
    api.forward(*arrays.values(), stream=stream, library=library)
    assert library.launched == [("fwd.sm90a.bf16.d64", 0)]
    for name in ("q", "k", "v", "out"):
        assert arrays[name].asked == [asked], name
    assert library.last["stream"] == stream and library.last["waits"] == ()


def test_without_a_stream_no_stream_is_passed():
    producer = DLPackProducer((2, 3))
    assert as_device_array(producer).shape == (2, 3)
    assert producer.asked == ["none"]


def test_a_producers_refusal_is_a_typed_error():
    with pytest.raises(DeviceError, match="refused"):
        as_device_array(DLPackProducer((2, 3), refuse=(1,)), stream=0)


@pytest.mark.parametrize("producer,launch,waits", [
    (None, 0, ()),  # no stream: nothing to wait for
    (1, 0, ()),  # the legacy default stream is the launch's (0 and 1 are the same stream)
    (0x1000, 0x1000, ()),  # the same stream
    (0x1000, 0, (0x1000,)),  # another stream: the launch waits for it
    (2, 0x2000, (2,)),  # the per-thread default stream
])
def test_cuda_array_interface_streams_are_waited_for(producer, launch, waits):
    arrays = fp16_forward_arrays(lambda shape: CAIProducer(shape, stream=producer))
    got, got_waits = as_device_arrays(arrays, launch)
    assert got_waits == waits  # one wait per stream, however many arrays share it
    assert got["q"].shape == (B, SQ, HQ, D) and got["q"].dtype == "fp16"


def test_the_launch_passes_the_waits_on(built, monkeypatch):
    monkeypatch.setattr(api, "device_of", lambda arrays: 0)  # the interface names no device: the driver would
    library = _RecordingLibrary(built[0])
    arrays = fp16_forward_arrays(lambda shape: CAIProducer(shape, typestr="<V2", stream=0x1000))
    for a in arrays.values():
        if isinstance(a, CAIProducer):
            a.interface["descr"] = [("bfloat16", "<V2")]  # bf16 (fwd.sm90a.bf16.d64 is built)
    api.forward(*arrays.values(), stream=0x2000, library=library)
    assert library.last["waits"] == (0x1000,) and library.last["stream"] == 0x2000


def test_stream_zero_in_an_interface_is_refused():
    with pytest.raises(DeviceError, match="stream 0"):
        as_device_array(CAIProducer((2, 3), stream=0), stream=0)


def test_the_loader_orders_the_launch_after_each_producer(built, monkeypatch):
    """An event recorded on each producer's stream, then waited for on the launch's (one
    event per context, created once); a repeated launch waits again."""
    calls = []

    def fake_call(fn, *args):
        calls.append((fn.__name__, *[int(a) if hasattr(a, "getPtr") else a for a in args]))
        return "event" if fn is loader.cu.cuEventCreate else None

    monkeypatch.setattr(loader, "call", fake_call)
    monkeypatch.setattr(loader, "_Context", _FakeContext)
    library = loader.KernelLibrary(built[0])
    library._wait(70, 0x2000, (0x1000, 0x3000))
    names = [c[0] for c in calls]
    assert names == ["cuEventCreate", "cuEventRecord", "cuStreamWaitEvent", "cuEventRecord", "cuStreamWaitEvent"]
    assert calls[1][2] == 0x1000 and calls[2][1] == 0x2000 and calls[3][2] == 0x3000
    calls.clear()
    library._wait(70, 0x2000, ())
    assert calls == []
    library._plans["k"] = (0, 70, 0x2000, [], ())  # (device, context id, stream, launches, pinned)
    current = loader.cu.CUcontext(7)  # the plan's context: a repeat launches in it
    monkeypatch.setattr(loader.cu, "cuCtxGetCurrent", lambda: (loader.cu.CUresult.CUDA_SUCCESS, current))
    monkeypatch.setattr(loader.cu, "cuCtxGetId", lambda ctx: (loader.cu.CUresult.CUDA_SUCCESS, 70))
    assert library.launch_again("k", (0x1000,))
    assert [c[0] for c in calls] == ["cuEventRecord", "cuStreamWaitEvent"] and calls[1][1] == 0x2000
