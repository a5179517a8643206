"""Foreign arrays made on a side stream, launched on another: CuPy (DLPack and
__cuda_array_interface__ v3) and JAX (DLPack), against a torch float32 reference.

Each producer's inputs are written last on their stream, behind seconds of queued
matrix products, so a launch that did not wait for that stream would read the zeros
written first. The launch stream is another non-blocking stream (the legacy default
stream does not order non-blocking ones). Skipped without cupy / jax or a GPU.
"""

import os

import pytest

torch = pytest.importorskip("torch")

import fa4_aot  # noqa: E402

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


@pytest.mark.parametrize("protocol", ["dlpack", "cuda_array_interface"])
def test_cupy_arrays_from_a_side_stream(protocol):
    cp = pytest.importorskip("cupy")
    q, k, v = _reference_inputs(torch.float16)
    torch.cuda.synchronize()
    side, (cq, ck, cv) = _cupy_on_side_stream(cp, (q, k, v))
    launch = torch.cuda.Stream()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, HQ, SQ), float("nan"), device="cuda")
    torch.cuda.synchronize()  # out, lse ready; the side stream is still busy
    if protocol == "dlpack":
        with side:  # CuPy's DLPack export orders its current stream before the consumer's
            fa4_aot.forward(cq, ck, cv, out, lse, stream=launch.cuda_stream)
    else:
        with side:  # CuPy names its current stream in the interface (v3)
            wrapped = [_CAIOnly(x) for x in (cq, ck, cv)]
        assert wrapped[0].__cuda_array_interface__.get("stream") == side.ptr, "CuPy does not export its stream"
        fa4_aot.forward(*wrapped, out, lse, stream=launch.cuda_stream)
    launch.synchronize()
    _check(out, lse, q, k, v, False)


def test_jax_arrays_from_their_own_streams():
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
    jq, jk, jv = (late(x, busy) for x in host)  # asynchronous: still running when we launch
    launch = torch.cuda.Stream()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, HQ, SQ), float("nan"), device="cuda")
    torch.cuda.synchronize()
    fa4_aot.forward(jq, jk, jv, out, lse, stream=launch.cuda_stream)  # DLPack with our stream (not -1)
    launch.synchronize()
    _check(out, lse, q, k, v, False)


def test_torch_arrays_through_the_raw_api_on_a_side_stream():
    """Torch tensors through DLPack (the raw API, not the adapter): torch orders its
    current stream, where they were written, before the launch stream."""
    q, k, v = _reference_inputs(torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning before the writes
        qs, ks, vs = (torch.zeros_like(x) for x in (q, k, v))
        for dst, src in zip((qs, ks, vs), (q, k, v)):
            dst.copy_(src)
        launch = torch.cuda.Stream()
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B, HQ, SQ), float("nan"), device="cuda")
        fa4_aot.forward(qs, ks, vs, out, lse, stream=launch.cuda_stream)
    launch.synchronize()
    side.synchronize()
    _check(out, lse, q, k, v, False)
