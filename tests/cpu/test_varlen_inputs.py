"""The varlen forward's input checks: every bad argument is a typed error before any launch,
and a good call packs the launch the varlen kernel's plan asks for."""

import pytest

from fa4_aot.arrays import DeviceArray
from fa4_aot.errors import DTypeError, Fa4AotError, LayoutError, ShapeError
from fa4_aot.varlen import check_forward_varlen, forward_varlen

BASE = 0x7F0000000000


def packed(total, h, d, dtype="bf16", strides=None, ptr=BASE):
    return DeviceArray(ptr, (total, h, d), strides or (h * d, d, 1), dtype, 0)


def ints(n, ptr=BASE, dtype="i32", strides=None):
    return DeviceArray(ptr, (n,), strides or (1,), dtype, 0)


def arrays(**over):
    a = {"q": packed(100, 8, 128), "k": packed(300, 2, 128), "v": packed(300, 2, 128), "out": packed(100, 8, 128),
         "lse": DeviceArray(BASE, (8, 100), (100, 1), "fp32", 0), "cu_seqlens_q": ints(4), "cu_seqlens_k": ints(4)}
    a.update(over)
    return {n: x for n, x in a.items() if x is not None}


def test_a_good_problem_passes():
    sizes = check_forward_varlen(arrays(), 60, 200)
    assert (sizes["total_q"], sizes["total_k"], sizes["batch"], sizes["heads_q"], sizes["heads_kv"]) == (100, 300, 3,
                                                                                                        8, 2)


@pytest.mark.parametrize("over, maxes, error, message", [
    ({"q": DeviceArray(BASE, (1, 100, 8, 128), (102400, 1024, 128, 1), "bf16", 0)}, (60, 200), ShapeError, "rank 3"),
    ({"cu_seqlens_q": ints(4, dtype="fp32")}, (60, 200), DTypeError, "int32"),
    ({"cu_seqlens_k": ints(5)}, (60, 200), ShapeError, r"\(4,\)"),
    ({"cu_seqlens_q": ints(1), "cu_seqlens_k": ints(1)}, (60, 200), ShapeError, "batch >= 1"),
    ({"cu_seqlens_q": ints(4, strides=(2,))}, (60, 200), LayoutError, "contiguous"),
    ({"cu_seqlens_q": ints(4, ptr=BASE + 2)}, (60, 200), LayoutError, "4-byte"),
    ({"seqused_q": ints(4)}, (60, 200), ShapeError, r"\(3,\)"),
    ({"seqused_k": ints(3, dtype="u8")}, (60, 200), DTypeError, "int32"),
    ({}, (0, 200), ShapeError, "max_seqlen_q"),
    ({}, (60, True), ShapeError, "max_seqlen_k"),
    ({}, (60.0, 200), ShapeError, "max_seqlen_q"),
    ({}, (2**31, 200), ShapeError, "max_seqlen_q"),
    ({"lse": DeviceArray(BASE, (100, 8), (8, 1), "fp32", 0)}, (60, 200), ShapeError, "heads_q, total_q"),
    ({"lse": DeviceArray(BASE, (1, 8, 100), (800, 100, 1), "fp32", 0)}, (60, 200), ShapeError, "rank 2"),
    ({"lse": DeviceArray(BASE, (8, 100), (200, 1), "fp32", 0)}, (60, 200), LayoutError, "contiguous"),
    ({"k": packed(300, 3, 128), "v": packed(300, 3, 128)}, (60, 200), ShapeError, "multiple of heads_kv"),
    ({"v": packed(299, 2, 128)}, (60, 200), ShapeError, "k's shape"),
    ({"q": packed(100, 8, 128, "fp16"), "out": packed(100, 8, 128, "fp16")}, (60, 200), DTypeError, "one dtype"),
    ({"out": packed(100, 8, 128, strides=(1024, 1, 8))}, (60, 200), LayoutError, "contiguous"),
])
def test_bad_inputs(over, maxes, error, message):
    with pytest.raises(error, match=message):
        check_forward_varlen(arrays(**over), *maxes)


class _FakeLibrary:
    """Records the launch instead of making it (no driver, no GPU)."""

    def __init__(self, manifest):
        self.manifest = manifest
        self.launches = []

    def launch_again(self, key, waits=(), aliases=()):
        return False

    def arch(self, device):
        return "sm90a"

    def launch(self, row, device, stream, values, tensors, key=None, waits=(), aliases=()):
        self.launches.append((row, values, tensors))


def test_a_call_packs_the_varlen_plan(built):
    from fa4_aot.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    a = arrays(q=packed(100, 8, 128), k=packed(300, 8, 128), v=packed(300, 8, 128), seqused_k=ints(3, ptr=BASE + 64))
    forward_varlen(a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_seqlens_q"], a["cu_seqlens_k"], 60, 200,
                   seqused_k=a["seqused_k"], causal=True, library=library)
    (row, values, tensors), = library.launches
    assert row["name"] == "fwd.sm90a.bf16.d128.causal.varlen"
    for slot in row["launches"][0]["params"]:  # every slot's values and tensors are there
        for name in slot.get("fields", []):
            assert name in values, (slot, name)
        if "tensor" in slot:
            assert slot["tensor"] in tensors, slot
    assert (values["use_seqused_q"], values["use_seqused_k"], values["batch"], values["one"]) == (0, 1, 3, 1)
    assert tensors["seqused_q"]["ptr"] == a["cu_seqlens_q"].ptr  # not given: any int32 vector of b entries


def test_a_non_finite_scale_is_refused(built):
    from fa4_aot.manifest import Manifest

    folder, _ = built
    a = arrays()
    for scale in (float("nan"), float("inf"), "0.1"):
        with pytest.raises(Fa4AotError):
            forward_varlen(a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_seqlens_q"], a["cu_seqlens_k"], 60, 200,
                           softmax_scale=scale, library=_FakeLibrary(Manifest(folder)))
