"""The loader's refusals, each a typed error that names the fix; no GPU needed."""

import ctypes
import json
import shutil

import numpy as np
import pytest

from fa4_aot.launch import loader, tma
from fa4_aot.launch import manifest as fa4_manifest
from fa4_aot.dense import backward_row, forward_row
from fa4_aot.errors import (AbiMismatchError, ChecksumError, Fa4AotError, ManifestError, NoDeviceError,
                            ShapeError, UnsupportedVariantError)
from fa4_aot.launch.loader import KernelLibrary, grid_of, pack_params
from fa4_aot.launch.manifest import Manifest
from fa4_aot.policy import TWO_TILES_MAX_SEQLEN_K
from fa4_aot.variants import Variant, serving_head_dim


@pytest.fixture
def copy(built, tmp_path):
    folder = tmp_path / "kernels"
    shutil.copytree(built[0], folder)
    return folder


def test_missing_manifest_says_how_to_build(tmp_path):
    with pytest.raises(ManifestError, match="build_kernels.py"):
        Manifest(tmp_path)


def test_malformed_and_foreign_schema_manifests_are_refused(copy):
    path = copy / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest(copy)
    path.write_text(json.dumps({**data, "schema": 99}))
    with pytest.raises(ManifestError, match="schema 99"):
        Manifest(copy)
    bwd = next(r for r in data["kernels"] if r["variant"]["kind"] == "bwd")
    for field in ("config", "workspace"):  # the run time reads a backward's knobs and workspace from them
        path.write_text(json.dumps({**data, "kernels": [{k: x for k, x in bwd.items() if k != field}]}))
        with pytest.raises(ManifestError, match=f"lacks \\['{field}'\\]"):
            Manifest(copy)
    del data["kernels"][0]["launches"][0]["symbol"]
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="symbol"):
        Manifest(copy)


def test_the_manifest_decodes_the_rows_asked_for_each_as_the_whole_file_has_it(copy):
    """The build lays the manifest out with an index (fa4_aot.launch.manifest.dumps): a load
    decodes the header and index, a row when it is asked for; every row so decoded, and
    the header, equal the whole file's decoding. Another layout of the same JSON is read
    whole, with the same rows."""
    path = copy / "manifest.json"
    whole = json.loads(path.read_text())
    m = Manifest(copy)
    assert m._kernels_at is not None and not m.rows._decoded  # read lazily: no row decoded yet
    first = whole["kernels"][0]
    assert m.rows[first["name"]] == first and list(m.rows._decoded) == [first["name"]]
    assert m.head == {k: v for k, v in whole.items() if k not in ("kernels", "index")}
    assert list(m.rows) == [r["name"] for r in whole["kernels"]] and len(m.rows) == len(whole["kernels"])
    for row in whole["kernels"]:
        assert m.rows[row["name"]] == row
    assert [v.to_dict() for v in m.variants] == [r["variant"] for r in whole["kernels"]]
    assert m.data == whole
    path.write_text(json.dumps(whole))  # another layout: read whole
    other = Manifest(copy)
    assert other._kernels_at is None and dict(other.rows) == {r["name"]: r for r in whole["kernels"]}
    # a span that no longer holds its row (row 0 one character shorter, row 1 one longer)
    a, b = whole["kernels"][0], whole["kernels"][1]
    text = fa4_manifest.dumps({k: v for k, v in whole.items() if k not in ("kernels", "index")}, whole["kernels"])
    shorter, longer = {**a, "size": a["size"] // 10}, {**b, "size": b["size"] * 10}
    edited = text.replace(json.dumps(a, indent=1), json.dumps(shorter, indent=1), 1)
    path.write_text(edited.replace(json.dumps(b, indent=1), json.dumps(longer, indent=1), 1))
    edited = Manifest(copy)
    assert edited._kernels_at is not None
    with pytest.raises(ManifestError, match="span"):
        edited.rows[b["name"]]


def test_rewrite_keeps_the_head_and_indexes_the_edited_rows(copy):
    path = copy / "manifest.json"
    whole = json.loads(path.read_text())
    kept = fa4_manifest.rewrite(path, lambda rows: rows[:0:-1])  # the first dropped, the rest reversed
    assert [r["name"] for r in kept] == [r["name"] for r in whole["kernels"][:0:-1]]
    m = Manifest(copy)
    assert list(m.rows) == [r["name"] for r in kept] and m.rows[kept[0]["name"]] == kept[0]
    assert {k: v for k, v in m.data.items() if k not in ("kernels", "index")} == \
        {k: v for k, v in whole.items() if k not in ("kernels", "index")}
    assert whole["kernels"][0]["name"] not in m.rows


def test_corrupt_cubin_fails_its_checksum(copy):
    m = Manifest(copy)
    row = next(iter(m.rows.values()))
    path = copy / row["file"]
    blob = bytearray(path.read_bytes())
    blob[100] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(ChecksumError, match="sha256"):
        m.cubin(row)


def test_variant_not_built_lists_the_nearest(built):
    m = Manifest(built[0])
    with pytest.raises(UnsupportedVariantError,
                       match=r"fwd\.sm90a\.bf16\.d96 is not built.*Nearest built variants: fwd\.sm90a\.bf16\.d64, "
                             r"fwd\.sm90a\.bf16\.d128"):
        m.find(kind="fwd", arch="sm90a", dtype="bf16", head_dim=96, causal=False)
    with pytest.raises(UnsupportedVariantError, match="head_dim=80"):
        m.find(kind="fwd", arch="sm90a", dtype="bf16", head_dim=80, causal=False)
    with pytest.raises(UnsupportedVariantError, match="no Blackwell kernel"):
        m.find(kind="fwd", arch="sm100a", dtype="bf16", head_dim=64, causal=False)
    assert m.built(kind="fwd", arch="sm90a", dtype="bf16", head_dim=128, causal=True, q_tiles=2)
    assert not m.built(kind="fwd", arch="sm90a", dtype="bf16", head_dim=128, causal=True)
    assert not m.built(kind="fwd", arch="sm90a", dtype="bf16", head_dim=80, causal=True)  # undeclared


def test_a_head_dim_runs_on_the_narrowest_built_one_at_least_as_wide(built):
    """The subset builds forwards at 64, 96 (fp16 causal), 128, 192 (192/128's own, varlen),
    256 and decode at 128 only."""
    m = Manifest(built[0])
    assert [m.kernel_head_dim("fwd", d) for d in (8, 40, 64, 72, 96, 104, 136, 200, 248, 256)] == \
        [64, 64, 64, 96, 96, 128, 192, 256, 256, 256]
    assert m.kernel_head_dim("decode", 8) == 128
    for d in (0, -8, 4, 36, 100, 264, 512):  # not a positive multiple of 8; past the widest
        with pytest.raises(UnsupportedVariantError, match=f"head_dim {d}"):
            m.kernel_head_dim("fwd", d)
    with pytest.raises(UnsupportedVariantError, match="built: none"):
        m.kernel_head_dim("nothing", 64)


def test_past_256_a_head_dim_runs_only_on_its_own_width():
    """512 (EXACT_HEAD_DIMS) serves 512 alone: 264-504 are refused, not run on it."""
    dims = {64, 96, 128, 192, 256, 512}
    assert [serving_head_dim(dims, d) for d in (8, 248, 256, 264, 384, 504, 512, 520)] == \
        [64, 256, 256, None, None, None, 512, None]
    assert serving_head_dim({64, 128}, 512) is None


def test_forward_takes_two_query_tiles_for_short_keys_where_built(built):
    m = Manifest(built[0])
    d128 = dict(kind="fwd", arch="sm90a", dtype="bf16", head_dim=128, causal=True)
    assert forward_row(m, d128, TWO_TILES_MAX_SEQLEN_K)["name"] == "fwd.sm90a.bf16.d128.causal.q2"
    with pytest.raises(UnsupportedVariantError, match="d128.causal is not built"):  # one tile: not in SUBSET
        forward_row(m, d128, TWO_TILES_MAX_SEQLEN_K + 1)
    d256 = dict(kind="fwd", arch="sm90a", dtype="bf16", head_dim=256, causal=True)
    assert forward_row(m, d256, 1000)["name"] == "fwd.sm90a.bf16.d256.causal"  # no two-tile variant there


def test_backward_takes_two_query_tiles_for_long_keys_where_built(built):
    """head_dim 64 causal (not deterministic) has both kernels: the one-tile persistent one
    up to the keys its row's limits give (its CTAs persistent), the two-tile one above;
    other variants one."""
    from fa4_aot.variants import MATRIX

    assert [v.name for v in MATRIX if v.kind == "bwd" and v.q_tiles == 2] == [
        "bwd.sm90a.bf16.d64.causal.q2", "bwd.sm90a.fp16.d64.causal.q2"]
    m = Manifest(built[0])
    d64 = dict(kind="bwd", arch="sm90a", dtype="bf16", head_dim=64, causal=True, deterministic=False)
    bound = m.rows["bwd.sm90a.bf16.d64.causal"]["limits"]["persistent_max_keys"]
    assert bound == 2048
    assert backward_row(m, d64, bound)["name"] == "bwd.sm90a.bf16.d64.causal"
    assert backward_row(m, d64, bound + 1)["name"] == "bwd.sm90a.bf16.d64.causal.q2"
    assert backward_row(m, d64, 100, q_tiles=2)["name"] == "bwd.sm90a.bf16.d64.causal.q2"
    d128 = dict(kind="bwd", arch="sm90a", dtype="bf16", head_dim=128, causal=True, deterministic=True)
    assert backward_row(m, d128, 1 << 20)["name"] == "bwd.sm90a.bf16.d128.causal.det"  # no two-tile variant
    with pytest.raises(UnsupportedVariantError, match="deterministic, head_dim 64 steps over two query tiles"):
        backward_row(m, {**d64, "deterministic": True}, 100, q_tiles=2)


def test_no_gpu_gives_a_clear_error_not_a_crash(built, monkeypatch):
    def no_driver(*_):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    monkeypatch.setattr(loader.cu, "cuInit", no_driver, raising=False)
    loader.init.cache_clear()
    try:
        with pytest.raises(NoDeviceError, match="no usable CUDA device"):
            KernelLibrary(built[0]).arch(0)
    finally:
        loader.init.cache_clear()
    assert issubclass(NoDeviceError, Fa4AotError)


def test_parameter_buffer_follows_the_plan(built, monkeypatch):
    row = Manifest(built[0]).rows["fwd.sm90a.bf16.d64"]
    (launch,) = row["launches"]
    monkeypatch.setattr(tma, "encode", lambda recipe, ptr, *a: bytes([ord(recipe["tensor"][0])]) * 128)
    sizes = {"batch": 3, "seqlen_q": 1000, "seqlen_k": 777, "heads_q": 8, "heads_kv": 2, "head_dim": 64}
    shapes = {"q": (3, 1000, 8, 64), "k": (3, 777, 2, 64), "v": (3, 777, 2, 64), "out": (3, 1000, 8, 64),
              "lse": (3, 8, 1000)}
    tensors = {n: {"ptr": 0x10000 * (i + 1), "shape": shapes[n], "strides": None, "itemsize": 2}
               for i, n in enumerate(shapes)}
    packed, pointers = pack_params(row, launch, {"scale_log2": 0.5}, tensors)
    assert [p - ctypes.addressof(packed) for p in pointers] == [p["offset"] for p in launch["params"]]
    buffer = np.frombuffer(bytes(packed), dtype=np.uint8)
    by_name = {p["name"]: p for p in launch["params"]}
    at = lambda name: buffer[by_name[name]["offset"]:]  # noqa: E731
    assert bytes(at("tma_k")[:128]) == b"k" * 128
    assert list(at("k_coords")[:12].view(np.int32)) == [777, 2, 3]
    assert list(at("q_coords")[:12].view(np.int32)) == [1000, 8, 3]
    assert at("lse")[:8].view(np.uint64)[0] == 0x50000
    assert at("scale_log2")[:4].view(np.float32)[0] == 0.5
    assert grid_of(launch, sizes) == (-(-1000 // row["tiling"]["tile_m"]), 8, 3)
    with pytest.raises(AbiMismatchError, match="scale_log2"):  # a manifest naming what the call lacks
        pack_params(row, launch, {}, tensors)


def test_backward_packs_strides_and_workspaces(built, monkeypatch):
    row = Manifest(built[0]).rows["bwd.sm90a.bf16.d128.causal.det"]
    pre, main, post = row["launches"]
    values = {"seqlen_q": 100, "heads_q": 4, "first_write": 1, "columns": 128, "columns_v": 128}
    tensors = {n: {"ptr": 0x1000 * (i + 1)} for i, n in enumerate(
        ("lse", "lse2", "dsum", "dq_accum", "dq_semaphore", "dq_done", "tail_counters"))}
    tensors["out"] = {"ptr": 0x10, "strides": (1 << 33, 512, 128, 1)}
    tensors["dout"] = {"ptr": 0x20, "strides": (7, 8, 9, 1)}
    packed, _ = pack_params(row, pre, values, tensors)
    buffer = np.frombuffer(bytes(packed), dtype=np.uint8)
    by_name = {p["name"]: p for p in pre["params"]}
    assert buffer[by_name["out_stride_b"]["offset"]:][:8].view(np.int64)[0] == 1 << 33
    assert buffer[by_name["dout_stride_h"]["offset"]:][:8].view(np.int64)[0] == 9
    assert buffer[by_name["heads_q"]["offset"]:][:4].view(np.int32)[0] == 4
    assert buffer[by_name["first_write"]["offset"]:][:4].view(np.int32)[0] == 1
    assert grid_of(main, {"seqlen_k": 300, "heads_kv": 2, "batch": 5}) == (3, 2, 5)
    assert grid_of(post, {"seqlen_q": 300, "heads_q": 4, "batch": 5}) == (5, 4, 5)  # 64-row blocks


def test_split_tail_backward_grid_adds_the_pieces(built):
    """Not causal, not deterministic: one CTA per key tile, the last ``tail_tiles`` of them
    in ``tail_pieces`` each (policy.tail_split decides both at run time)."""
    main = Manifest(built[0]).rows["bwd.sm90a.fp16.d64"]["launches"][1]
    sizes = {"seqlen_k": 16384, "heads_kv": 16, "batch": 1, "tail_tiles": 0, "tail_pieces": 1}
    assert grid_of(main, sizes) == (2048, 1, 1)
    assert grid_of(main, {**sizes, "tail_tiles": 68, "tail_pieces": 2}) == (2048 + 68, 1, 1)
    assert grid_of(main, {**sizes, "heads_kv": 32, "tail_tiles": 4, "tail_pieces": 33}) == (4096 + 4 * 32, 1, 1)


def test_persistent_backward_grid_is_one_cta_per_multiprocessor(built):
    row = Manifest(built[0]).rows["bwd.sm90a.bf16.d64.causal"]
    main = row["launches"][1]
    many = {"seqlen_k": 1000, "heads_kv": 32, "batch": 16}  # 8 * 32 * 16 key tiles
    assert grid_of(main, many, sm_count=132) == (132, 1, 1)
    assert grid_of(main, {"seqlen_k": 130, "heads_kv": 3, "batch": 1}, sm_count=132) == (6, 1, 1)  # fewer items
    bound = row["limits"]["persistent_max_keys"]
    assert grid_of(main, {**many, "seqlen_k": bound}, sm_count=132) == (132, 1, 1)
    longer = {"seqlen_k": bound + 1, "heads_kv": 32, "batch": 4}  # long: one CTA per key tile
    assert grid_of(main, longer, sm_count=132) == (-(-longer["seqlen_k"] // 128) * 32 * 4, 1, 1)
    with pytest.raises(ManifestError, match="sm_count"):  # the loader always passes the count
        grid_of(main, many)


def _fake_device(monkeypatch, version=13000, cc=(9, 0)):
    monkeypatch.setattr(loader, "init", lambda: version)
    monkeypatch.setattr(loader, "compute_capability", lambda device: cc)
    monkeypatch.setattr(loader, "device_name", lambda device: "Fake GPU")


def test_old_driver_is_refused_with_the_floor(built, monkeypatch):
    from fa4_aot.errors import DriverTooOldError

    _fake_device(monkeypatch, version=12080)
    lib = KernelLibrary(built[0])
    row = next(iter(lib.manifest.rows.values()))
    with pytest.raises(DriverTooOldError, match=r"supports CUDA 12\.8; these cubins need 13\.0"):
        lib.check_device(0, row)


def test_wrong_architecture_is_refused_before_loading(built, monkeypatch):
    from fa4_aot.errors import ArchitectureError

    _fake_device(monkeypatch, cc=(8, 0))
    lib = KernelLibrary(built[0])
    row = lib.manifest.rows["fwd.sm90a.bf16.d64"]
    with pytest.raises(ArchitectureError, match=r"built for sm_90a .*\(Fake GPU\) is 8\.0"):
        lib.check_device(0, row)
    with pytest.raises(ArchitectureError, match="sm_80"):
        lib.arch(0)
    _fake_device(monkeypatch, cc=(9, 0))
    assert lib.arch(0) == "sm90a"


class _RecordingLibrary:
    """A KernelLibrary stand-in that records launches instead of making them (and keeps
    no plans, so every call is checked and packed)."""

    def __init__(self, folder):
        self.manifest = Manifest(folder)
        self.last, self.launched = {}, []

    def arch(self, device):
        return "sm90a"

    def launch_again(self, key, waits=(), aliases=()):
        return False

    def sm_count(self, device):
        return 132

    def launch(self, row, device, stream, values, tensors, key=None, waits=(), aliases=()):
        self.last.update(row=row, values=values, tensors=tensors, stream=stream, waits=waits)
        self.launched.append((row["name"], device))


def test_backward_gives_every_kernel_all_the_values_its_plan_names(built, monkeypatch):
    """fa4_aot.backward up to the driver call: every run-time value and tensor the three
    kernels' parameter plans name is provided (a missing one would only fail on a GPU), and
    the deterministic turn rule reaches the main kernel."""
    import fa4_aot.dense as api
    import fa4_aot.policy as policy

    from fa4_aot.launch.arrays import DeviceArray
    from fa4_aot.launch.checks import ScoreMods

    from .test_inputs import bshd, fresh

    library = _RecordingLibrary(built[0])
    captured = library.last
    monkeypatch.setattr(api, "device_of", lambda arrays: 0)
    b, sq, sk, hq, hkv, d = 2, 1000, 700, 4, 2, 128
    q, out, dout, dq = (bshd(b, sq, hq, d) for _ in range(4))
    k, v, dk, dv = (bshd(b, sk, hkv, d) for _ in range(4))
    lse = DeviceArray(fresh(), (b, hq, sq), (hq * sq, sq, 1), "fp32")
    size = api.backward_workspace_bytes(b, sq, hq, d, causal=True, deterministic=True, library=library)
    workspace = DeviceArray(fresh(), (size,), (1,), "u8")
    api.backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, causal=True, deterministic=True,
                 library=library)
    values, tensors = captured["values"], captured["tensors"]
    assert captured["row"]["name"] == "bwd.sm90a.bf16.d128.causal.det"
    for launch in captured["row"]["launches"]:
        assert not loader.missing_sources(launch, values, tensors), launch["symbol"]
    assert values["turn_tiles"] == policy.deterministic_turn_tiles(True, d, sk) == 2
    # one-tile turns only where two measured slower: causal head_dim 256 below 16k keys
    assert [policy.deterministic_turn_tiles(True, hd, 4096) for hd in (64, 96, 128, 192, 256)] == [2, 2, 2, 2, 1]
    assert policy.deterministic_turn_tiles(True, 256, 16384) == policy.deterministic_turn_tiles(False, 256, 1024) == 2
    assert tensors["dq_accum"]["shape"] == (b, sq, hq, d)  # one accumulator copy when causal
    # the accumulator left uncleared (first shares stored) where measured faster:
    # deterministic, and up to 4k keys otherwise
    assert values["first_write"] == 1
    assert [policy.first_write_dq(False, sk) for sk in (1024, 4096, 4097)] == [True, True, False]
    assert policy.first_write_dq(True, 16384)
    # a window bounded on both sides counts its span (gpt-oss: 129 keys); sinks alone or a
    # window open on one side count the sequence
    assert [ScoreMods(*m).keys_seen(65536) for m in ((128, 0, 0.0, True), (-1, 0, 0.0, True), (4096, -1, 0.0, False),
                                                       (5000, 5000, 0.0, False))] == [129, 65536, 65536, 10001]

    # not causal: the accumulator's copies are the dQ reduce's batch axis. That variant is
    # not built here; its plan is the same, so the causal row stands in for it, with the
    # config and workspace rule the build writes for the real one.
    from .test_workspace import row_of

    real = row_of(Variant("bwd", "sm90a", "bf16", d, False, deterministic=True))
    chains = real["config"]["chains"]
    assert chains == 2 and real["config"]["tile_m"] == 80
    stand_in = {**captured["row"], "config": real["config"], "workspace": real["workspace"]}
    monkeypatch.setattr(Manifest, "find", lambda self, **axes: stand_in)
    size = api.backward_workspace_bytes(b, sq, hq, d, deterministic=True, library=_RulesOnly(real))
    workspace = DeviceArray(fresh(), (size,), (1,), "u8")
    api.backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, deterministic=True, library=library)
    assert captured["tensors"]["dq_accum"]["shape"] == (b * chains, sq, hq, d)
    # the workspace is laid out by the row's query tile: LSE2 rows padded to 80 here
    t = captured["tensors"]
    assert t["dsum"]["ptr"] - t["lse2"]["ptr"] == b * hq * -(-sq // 80) * 80 * 4
    with pytest.raises(ShapeError, match="workspace has"):  # one byte short of the row's rule
        api.backward(q, k, v, out, dout, lse, dq, dk, dv, DeviceArray(fresh(), (size - 1,), (1,), "u8"),
                     deterministic=True, library=library)


class _RulesOnly:
    """A library whose manifest holds one row (backward_workspace_bytes reads only rows, and
    the row's head dim serves the call's)."""

    def __init__(self, row):
        self.manifest = type("M", (), {"data": {"kernels": [row]}, "rows": {row["name"]: row},
                                       "matching": lambda self, **axes: [row],
                                       "kernel_head_dim": lambda self, kind, d: row["variant"]["head_dim"]})()


def test_tensormaps_are_encoded_once_per_tensor(monkeypatch):
    """tma.encode keeps each descriptor (a pure function of recipe, pointer, shape and
    strides): the driver is asked again only for a tensor it has not seen."""
    import ctypes

    calls = []
    storage = ctypes.create_string_buffer(b"\x07" * 128, 128)

    class FakeMap:
        def getPtr(self):
            return ctypes.addressof(storage)

    def fake_call(fn, *args):
        calls.append(args)
        return FakeMap()

    monkeypatch.setattr(tma, "call", fake_call)
    tma._encode.cache_clear()
    recipe = {"dtype": "bf16", "dims": ["d", "s", "h", "b"], "box": [64, 64, 1, 1], "element_strides": [1, 1, 1, 1],
              "interleave": "NONE", "swizzle": "128B", "l2_promotion": "128B", "oob_fill": "NONE", "tensor": "q"}
    shape, strides = (2, 100, 8, 64), (100 * 8 * 64, 8 * 64, 64, 1)
    first = tma.encode(recipe, 0x10000, shape, strides, 2)
    assert first == b"\x07" * 128 and len(calls) == 1
    assert tma.encode(dict(recipe), 0x10000, list(shape), list(strides), 2) == first and len(calls) == 1
    tma.encode(recipe, 0x20000, shape, strides, 2)  # another tensor
    assert len(calls) == 2
    dims, byte_strides = calls[1][3], calls[1][4]
    assert [int(n) for n in dims] == [64, 100, 8, 2] and [int(n) for n in byte_strides] == [8 * 64 * 2, 64 * 2, 100 * 8 * 64 * 2]
    tma._encode.cache_clear()


def test_a_known_device_skips_the_pointer_queries(built, monkeypatch):
    """Arrays whose producer gave their device (the torch adapter, DLPack) are taken at its
    word: the api asks the driver nothing about their memory before the launch. Arrays on
    different devices are refused either way."""
    import fa4_aot.dense as api
    import fa4_aot.launch.checks as checks

    from fa4_aot.errors import CudaError, DeviceError, NoDeviceError
    from fa4_aot.launch.arrays import DeviceArray

    from .test_inputs import BASE, fresh

    library = _RecordingLibrary(built[0])
    launched = library.launched
    size = api.backward_workspace_bytes(2, 1000, 4, 128, causal=True, deterministic=True, library=library)

    def no_queries(fn, *args):
        raise CudaError(fn.__name__, "the driver was asked about a pointer")

    def no_driver():
        raise NoDeviceError("no driver here")

    monkeypatch.setattr(checks, "call", no_queries)
    monkeypatch.setattr(checks, "init", lambda: 13000)
    b, sq, sk, hq, hkv, d = 2, 1000, 700, 4, 2, 128

    def arrays(device):
        def bshd(s, h):
            return DeviceArray(fresh(), (b, s, h, d), (s * h * d, h * d, d, 1), "bf16", device)

        q, out, dout, dq = (bshd(sq, hq) for _ in range(4))
        k, v, dk, dv = (bshd(sk, hkv) for _ in range(4))
        lse = DeviceArray(fresh(), (b, hq, sq), (hq * sq, sq, 1), "fp32", device)
        workspace = DeviceArray(fresh(), (size,), (1,), "u8", device)
        return q, k, v, out, dout, lse, dq, dk, dv, workspace

    api.backward(*arrays(3), causal=True, deterministic=True, library=library)
    assert launched == [("bwd.sm90a.bf16.d128.causal.det", 3)]
    with pytest.raises(DeviceError, match="asked about a pointer"):  # no device given: the driver is asked
        api.backward(*arrays(None), causal=True, deterministic=True, library=library)
    monkeypatch.setattr(checks, "init", no_driver)  # and where there is none: no device, not a bad array
    with pytest.raises(NoDeviceError):
        api.backward(*arrays(None), causal=True, deterministic=True, library=library)
    with pytest.raises(DeviceError, match="different devices"):
        checks.device_of({"q": DeviceArray(BASE, (1,), (1,), "u8", 0), "k": DeviceArray(BASE, (1,), (1,), "u8", 1)})


def test_the_torch_adapter_takes_the_device_from_torch():
    torch = pytest.importorskip("torch")
    from fa4_aot.errors import DeviceError
    from fa4_aot.torch import as_device_array

    with pytest.raises(DeviceError, match="CUDA"):
        as_device_array(torch.empty(2))
    if torch.cuda.is_available():
        assert as_device_array(torch.empty(2, device="cuda")).device == torch.cuda.current_device()


class _FakeContext:
    def __init__(self, device):
        self.handle, self.id = 7, 70

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_a_repeated_call_launches_its_kept_plan_without_checking_or_packing_again(built, monkeypatch):
    """fa4_aot.dense keys each call by its arrays and options; the library keeps the packed
    launches of the last PLANS_KEPT keys and repeats them for the same key."""
    import fa4_aot.dense as api

    from fa4_aot.launch.arrays import DeviceArray

    from .test_inputs import BASE, bshd

    library = KernelLibrary(built[0])
    launches, packs, checks = [], [], []
    monkeypatch.setattr(loader, "_Context", _FakeContext)
    monkeypatch.setattr(library, "arch", lambda device: "sm90a")
    monkeypatch.setattr(library, "sm_count", lambda device: 132)
    monkeypatch.setattr(library, "functions", lambda row, device, context=None: [f"fn{i}" for i in range(len(row["launches"]))])
    ok, current = loader.cu.CUresult.CUDA_SUCCESS, loader.cu.CUcontext(_FakeContext(0).handle)
    monkeypatch.setattr(loader.cu, "cuCtxGetCurrent", lambda: (ok, current))
    monkeypatch.setattr(loader.cu, "cuCtxGetId", lambda ctx: (ok, 70))
    monkeypatch.setattr(loader.cu, "cuLaunchKernelEx", lambda *args: launches.append(args) or (ok,))
    monkeypatch.setattr(tma, "encode", lambda recipe, ptr, *a: bytes(128))
    real_pack, real_check = loader.pack_params, api.check_forward
    monkeypatch.setattr(loader, "pack_params", lambda *a: packs.append(1) or real_pack(*a))
    monkeypatch.setattr(api, "check_forward", lambda *a: checks.append(1) or real_check(*a))
    monkeypatch.setattr(api, "device_of", lambda arrays: 0)
    b, s, h, d = 2, 300, 4, 64
    q, k, v = (bshd(b, s, h, d, ptr=BASE + i * (1 << 24)) for i in range(3))
    lse = DeviceArray(BASE + (3 << 24), (b, h, s), (h * s, s, 1), "fp32")

    def run(out, **options):
        api.forward(q, k, v, out, lse, library=library, **options)
        return len(launches), len(packs), len(checks)

    first = bshd(b, s, h, d, ptr=BASE + (4 << 24))
    assert run(first) == (1, 1, 1)
    assert run(first) == (2, 1, 1)  # kept: launched as packed, nothing checked or packed
    assert launches[1] == launches[0]  # the same config, function and parameter pointers
    same = bshd(b, s, h, d, ptr=BASE + (4 << 24))  # another DeviceArray, equal to `first`
    assert run(same) == (3, 1, 1)  # kept by value too, and now under its id as well
    assert run(same) == (4, 1, 1)
    del launches[2:]
    assert run(bshd(b, s, h, d, ptr=BASE + (5 << 24))) == (3, 2, 2)  # another output array
    assert run(first, softmax_scale=0.1) == (4, 3, 3)  # another option
    assert run(first, stream=5) == (5, 4, 4)
    with pytest.raises(Fa4AotError):  # a bad call is never kept: checked every time
        api.forward(q, k, v, bshd(b, s, h, d, ptr=BASE + 2), lse, library=library)
    with pytest.raises(Fa4AotError):
        api.forward(q, k, v, bshd(b, s, h, d, ptr=BASE + 2), lse, library=library)
    assert len(launches) == 5

    # The raw API's fast key names its arrays by id; the kept plan pins them, so an array
    # made after one is dropped never takes a kept id and another's plan (CPython hands a
    # freed object's memory, so its id, to the next object of its size).
    packed = len(packs)
    for i in range(40):
        run(bshd(b, s, h, d, ptr=BASE + ((8 + i) << 24)))
    assert len(packs) == packed + 40

    monkeypatch.setattr(loader, "PLANS_KEPT", 2)
    run(bshd(b, s, h, d, ptr=BASE + (6 << 24)))  # the least recently used keys are dropped
    assert len(library._plans) == 2
    packed = len(packs)
    assert run(first)[1] == packed + 1  # its plan was dropped: checked and packed again
    assert run(first)[1] == packed + 1


def test_launch_attributes_follow_the_manifest():
    from fa4_aot.launch.driver import cu
    from fa4_aot.launch.loader import launch_attributes

    assert launch_attributes({"cluster": [1, 1, 1], "programmatic": False}) == []
    (attr,) = launch_attributes({"cluster": [1, 1, 1], "programmatic": True})
    assert attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    cluster, _ = launch_attributes({"cluster": [2, 1, 1], "programmatic": True})
    assert cluster.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert cluster.value.clusterDim.x == 2


def test_a_call_of_two_rows_is_packed_whole_and_repeats_as_one(monkeypatch):
    """launch(..., then=...): a call of two rows (decode and its combine) is packed whole
    before anything is issued, kept as one plan under its key and its aliases, and
    launch_again repeats both, in order. A row that fails to pack launches nothing."""
    import contextlib

    launched = []

    class Ctx:
        handle, id = 7, 70

    monkeypatch.setattr(loader, "_Context", lambda device: contextlib.nullcontext(Ctx()))
    monkeypatch.setattr(loader, "pack_params", lambda row, launch, values, tensors: (b"", (ctypes.c_uint64 * 1)()))
    monkeypatch.setattr(loader, "grid_of", lambda launch, values, sm_count=None: (1, 1, 1))
    monkeypatch.setattr(loader, "call", lambda fn, *args: launched.append(args[1]) if args else None)
    monkeypatch.setattr(loader.cu, "cuCtxGetCurrent", lambda: (loader.SUCCESS, 7))
    monkeypatch.setattr(loader.cu, "cuCtxGetId", lambda ctx: (loader.SUCCESS, 70))
    monkeypatch.setattr(loader.cu, "cuLaunchKernelEx", lambda config, fn, address, extra:
                        (launched.append(fn), (loader.SUCCESS,))[1])
    launch = {"block": [1, 1, 1], "smem_bytes": 0, "cluster": [1, 1, 1], "programmatic": False}
    lib = KernelLibrary("/nonexistent")
    monkeypatch.setattr(lib, "functions", lambda row, device, context=None: [row["name"]])
    monkeypatch.setattr(lib, "sm_count", lambda device: 132)
    pinned = (object(),)
    decode, combine = {"name": "decode", "launches": [launch]}, {"name": "combine", "launches": [launch]}
    lib.launch(decode, 0, 5, {}, {}, key="by value", aliases=(("by id", pinned),), then=((combine, {}, {}),))
    assert launched == ["decode", "combine"]
    for key in ("by id", "by value"):
        launched.clear()
        assert lib.launch_again(key)
        assert launched == ["decode", "combine"]
    lib.launch(decode, 0, 5, {}, {}, key="alone")  # one row: its own plan only
    launched.clear()
    assert lib.launch_again("alone") and launched == ["decode"]

    def refuse(row, launch, values, tensors):
        if row["name"] == "combine":
            raise OverflowError("a value past its slot")
        return b"", (ctypes.c_uint64 * 1)()

    monkeypatch.setattr(loader, "pack_params", refuse)
    launched.clear()
    with pytest.raises(OverflowError):
        lib.launch(decode, 0, 5, {}, {}, key="refused", then=((combine, {}, {}),))
    assert launched == [] and not lib.launch_again("refused")


def test_a_context_made_anew_at_a_handle_reloads_and_never_replays(monkeypatch):
    """A context destroyed (or a primary context reset) takes its modules with it, and a
    new one may get the same handle: the library keys modules and kept launches by the
    context's unique id, so the new context loads its own and no kept plan of the old one
    is replayed into it."""
    import contextlib

    ids, loads, launched = [70], [], []

    class Ctx:
        handle = 7

        @property
        def id(self):
            return ids[0]

    monkeypatch.setattr(loader, "_Context", lambda device: contextlib.nullcontext(Ctx()))
    monkeypatch.setattr(loader, "pack_params", lambda row, launch, values, tensors: (b"", (ctypes.c_uint64 * 1)()))
    monkeypatch.setattr(loader, "grid_of", lambda launch, values, sm_count=None: (1, 1, 1))
    monkeypatch.setattr(loader, "call", lambda fn, *args: launched.append(args[1]) if args else None)
    monkeypatch.setattr(loader.cu, "cuCtxGetCurrent", lambda: (loader.SUCCESS, 7))
    monkeypatch.setattr(loader.cu, "cuCtxGetId", lambda ctx: (loader.SUCCESS, ids[0]))
    monkeypatch.setattr(loader.cu, "cuLaunchKernelEx", lambda config, fn, address, extra:
                        (launched.append(fn), (loader.SUCCESS,))[1])
    lib = KernelLibrary("/nonexistent")
    monkeypatch.setattr(lib, "check_device", lambda device, row: None)
    monkeypatch.setattr(lib, "_load", lambda row: loads.append(ids[0]) or [f"{row['name']}@{ids[0]}"])
    monkeypatch.setattr(lib, "sm_count", lambda device: 132)
    launch = {"block": [1, 1, 1], "smem_bytes": 0, "cluster": [1, 1, 1], "programmatic": False}
    row = {"name": "fwd", "launches": [launch]}
    lib.launch(row, 0, 5, {}, {}, key="call")
    assert loads == [70] and launched == ["fwd@70"] and lib.launch_again("call")
    ids[0] = 71  # the context destroyed, another made at the same handle
    launched.clear()
    assert not lib.launch_again("call") and launched == []
    lib.launch(row, 0, 5, {}, {}, key="call")
    assert loads == [70, 71] and launched == ["fwd@71"]


def test_a_repeat_with_no_context_current_replays_in_the_plans_context(monkeypatch):
    """The repeat path asks the driver for the current context's id with a NULL context,
    an error where none is current: the kept plan is then replayed inside its own
    context (pushed and popped), never dropped or launched without one."""
    import contextlib

    entered, launched, current = [], [], [None]

    class Ctx:
        handle, id = 7, 70

    @contextlib.contextmanager
    def plan_context(device):
        entered.append(device)
        current[0] = 70
        yield Ctx()
        current[0] = None

    def ctx_id(ctx):
        assert ctx is None, "the repeat path asks for the current context's id"
        return (loader.SUCCESS, current[0]) if current[0] else (loader.cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)

    monkeypatch.setattr(loader, "_Context", plan_context)
    monkeypatch.setattr(loader, "pack_params", lambda row, launch, values, tensors: (b"", (ctypes.c_uint64 * 1)()))
    monkeypatch.setattr(loader, "grid_of", lambda launch, values, sm_count=None: (1, 1, 1))
    monkeypatch.setattr(loader, "call", lambda fn, *args: launched.append(args[1]) if args else None)
    monkeypatch.setattr(loader.cu, "cuCtxGetId", ctx_id)
    monkeypatch.setattr(loader.cu, "cuLaunchKernelEx", lambda config, fn, address, extra:
                        (launched.append((fn, current[0])), (loader.SUCCESS,))[1])
    lib = KernelLibrary("/nonexistent")
    monkeypatch.setattr(lib, "check_device", lambda device, row: None)
    monkeypatch.setattr(lib, "_load", lambda row: ["fwd@70"])
    monkeypatch.setattr(lib, "sm_count", lambda device: 132)
    launch = {"block": [1, 1, 1], "smem_bytes": 0, "cluster": [1, 1, 1], "programmatic": False}
    lib.launch({"name": "fwd", "launches": [launch]}, 0, 5, {}, {}, key="call")
    entered.clear(), launched.clear()
    assert lib.launch_again("call")
    assert entered == [0] and launched == [("fwd@70", 70)]
    entered.clear(), launched.clear()
    current[0] = 70  # the plan's context current: replayed as it is
    assert lib.launch_again("call") and entered == [] and launched == [("fwd@70", 70)]


def test_issue_launches_only_into_the_context_it_was_prepared_in(monkeypatch):
    """``issue`` after ``prepare``: in the prepared context (current) it launches with one
    driver question; where none is current it enters the device's context, and if that
    is another context now (reset since), it refuses and launches nothing."""
    import contextlib

    entered, launched, current, device_ctx = [], [], [70], [70]

    class Ctx:
        handle = 7

        @property
        def id(self):
            return device_ctx[0]

    @contextlib.contextmanager
    def device_context(device):
        entered.append(device)
        yield Ctx()

    monkeypatch.setattr(loader, "_Context", device_context)
    monkeypatch.setattr(loader, "pack_params", lambda row, launch, values, tensors: (b"", (ctypes.c_uint64 * 1)()))
    monkeypatch.setattr(loader, "grid_of", lambda launch, values, sm_count=None: (1, 1, 1))
    monkeypatch.setattr(loader, "call", lambda fn, *args: launched.append(args[1]) if args else None)
    monkeypatch.setattr(loader.cu, "cuCtxGetId", lambda ctx: (loader.SUCCESS, current[0]) if current[0]
                        else (loader.cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0))
    lib = KernelLibrary("/nonexistent")
    monkeypatch.setattr(lib, "check_device", lambda device, row: None)
    monkeypatch.setattr(lib, "_load", lambda row: ["fwd@70"])
    monkeypatch.setattr(lib, "sm_count", lambda device: 132)
    launch = {"block": [1, 1, 1], "smem_bytes": 0, "cluster": [1, 1, 1], "programmatic": False}
    prepared = lib.prepare({"name": "fwd", "launches": [launch]}, 0, 5, {}, {})
    entered.clear()
    lib.issue(prepared)
    assert entered == [] and launched == ["fwd@70"]
    launched.clear()
    current[0], device_ctx[0] = None, 71  # no context current; the device's was reset
    with pytest.raises(loader.CudaError, match="context changed"):
        lib.issue(prepared)
    assert entered == [0] and launched == []


def test_local_forward_gives_its_kernel_the_window_sinks_and_cap(built, monkeypatch):
    """fa4_aot.forward with a window, sinks or a cap, up to the driver call: the local row,
    every value its plan names, packed as the kernel reads them (causal makes the window's
    right 0; the cap's scales; no sink: use_sink 0 and lse's address, never read); a window
    of (-1, 0) alone takes the plain causal row."""
    import math

    import fa4_aot.dense as api
    import fa4_aot.policy as policy

    from fa4_aot.launch.arrays import DeviceArray
    from fa4_aot.launch.checks import ScoreMods

    from .test_inputs import bshd, fresh

    library = _RecordingLibrary(built[0])
    captured = library.last
    monkeypatch.setattr(api, "device_of", lambda arrays: 0)
    b, sq, sk, hq, hkv, d = 2, 100, 300, 4, 2, 64
    q, out = bshd(b, sq, hq, d), bshd(b, sq, hq, d)
    k, v = bshd(b, sk, hkv, d), bshd(b, sk, hkv, d)
    lse = DeviceArray(fresh(), (b, hq, sq), (hq * sq, sq, 1), "fp32")
    sink = DeviceArray(fresh(), (hq,), (1,), "fp32")
    api.forward(q, k, v, out, lse, causal=True, window_size=(128, 5), softcap=30.0, learnable_sink=sink,
                library=library)
    values, tensors, row = captured["values"], captured["tensors"], captured["row"]
    assert row["name"] == "fwd.sm90a.bf16.d64.local.softcap"
    (launch,) = row["launches"]
    assert not loader.missing_sources(launch, values, tensors)
    slots = {s["name"]: s for s in launch["params"]}
    assert {"window_left", "window_right", "sink", "use_sink", "softcap_scale"} <= set(slots)
    scale = 1 / math.sqrt(d)
    assert (values["window_left"], values["window_right"], values["use_sink"]) == (128, 0, 1)
    assert math.isclose(values["scale_log2"], 30.0 * math.log2(math.e))
    assert math.isclose(values["softcap_scale"], scale / 30.0)
    assert tensors["sink"]["ptr"] == sink.ptr
    monkeypatch.setattr(loader.tma, "encode", lambda *a, **kw: bytes(128))  # tensor maps need a driver
    buffer, _ = pack_params(row, launch, values, tensors)
    raw = bytes(buffer)
    at = {n: slots[n]["offset"] for n in ("window_left", "window_right", "use_sink", "sink")}
    assert int.from_bytes(raw[at["window_left"]:at["window_left"] + 4], "little", signed=True) == 128
    assert int.from_bytes(raw[at["window_right"]:at["window_right"] + 4], "little", signed=True) == 0
    assert int.from_bytes(raw[at["sink"]:at["sink"] + 8], "little") == sink.ptr
    with pytest.raises(Fa4AotError):  # the local row is built only here with softcap: a typed refusal
        api.forward(q, k, v, out, lse, window_size=(128, 0), library=library)
    with pytest.raises(UnsupportedVariantError, match=r"q2\.local\.softcap"):  # not in this build
        api.forward(q, k, v, out, lse, softcap=30.0, q_tiles=2, library=library)
    # two query tiles per CTA where a tile's keys (local: at most its window's) are few
    assert [policy.forward_two_tiles(ScoreMods(*w, 0.0, False).keys_seen(131072))
            for w in ((128, 0), (1024, 0), (4096, 0), (-1, 0), (5, -1))] == [True, True, False, False, False]
    assert policy.forward_two_tiles(4096)
    assert policy.forward_two_tiles(ScoreMods(5000, 5000, 0.0, False).keys_seen(1000))
    with pytest.raises(UnsupportedVariantError, match=r"fwd\.sm90a\.bf16\.d64\.causal is not built"):
        api.forward(q, k, v, out, lse, window_size=(-1, 0), library=library)  # the plain causal kernel's
    api.forward(q, k, v, out, lse, window_size=(None, None), library=library)
    assert captured["row"]["name"] == "fwd.sm90a.bf16.d64"
    api.forward(q, k, v, out, lse, softcap=30.0, library=library)
    assert captured["row"]["name"] == "fwd.sm90a.bf16.d64.local.softcap"
    assert (captured["values"]["use_sink"], captured["values"]["window_left"]) == (0, -1)
    assert captured["tensors"]["sink"]["ptr"] == lse.ptr
