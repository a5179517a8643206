"""The varlen forward's and backward's input checks: every bad argument is a typed error
before any launch, and a good call packs the launches the varlen kernels' plans ask for."""

import itertools

import pytest

from fa4_aot.launch.arrays import DeviceArray
from fa4_aot.launch.loader import missing_sources
from fa4_aot.errors import DTypeError, Fa4AotError, LayoutError, OptionError, ShapeError, UnsupportedVariantError
from fa4_aot.varlen import (backward_varlen, backward_varlen_workspace_bytes, check_backward_varlen,
                            check_forward_varlen, forward_varlen, forward_varlen_workspace_bytes)

BASE = 0x7F0000000000
_ARRAYS = itertools.count(1)


def fresh() -> int:
    """An address no other array of these tests takes: each array its own memory."""
    return BASE + next(_ARRAYS) * (1 << 36)


def packed(total, h, d, dtype="bf16", strides=None, ptr=None):
    ptr = fresh() if ptr is None else ptr
    return DeviceArray(ptr, (total, h, d), strides or (h * d, d, 1), dtype, 0)


def ints(n, ptr=None, dtype="i32", strides=None):
    ptr = fresh() if ptr is None else ptr
    return DeviceArray(ptr, (n,), strides or (1,), dtype, 0)


def arrays(**over):
    a = {"q": packed(100, 8, 128), "k": packed(300, 2, 128), "v": packed(300, 2, 128), "out": packed(100, 8, 128),
         "lse": DeviceArray(fresh(), (8, 100), (100, 1), "fp32", 0), "cu_seqlens_q": ints(4), "cu_seqlens_k": ints(4)}
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
    ({"v": packed(299, 2, 128)}, (60, 200), ShapeError, "like k"),
    ({"q": packed(100, 8, 128, "fp16"), "out": packed(100, 8, 128, "fp16")}, (60, 200), DTypeError, "one dtype"),
    ({"out": packed(100, 8, 128, strides=(1024, 1, 8))}, (60, 200), LayoutError, "contiguous"),
])
def test_bad_inputs(over, maxes, error, message):
    with pytest.raises(error, match=message):
        check_forward_varlen(arrays(**over), *maxes)


def _sort_width(monkeypatch, library, width: int) -> None:
    """The varlen rows' heaviest-first bound (their ``limits``) set to ``width``."""
    for name in library.manifest.rows:
        if ".varlen" in name:
            monkeypatch.setitem(library.manifest.rows[name]["limits"], "lpt_max_batch", width)


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
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    a = arrays(q=packed(100, 8, 128), k=packed(300, 8, 128), v=packed(300, 8, 128), seqused_k=ints(3, ptr=BASE + 64))
    forward_varlen(a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_seqlens_q"], a["cu_seqlens_k"], 60, 200,
                   seqused_k=a["seqused_k"], causal=True, library=library)
    (row, values, tensors), = library.launches
    assert row["name"] == "fwd.sm90a.bf16.d128.causal.varlen"
    assert [launch.get("when") for launch in row["launches"]] == ["lpt", None]  # the sort, then attention
    for launch in row["launches"]:  # every slot's values and tensors are there
        assert not missing_sources(launch, values, tensors), launch["symbol"]
    assert (values["use_seqused_q"], values["use_seqused_k"], values["batch"]) == (0, 1, 3)
    assert tensors["q"]["shape"] == (1, 100, 8, 128)  # packed (total, h, d) as (1, total, h, d)
    assert tensors["seqused_q"]["ptr"] == a["cu_seqlens_q"].ptr  # not given: any int32 vector of b entries
    assert values["lpt"] == 0 and tensors["order"]["ptr"] == a["cu_seqlens_q"].ptr  # no workspace: plain


def call_forward(library, a=None, **options):
    a = a or arrays()
    forward_varlen(a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_seqlens_q"], a["cu_seqlens_k"], 60, 200,
                   causal=True, library=library, **options)
    return library.launches[-1][1:]


ORDER_WS = DeviceArray(BASE + 4096, (256,), (1,), "u8", 0)


def test_the_forward_workspace_evaluates_each_distinct_rule_once(built):
    """forward_varlen_workspace_bytes, asked on every call that sizes or checks a workspace,
    evaluates the varlen forward rows' distinct rules (kept per manifest), not every row's:
    the same size as the most any row's rule gives."""
    from fa4_aot.launch import workspace as ws
    from fa4_aot.launch.manifest import Manifest
    from fa4_aot.varlen import _workspace_bytes

    manifest = Manifest(built[0])
    rows = manifest.matching(kind="fwd", varlen=True)
    rules = manifest.workspace_rules(kind="fwd", varlen=True)
    assert len(rows) >= 3 and len(rules) == 1 and manifest.workspace_rules(kind="fwd", varlen=True) is rules
    for batch in (1, 3, 64, 65, 4096):
        every_row = max(_workspace_bytes(r["workspace"], ws.names(r["workspace"], {"batch": batch})) for r in rows)
        assert forward_varlen_workspace_bytes(batch, library=_FakeLibrary(manifest)) == every_row


def test_the_order_flag_and_workspace(built, monkeypatch):
    from fa4_aot import policy
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    assert forward_varlen_workspace_bytes(3, library=library) == 256
    assert forward_varlen_workspace_bytes(65, library=library) == 512
    values, tensors = call_forward(library, workspace=ORDER_WS, order="lpt")
    assert values["lpt"] == 1 and tensors["order"]["ptr"] == ORDER_WS.ptr
    values, tensors = call_forward(library, workspace=ORDER_WS, order="plain")
    assert values["lpt"] == 0
    for default in (False, True):  # order None: the policy's, where a workspace is given
        monkeypatch.setattr(policy, "VARLEN_LPT", default)
        assert call_forward(library, workspace=ORDER_WS)[0]["lpt"] == int(default)
        assert call_forward(library)[0]["lpt"] == 0
    _sort_width(monkeypatch, library, 2)  # past the sort's width: the plain order
    assert call_forward(library, workspace=ORDER_WS)[0]["lpt"] == 0


@pytest.mark.parametrize("options, error, message", [
    ({"order": "lpt"}, OptionError, "needs a workspace"),
    ({"order": "heaviest", "workspace": ORDER_WS}, OptionError, "order must be one of"),
    ({"order": "lpt", "workspace": DeviceArray(BASE, (8,), (1,), "u8", 0)}, ShapeError, "workspace has 8 bytes"),
    ({"order": "lpt", "workspace": DeviceArray(BASE + 2, (256,), (1,), "u8", 0)}, LayoutError, "4-byte aligned"),
    ({"order": "lpt", "workspace": DeviceArray(BASE, (256,), (2,), "u8", 0)}, LayoutError, "contiguous"),
])
def test_bad_order_options_raise_before_any_launch(built, options, error, message):
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    with pytest.raises(error, match=message):
        call_forward(library, **options)
    assert not library.launches


def test_lpt_past_the_sort_width_is_refused(built, monkeypatch):
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    _sort_width(monkeypatch, library, 2)
    with pytest.raises(ShapeError, match="sorts up to 2 sequences"):
        call_forward(library, workspace=ORDER_WS, order="lpt")


def test_a_non_finite_scale_is_refused(built):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    a = arrays()
    for scale in (float("nan"), float("inf"), "0.1"):
        with pytest.raises(Fa4AotError):
            forward_varlen(a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_seqlens_q"], a["cu_seqlens_k"], 60, 200,
                           softmax_scale=scale, library=_FakeLibrary(Manifest(folder)))


# ---------------------------------------------------------------- the backward
WS_BYTES = 1 << 24


def bwd_arrays(**over):
    a = arrays()
    a.update({"dout": packed(100, 8, 128), "dq": packed(100, 8, 128), "dk": packed(300, 2, 128),
              "dv": packed(300, 2, 128), "workspace": DeviceArray(fresh(), (WS_BYTES,), (1,), "u8", 0)})
    a.update(over)
    return {n: x for n, x in a.items() if x is not None}


def call_backward(a, maxes=(60, 200), library=None, **options):
    backward_varlen(a["q"], a["k"], a["v"], a["out"], a["dout"], a["lse"], a["dq"], a["dk"], a["dv"],
                    a["cu_seqlens_q"], a["cu_seqlens_k"], *maxes, a["workspace"],
                    seqused_q=a.get("seqused_q"), seqused_k=a.get("seqused_k"), library=library, **options)


def test_a_good_backward_problem_passes():
    sizes = check_backward_varlen(bwd_arrays(), 60, 200)
    assert (sizes["total_q"], sizes["total_k"], sizes["batch"]) == (100, 300, 3)


@pytest.mark.parametrize("over, maxes, error, message", [
    ({"dout": packed(99, 8, 128)}, (60, 200), ShapeError, "dout"),
    ({"dq": packed(100, 8, 128, "fp16")}, (60, 200), DTypeError, "dq"),
    ({"dk": packed(300, 8, 128)}, (60, 200), ShapeError, "dk"),
    ({"dv": packed(300, 2, 64)}, (60, 200), ShapeError, "dv"),
    ({"dv": DeviceArray(BASE, (1, 300, 2, 128), (76800, 256, 128, 1), "bf16", 0)}, (60, 200), ShapeError, "rank 3"),
    ({"dk": packed(300, 2, 128, strides=(256, 1, 2))}, (60, 200), LayoutError, "contiguous"),
    ({"dq": packed(100, 8, 128, ptr=BASE + 2)}, (60, 200), LayoutError, "aligned"),
    ({"cu_seqlens_k": ints(3)}, (60, 200), ShapeError, r"\(4,\)"),
    ({"cu_seqlens_q": ints(4, dtype="fp32")}, (60, 200), DTypeError, "int32"),
    ({"seqused_k": ints(4)}, (60, 200), ShapeError, r"\(3,\)"),
    ({}, (60, 0), ShapeError, "max_seqlen_k"),
])
def test_bad_backward_inputs(over, maxes, error, message):
    with pytest.raises(error, match=message):
        check_backward_varlen(bwd_arrays(**over), *maxes)


@pytest.mark.parametrize("over, error, message", [
    ({"workspace": DeviceArray(BASE, (1024,), (1,), "u8", 0)}, ShapeError, "workspace has 1024 bytes"),
    ({"workspace": DeviceArray(BASE + 16, (WS_BYTES,), (1,), "u8", 0)}, LayoutError, "aligned"),
    ({"workspace": DeviceArray(BASE, (WS_BYTES // 2, 2), (1, WS_BYTES // 2), "u8", 0)}, LayoutError, "contiguous"),
    ({"dout": packed(100, 8, 128, "fp16")}, DTypeError, "dout"),
])
def test_bad_backward_calls_raise_before_any_launch(built, over, error, message):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    with pytest.raises(error, match=message):
        call_backward(bwd_arrays(**over), library=library, causal=True, deterministic=True)
    assert library.launches == []


def test_a_backward_call_packs_every_launch_of_the_varlen_plan(built):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    a = bwd_arrays(seqused_q=ints(3, ptr=BASE + 64))
    call_backward(a, library=library, causal=True, deterministic=True)
    (row, values, tensors), = library.launches
    assert row["name"] == "bwd.sm90a.bf16.d128.causal.varlen.det"
    assert [launch["symbol"].split("_")[2] for launch in row["launches"]] == ["order", "preprocess", "kernel",
                                                                              "postprocess"]
    for launch in row["launches"]:
        assert not missing_sources(launch, values, tensors), launch["symbol"]
    tile = row["workspace"]["constants"]["query_tile"]
    assert values["ws_tiles"] == -(-100 // tile) + 3 and values["ws_rows"] == values["ws_tiles"] * tile
    assert (values["use_seqused_q"], values["use_seqused_k"]) == (1, 0)
    assert tensors["seqused_k"]["ptr"] == a["cu_seqlens_k"].ptr
    assert tensors["dk"]["strides"][1] == 256 and tensors["dq"]["strides"][2] == 128
    need = backward_varlen_workspace_bytes(100, 3, 8, 128, causal=True, deterministic=True, library=library)
    call_backward(bwd_arrays(workspace=DeviceArray(BASE, (need,), (1,), "u8", 0)), library=library, causal=True,
                  deterministic=True)
    # less than the order's room: the plain order, its regions where they were
    from fa4_aot import policy

    plain = need - 256  # batch 3: one 256-byte unit of order
    lpt_default = int(policy.varlen_backward_order(3, True, 200, 300, 8192) == "lpt")
    for size, lpt in ((need, lpt_default), (need - 1, 0), (plain, 0)):
        call_backward(bwd_arrays(workspace=DeviceArray(BASE, (size,), (1,), "u8", 0)), library=library,
                      causal=True, deterministic=True)
        values, tensors = library.launches[-1][1:]
        assert values["lpt"] == lpt and values["order_entries"] == 3 * lpt
        assert tensors["order"]["ptr"] == BASE and tensors["lse2"]["ptr"] == BASE + 256 * lpt
    with pytest.raises(ShapeError, match="workspace has"):
        call_backward(bwd_arrays(workspace=DeviceArray(BASE, (plain - 1,), (1,), "u8", 0)), library=library,
                      causal=True, deterministic=True)


def test_the_varlen_workspace_bounds_every_sequence_tile():
    """Sequence b's workspace tiles start at cu[b] // tile + b: for any cu_seqlens clamped as
    the kernels clamp them, increasing or lying, a sequence's tiles lie below ws_tiles, and
    for an increasing cu_seqlens no two sequences share a tile."""
    import random

    rng = random.Random(5)
    for _ in range(2000):
        tile, batch = rng.choice((64, 80)), rng.randint(1, 9)
        total = rng.randint(0, 1000)
        lengths = [rng.choice((0, 1, rng.randint(0, 300))) for _ in range(batch)]
        honest = rng.random() < 0.5
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n if honest else rng.randint(-50, 1200))
        total = cu[-1] if honest else total
        ws_tiles = -(-total // tile) + batch
        seen = set()
        for b in range(batch):
            offset = min(max(cu[b], 0), total)
            length = min(max(cu[b + 1] - cu[b], 0), total - offset)
            first = offset // tile + b
            mine = set(range(first, first + -(-length // tile)))
            assert all(0 <= t < ws_tiles for t in mine)
            if honest:
                assert not mine & seen
            seen |= mine


def test_the_varlen_workspace_size_needs_no_gpu(built):
    from fa4_aot.launch.manifest import Manifest

    folder, _ = built
    library = _FakeLibrary(Manifest(folder))
    small = backward_varlen_workspace_bytes(100, 3, 8, 128, causal=True, deterministic=True, library=library)
    assert backward_varlen_workspace_bytes(1000, 3, 8, 128, causal=True, deterministic=True, library=library) > small
    with pytest.raises(ShapeError):
        backward_varlen_workspace_bytes(0, 3, 8, 128, library=library)
    with pytest.raises(UnsupportedVariantError):
        backward_varlen_workspace_bytes(100, 3, 8, 128, causal=False, library=library)  # not in the subset


def call_backward_order(library, size=WS_BYTES, **options):
    call_backward(bwd_arrays(workspace=DeviceArray(BASE, (size,), (1,), "u8", 0)), library=library, causal=True,
                  deterministic=True, **options)
    return library.launches[-1][1:]


def test_the_backward_order_flag(built, monkeypatch):
    from fa4_aot import policy
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    need = backward_varlen_workspace_bytes(100, 3, 8, 128, causal=True, deterministic=True, library=library)
    assert call_backward_order(library, order="lpt")[0]["lpt"] == 1
    assert call_backward_order(library, order="plain")[0]["lpt"] == 0
    assert call_backward_order(library, size=need - 256, order="plain")[0]["lpt"] == 0
    # order None: the policy's, where the workspace has room; the longest of the 300 keys 200
    for share, default in ((0.5, 1), (0.9, 0)):
        monkeypatch.setattr(policy, "VARLEN_BWD_LPT_KEY_SHARE", share)
        assert call_backward_order(library)[0]["lpt"] == default
        assert call_backward_order(library, size=need - 1)[0]["lpt"] == 0
    monkeypatch.setattr(policy, "VARLEN_BWD_LPT_KEY_SHARE", 0.5)
    monkeypatch.setattr(policy, "VARLEN_LPT", False)  # the forward's default is not the backward's
    assert call_backward_order(library)[0]["lpt"] == 1
    _sort_width(monkeypatch, library, 2)  # past the sort's width: the plain order
    assert call_backward_order(library)[0]["lpt"] == 0
    with pytest.raises(ShapeError, match="sorts up to 2 sequences"):
        call_backward_order(library, order="lpt")


def test_the_backward_takes_heaviest_first_where_causal_and_one_sequence_holds_half_the_keys():
    from fa4_aot import policy

    most = 8192  # the sort's width
    assert policy.varlen_backward_order(64, True, 16384, 32512, most) == "lpt"  # 1 x 16384 + 63 x 256
    assert policy.varlen_backward_order(64, False, 16384, 32512, most) == "plain"  # even there not causal
    assert policy.varlen_backward_order(16, True, 8000, 65000, most) == "plain"  # 16 x U(1, 8191)
    assert policy.varlen_backward_order(1, True, 100, 100, most) == "plain"  # one sequence: nothing to sort
    assert policy.varlen_backward_order(most + 1, True, 10**6, 10**6, most) == "plain"


@pytest.mark.parametrize("options, error, message", [
    ({"order": "lpt", "size": "plain"}, OptionError, "order='lpt' needs a workspace of backward_varlen_workspace_bytes"),
    ({"order": "heaviest"}, OptionError, "order must be one of"),
])
def test_bad_backward_order_options_raise_before_any_launch(built, options, error, message):
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    if options.get("size") == "plain":
        options["size"] = backward_varlen_workspace_bytes(100, 3, 8, 128, causal=True, deterministic=True,
                                                          library=library) - 1
    with pytest.raises(error, match=message):
        call_backward_order(library, **options)
    assert not library.launches


def test_lpt_backward_past_int32_ctas_is_refused(built, monkeypatch):
    """(ceil(total_k / tile_n) + batch) * heads_kv CTAs past int32: the plain order by
    default, an error when asked for (the sizes are faked: the check reads them only)."""
    from fa4_aot import varlen
    from fa4_aot.launch.manifest import Manifest

    library = _FakeLibrary(Manifest(built[0]))
    real = varlen.check_backward_varlen

    def huge(arrays, max_q, max_k):
        return {**real(arrays, max_q, max_k), "total_k": 2**31 - 1, "heads_kv": 128}

    monkeypatch.setattr(varlen, "check_backward_varlen", huge)
    assert call_backward_order(library)[0]["lpt"] == 0
    with pytest.raises(ShapeError, match=r"walks 2147484032 CTAs .*past int32"):
        call_backward_order(library, order="lpt")
