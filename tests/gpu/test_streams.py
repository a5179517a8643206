"""Foreign arrays made on a side stream, launched on another: CuPy (DLPack and
__cuda_array_interface__ v3) and JAX (DLPack), against a torch float32 reference.

Each producer's inputs are written last on their stream, behind seconds of queued
matrix products, so a launch that did not wait for that stream would read the zeros
written first. The launch stream is another non-blocking stream (the legacy default
stream does not order non-blocking ones), and nothing waits on the device as a whole
between the producer's work and the launch (a device synchronize would wait for the
producer whether or not the launch does). Each test runs again with the wait taken
away, and must then read wrong data: the check detects a missing wait. Skipped without
cupy / jax or a GPU.
"""

import os

import pytest

torch = pytest.importorskip("torch")

import fa4_aot  # noqa: E402

from fa4_aot.launch import arrays as fa4_arrays  # noqa: E402

from .test_fwd import _check  # noqa: E402

B, SQ, SK, HQ, HKV, D = 2, 700, 900, 4, 2, 64
BUSY_MATMULS = 40  # each 4096^3 fp32: the side stream stays busy for a while


def _reference_inputs(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1234)
    mk = lambda s, h: torch.randn(B, s, h, D, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    return mk(SQ, HQ), mk(SK, HKV), mk(SK, HKV)


class _CAIOnly:
    """A CuPy array seen through __cuda_array_interface__ alone (its v3 ``stream``)."""

    def __init__(self, array):
        self.interface = array.__cuda_array_interface__  # read on the producer's current stream

    @property
    def __cuda_array_interface__(self):
        return self.interface


def _cupy_on_side_stream(cp, tensors):
    """Copies of ``tensors`` written on a busy non-blocking side stream (zeros first)."""
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        sources = [cp.asarray(t.cpu().numpy()) for t in tensors]  # host copies first: they may block
        side.synchronize()
        out = [cp.zeros(t.shape, dtype=cp.float16) for t in tensors]
        busy = cp.ones((4096, 4096), dtype=cp.float32)
        for _ in range(BUSY_MATMULS):
            busy = busy @ busy * 1e-4
        for dst, src in zip(out, sources):
            dst[...] = src  # device to device, last on the side stream
    return side, out


def _checked(out, lse, q, k, v, wait: bool):
    """``_check``, or with the wait taken away its failure: the output read the producer's
    inputs before they were written."""
    if wait:
        _check(out, lse, q, k, v, False)
    else:
        with pytest.raises(AssertionError):
            _check(out, lse, q, k, v, False)


def _outputs(q):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, HQ, SQ), float("nan"), device="cuda")
    torch.cuda.synchronize()  # before the producer starts: nothing of it is waited for here
    return out, lse


@pytest.mark.parametrize("wait", [True, False], ids=["waits", "wait_removed"])
@pytest.mark.parametrize("protocol", ["dlpack", "cuda_array_interface"])
def test_cupy_arrays_from_a_side_stream(protocol, wait, monkeypatch):
    cp = pytest.importorskip("cupy")
    q, k, v = _reference_inputs(torch.float16)
    out, lse = _outputs(q)
    launch = torch.cuda.Stream()
    side, (cq, ck, cv) = _cupy_on_side_stream(cp, (q, k, v))
    if protocol == "dlpack":
        if not wait:  # the producer asked for no ordering (DLPack's stream -1)
            monkeypatch.setattr(fa4_arrays, "dlpack_stream", lambda handle: -1)
        with side:  # CuPy's DLPack export orders its current stream before the consumer's
            fa4_aot.forward(cq, ck, cv, out, lse, stream=launch.cuda_stream)
    else:
        with side:  # CuPy names its current stream in the interface (v3)
            wrapped = [_CAIOnly(x) for x in (cq, ck, cv)]
        assert wrapped[0].__cuda_array_interface__.get("stream") == side.ptr, "CuPy does not export its stream"
        if not wait:  # an interface that names no stream: nothing to wait for
            for w in wrapped:
                w.interface = {n: x for n, x in w.interface.items() if n != "stream"}
        fa4_aot.forward(*wrapped, out, lse, stream=launch.cuda_stream)
    launch.synchronize()
    _checked(out, lse, q, k, v, wait)
    side.synchronize()


def test_jax_arrays_from_their_own_streams():
    """JAX through DLPack, asked on the launch stream (JAX refuses DLPack's -1). No wait
    can be taken away here: JAX's exports (DLPack, and the raw unsafe_buffer_pointer)
    wait for the buffer before they return it, so a launch without fa4_aot's ordering
    read the right data on the H200; this shows the interplay works, not fa4_aot's wait."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU to torch too
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU backend")
    q, k, v = _reference_inputs(torch.bfloat16)
    host = [jnp.asarray(t.float().cpu().numpy()) for t in (q, k, v)]

    @jax.jit
    def late(x, busy):
        for _ in range(BUSY_MATMULS):  # unrolled: all of it queued before x is written
            busy = busy @ busy * 1e-4
        return (x + 0 * busy[0, 0]).astype(jnp.bfloat16)

    busy = jnp.ones((4096, 4096), dtype=jnp.float32)
    jax.block_until_ready((host, busy))
    out, lse = _outputs(q)
    launch = torch.cuda.Stream()
    jq, jk, jv = (late(x, busy) for x in host)  # asynchronous: still running when we launch
    fa4_aot.forward(jq, jk, jv, out, lse, stream=launch.cuda_stream)  # DLPack with our stream (not -1)
    launch.synchronize()
    _check(out, lse, q, k, v, False)
    jax.block_until_ready((jq, jk, jv))


@pytest.mark.parametrize("wait", [True, False], ids=["waits", "wait_removed"])
def test_torch_arrays_through_the_raw_api_on_a_side_stream(wait, monkeypatch):
    """Torch tensors through DLPack (the raw API, not the adapter): torch orders its
    current stream, where they were written, before the launch stream."""
    q, k, v = _reference_inputs(torch.bfloat16)
    out, lse = _outputs(q)
    if not wait:  # DLPack's stream -1: the producer orders nothing
        monkeypatch.setattr(fa4_arrays, "dlpack_stream", lambda handle: -1)
    side, launch = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning before the writes
        qs, ks, vs = (torch.zeros_like(x) for x in (q, k, v))
        for dst, src in zip((qs, ks, vs), (q, k, v)):
            dst.copy_(src)
        fa4_aot.forward(qs, ks, vs, out, lse, stream=launch.cuda_stream)
    launch.synchronize()
    _checked(out, lse, q, k, v, wait)
    side.synchronize()
