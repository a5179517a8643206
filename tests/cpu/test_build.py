"""Building a subset of the matrix on a machine with no GPU, and what the manifest says."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fa4_aot import policy
from fa4_aot.src.common.params import check_against_ptx
from fa4_aot.src.cubin_info import kernel_info
from fa4_aot.launch.loader import grid_of
from fa4_aot.launch.manifest import Manifest
from fa4_aot.variants import Variant

from ..conftest import ROOT, SUBSET, build_subset

# sm_90: a block may opt in to 227 KB of dynamic shared memory; an SM has 228 KB, and
# every DSL kernel also carries a 1 KB static section (.nv.shared.<kernel>), which the
# H200 launches beside a full 227 KB (the d128 backward, GPU-tested).
H100_DYNAMIC_SMEM_LIMIT = 227 * 1024
H100_SM_SMEM = 228 * 1024


def rows(folder):
    return json.loads((folder / "manifest.json").read_text())["kernels"]


def row_of(folder, name) -> dict:
    return next(r for r in rows(folder) if r["name"] == name)


def test_build_writes_one_row_per_requested_variant(built):
    folder, proc = built
    assert [r["name"] for r in rows(folder)] == sorted(SUBSET, key=Variant.from_name)
    assert f"{len(SUBSET)} variants ({len(SUBSET)} compiled" in proc.stdout


def test_checksums_and_sizes_match_the_files(built):
    folder, _ = built
    for r in rows(folder):
        data = (folder / r["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == r["sha256"]
        assert len(data) == r["size"]
        assert data[:4] == b"\x7fELF"


def test_manifest_records_toolchain_and_driver_floor(built):
    m = json.loads((built[0] / "manifest.json").read_text())
    assert m["toolchain"]["dsl"].startswith("nvidia-cutlass-dsl 4.8.1")
    assert m["toolchain"]["ptxas"].startswith("13.")
    assert m["driver_floor"]["cuda_version"] >= 13000
    assert set(m["axes"]) == {"kind", "arch", "dtype", "head_dim", "causal", "varlen", "cta_mode", "deterministic",
                              "q_tiles", "local", "softcap", "kv_dtype", "head_dim_v", "span"}


@pytest.mark.parametrize("name", SUBSET)
def test_parameter_plan_matches_ptx_and_cubin(built, name):
    folder, _ = built
    row = row_of(folder, name)
    ptx = (ROOT / "build" / "ptx" / f"{name}.ptx").read_text()
    for launch in row["launches"]:
        check_against_ptx(launch["params"], ptx, launch["symbol"])
        info = kernel_info((folder / row["file"]).read_bytes(), launch["symbol"])
        base = info.params[0][1]
        assert [(o - base, s) for _, o, s in info.params] == [(p["offset"], p["size"]) for p in launch["params"]]
        assert info.registers == launch["registers"] and info.frame_bytes == launch["local_bytes"]


@pytest.mark.parametrize("name", [n for n in SUBSET if n.split(".")[0] in ("fwd", "bwd")])
def test_launch_contract_is_complete(built, name):
    folder, _ = built
    row = row_of(folder, name)
    v = Variant.from_dict(row["variant"])
    assert v.name == name and row["arch"] == "sm_90a" and row["compute_capability"] == [9, 0]
    # the widest launch but one a run-time value may leave out (the varlen sorts)
    main = max((launch for launch in row["launches"] if "when" not in launch), key=lambda launch: launch["block"][0])
    consumers = row["tiling"]["tile_m"] // 64 if v.kind == "fwd" else row["config"]["num_consumers"]
    assert main["block"] == [128 * (1 + consumers), 1, 1] and main["cluster"] == [1, 1, 1]
    assert main["smem_bytes"] <= H100_DYNAMIC_SMEM_LIMIT
    assert main["smem_bytes"] + main["static_smem_bytes"] <= H100_SM_SMEM
    tensors = {p["tensor"] for launch in row["launches"] for p in launch["params"] if p["kind"] == "tensormap"}
    expected = {"q", "k", "v", "out"} if v.kind == "fwd" else {"q", "dout", "k", "v", "dk", "dv", "dq_accum"}
    if v.kind == "bwd" and row["config"]["dq_fragment_order"]:
        expected.discard("dq_accum")  # 1D bulk reduces at the address, no tensor map
    if v.varlen:
        # written row by row: a tile's last rows belong to the next sequence
        expected -= {"out", "dk", "dv"}
    assert tensors == set(row["tensormaps"]) == expected
    for recipe in row["tensormaps"].values():
        assert recipe["dims"] == ["d", "s", "h", "b"]
        assert recipe["box"][0] * {"fp32": 4}.get(recipe["dtype"], 2) <= 128 and recipe["box"][2:] == [1, 1]
        assert recipe["swizzle"] in ("64B", "128B")
    assert row["tensormaps"]["q"]["box"][1] == row["tiling"]["tile_m"]
    assert row["tensormaps"]["k"]["box"][1] == row["tiling"]["tile_n"]
    # Only launches that wait on griddepcontrol may overlap the one before them: the
    # backward's main kernel and postprocess, never a call's first launch (varlen: the
    # heaviest-first sort, where lpt, then the forward's kernel or the backward's three;
    # local, the backward's sinks' gradient last, where use_sink, after all of them).
    programmatic = [launch["programmatic"] for launch in row["launches"]]
    sort = [False] if v.varlen else []
    sinks = [False] if v.kind == "bwd" and v.local else []
    assert not any(programmatic) if v.kind == "fwd" else programmatic == sort + [False, True, True] + sinks
    if sinks:
        assert row["launches"][-1]["when"] == "use_sink" and "sink_grad" in row["launches"][-1]["symbol"]
    if v.varlen:
        assert [launch.get("when") for launch in row["launches"]][:len(programmatic) - len(sinks)] == \
            ["lpt"] + [None] * (len(programmatic) - len(sinks) - 1)
        assert "order_varlen" in row["launches"][0]["symbol"]
    ptx = (ROOT / "build" / "ptx" / f"{name}.ptx").read_text()
    assert ("griddepcontrol.wait" in ptx) == (v.kind == "bwd")


def test_decode_and_combine_contracts(built):
    """Decode: two warpgroups, K/V tensor maps whose key box is the key tile, its grid
    from decode_ctas, its config and workspace rule; combine: no tensor map, one warp a row."""
    folder, _ = built
    decode, combine = row_of(folder, "decode.sm90a.bf16.d128"), row_of(folder, "combine.sm90a.bf16.d128")
    (main,), (merge,) = decode["launches"], combine["launches"]
    assert main["block"] == [256, 1, 1]
    assert grid_of(main, {"heads_q": 32, "heads_kv": 8, "seqlen_q": 17, "splits": 3, "batch": 5}) == (6, 8, 5)
    assert main["smem_bytes"] <= H100_DYNAMIC_SMEM_LIMIT and main["local_bytes"] == 0
    assert set(decode["tensormaps"]) == {"k_cache", "v_cache"}
    assert all(r["box"][1] == "piece_rows" for r in decode["tensormaps"].values())  # the call's (row "values")
    assert decode["values"]["piece_rows"][3] == decode["config"]["tile_n"]  # not paged: the key tile
    assert [r["name"] for r in decode["workspace"]["regions"]] == ["o_partial", "lse_partial"]
    assert combine["tensormaps"] == {} and merge["block"] == [combine["config"]["threads"], 1, 1]
    assert grid_of(merge, {"batch": 3, "seqlen_q": 2, "heads_q": 5}) == (-(-30 // combine["config"]["rows"]), 1, 1)
    # the combine starts while the decode kernel runs (its CTAs trigger it), so it waits
    # before it reads the partials
    assert merge["programmatic"] and not main["programmatic"]
    ptx = {name: (ROOT / "build" / "ptx" / f"{name}.ptx").read_text() for name in (decode["name"], combine["name"])}
    assert "griddepcontrol.launch_dependents" in ptx[decode["name"]]
    assert "griddepcontrol.wait" in ptx[combine["name"]]
    # the runtime's pairing rule counts the kernel's packed rows without importing its sources
    assert decode["config"]["pairs"] and decode["config"]["tile_m"] == policy.DECODE_PAIR_TILE_ROWS


def test_rebuild_is_incremental(built):
    folder, _ = built
    proc = subprocess.run(build_subset(folder), capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f"(0 compiled, {len(SUBSET)} unchanged)" in proc.stdout


def test_base_completes_a_partial_build_into_a_whole_library(built, tmp_path):
    """--base: an A/B build of one variant next to another folder's others (its row here
    is reused, so nothing compiles); the result lists every variant, each file verified."""
    folder, _ = built
    name = SUBSET[0]
    (tmp_path / "cubins").mkdir()
    shutil.copyfile(folder / "manifest.json", tmp_path / "manifest.json")
    shutil.copyfile(folder / row_of(folder, name)["file"], tmp_path / row_of(folder, name)["file"])
    args = [sys.executable, str(ROOT / "build_kernels.py"), "--out", str(tmp_path), "--only", name,
            "--base", str(folder)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"1 variants (0 compiled, 1 unchanged) and {len(SUBSET) - 1} from" in proc.stdout
    assert rows(tmp_path) == rows(folder)
    for r in rows(tmp_path):
        assert hashlib.sha256((tmp_path / r["file"]).read_bytes()).hexdigest() == r["sha256"]
    same = subprocess.run(args[:-1] + [str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert same.returncode != 0 and "--base must be another folder" in same.stderr


def test_builds_are_the_same_whatever_the_hash_seed(built, tmp_path):
    """The same sources give the same cubins and rows under another PYTHONHASHSEED (the
    fixture built under its own, random unless the environment fixes it): a compile that
    followed Python's hash order (a set's iteration, or a ``@cute.jit`` helper taking lists of
    fragments, seen once to make two fp16 d96 FP8 decode cubins under one build key) would
    ship cubins that a rebuild does not reproduce."""
    folder, _ = built
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    proc = subprocess.run(build_subset(tmp_path, "--jobs", "2"), capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONHASHSEED": seed})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["name"] for r in rows(tmp_path)] == [r["name"] for r in rows(folder)]
    differ = [r["name"] for r, o in zip(rows(tmp_path), rows(folder)) if r != o]
    assert not differ, f"under PYTHONHASHSEED={seed} these built differently: {differ}"


def test_sm100a_is_declared_but_says_plainly_that_nothing_is_built(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "build_kernels.py"), "--out", str(tmp_path), "--arch", "sm100a"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "nothing is built for sm100a" in proc.stdout
    assert "wgmma" in proc.stdout


def test_manifest_loads_and_finds_rows(built):
    m = Manifest(built[0])
    row = m.find(kind="fwd", arch="sm90a", dtype="bf16", head_dim=64, causal=False)
    assert m.cubin(row)[:4] == b"\x7fELF"


def test_v_of_its_own_head_dim_takes_its_kernel(built):
    """A v of 128 columns or fewer beside q's 192 takes the d192v128 forward where it is
    built (its V and O boxes 128 wide), anything else the d192 kernels (docs/design.md,
    "Head dims")."""
    m = Manifest(built[0])
    axes = dict(kind="fwd", dtype="bf16", head_dim=192, causal=True, varlen=True, local=False, softcap=False)
    for columns_v in (128, 72, 8):
        assert m.own_head_dim_v(axes, columns_v) == {**axes, "head_dim_v": 128}
    assert m.own_head_dim_v(axes, 136) == axes
    assert m.own_head_dim_v({**axes, "varlen": False}, 128) == {**axes, "varlen": False}  # not in this build
    row = m.find(**m.own_head_dim_v(axes, 128), arch="sm90a", q_tiles=1)
    assert row["name"] == "fwd.sm90a.bf16.d192v128.causal.varlen" and row["config"]["head_dim_v"] == 128
    assert row["tensormaps"]["v"]["box"][:2] == [64, 128] and row["tensormaps"]["q"]["box"][:2] == [64, 128]
    bwd = dict(kind="bwd", dtype="bf16", head_dim=192, causal=True, deterministic=False, varlen=False)
    row = m.find(**m.own_head_dim_v(bwd, 128), arch="sm90a", q_tiles=1)
    assert row["name"] == "bwd.sm90a.bf16.d192v128.causal" and row["config"]["head_dim_v"] == 128
    assert [row["tensormaps"][t]["box"][0] for t in ("q", "k", "v", "dout")] == [64, 64, 64, 64]
    assert m.own_head_dim_v({**bwd, "deterministic": True}, 128) == {**bwd, "deterministic": True}  # not built here


def _nvdisasm():
    import shutil
    from pathlib import Path

    try:
        import nvidia.cu13

        found = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "nvdisasm"
        if found.exists():
            return str(found)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def _sass(built, name) -> str:
    """The disassembly of variant ``name``'s cubin (skips the test without nvdisasm)."""
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    folder, _ = built
    row = row_of(folder, name)
    return subprocess.run([tool, "-c", str(folder / row["file"])], capture_output=True, text=True, check=True).stdout


ATTENTION = [n for n in SUBSET if not n.startswith("combine.")]  # the combine: plain loads and FMAs


@pytest.mark.parametrize("name", ATTENTION)
def test_sass_uses_hopper_tensor_cores_and_setmaxnreg(built, name):
    sass = _sass(built, name)
    assert "HGMMA" in sass, "the matrix products must run on wgmma"
    assert "USETMAXREG" in sass, "producer and consumers must trade registers"
    assert "UTMALDG" in sass, "loads must go through the tensor memory accelerator"


FORWARD = [n for n in SUBSET if n.startswith("fwd.")]


@pytest.mark.parametrize("name", FORWARD)
def test_forward_has_no_spills(built, name):
    folder, _ = built
    row = row_of(folder, name)
    assert all(launch["local_bytes"] == 0 for launch in row["launches"]), "the forward must not spill"


@pytest.mark.parametrize("name", FORWARD)
def test_forward_softmax_runs_while_p_v_is_in_flight(built, name):
    """Every main-loop softmax sits between the wait for S (one wgmma group left: P V) and
    the wait for P V: ptxas once hoisted the second wait above all of it (perf notes,
    session 4), which the build would not otherwise notice."""
    overlapped, inside = [], None
    for line in _sass(built, name).splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            inside = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and inside is not None:
            overlapped.append(inside)
            inside = None
        elif "MUFU.EX2" in line and inside is not None:
            inside += 1
    assert overlapped and min(overlapped) >= 32, f"exponentials between the waits, per loop: {overlapped}"


@pytest.mark.parametrize("name", SUBSET)
def test_each_wgmma_chain_is_one_group(built, name):
    """A GEMM's k-block wgmmas form one commit group: only the last carries gsb0. ptxas
    closes the group after every k-block (fencing each with a WARPGROUP.ARRIVE, which
    serializes them) when the A registers of an RS-wgmma need moves, as bf16 P did at
    80- and 112-column tiles (perf notes, session 5)."""
    closed = set()  # accumulators whose last wgmma carried gsb0, with no wait since
    split = []
    for line in _sass(built, name).splitlines():
        if "WARPGROUP.DEPBAR" in line:
            closed.clear()
            continue
        m = re.search(r"HGMMA\.\S+ (R\d+), (.*?) ;", line)
        if not m:
            continue
        dest, operands = m.group(1), m.group(2)
        if f", {dest}" in operands and dest in closed:  # accumulates onto a closed group
            split.append(line.strip())
        if "gsb0" in operands:
            closed.add(dest)
        else:
            closed.discard(dest)
    assert not split, f"{len(split)} wgmmas continue a chain after a gsb0 with no wait: {split[:3]}"


@pytest.mark.parametrize("name", ATTENTION)
def test_no_wgmma_is_serialized(built, name):
    """Every GEMM's k-blocks share one commit group (every GEMM here has at least four),
    so a kernel has well under one WARPGROUP.ARRIVE per HGMMA. ptxas serializes all of a
    kernel's wgmmas, an arrive and a wait around each, when their registers do not fit
    (C7512) or one stays in flight across a loop's back edge (C7514): the d64 fp16
    backward once did, silently, where bf16 did not (perf notes, session 9)."""
    sass = _sass(built, name)
    hgmma, arrive = sass.count("HGMMA."), sass.count("WARPGROUP.ARRIVE")
    assert hgmma and 2 * arrive <= hgmma, f"{arrive} arrives for {hgmma} HGMMA: serialized wgmmas"


def test_a_variant_that_fails_to_compile_fails_the_build_with_its_traceback(tmp_path):
    """A worker's exception that cannot be unpickled (the DSL's errors are such) used to
    leave the process pool waiting forever; the build must stop with the traceback."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is needed to compile")
    script = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
import build_kernels
import fa4_aot.src.compile as compile_module

class DSLLikeError(Exception):
    def __init__(self, code, detail):  # two arguments: unpickling it fails
        super().__init__(f"{{code}}: {{detail}}")

def broken(variant):
    raise DSLLikeError("E42", "staged value used as a Python bool")

compile_module.compile_variant = broken
build_kernels.main(["--out", {str(tmp_path)!r}, "--only", {SUBSET[0]!r}, "--jobs", "1"])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    assert "BuildError" in proc.stderr and "DSLLikeError" in proc.stderr and "E42" in proc.stderr
    assert not (tmp_path / "manifest.json").exists()


_IMPORT_TRACE = r"""
import builtins, importlib.util, json, sys
edges = set()
real_import = builtins.__import__

def traced(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    target = importlib.util.resolve_name("." * level + name, (globals or {}).get("__package__") or importer) \
        if level else name
    edges.add((importer, target))
    for item in fromlist or ():
        edges.add((importer, f"{target}.{item}"))
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = traced
from fa4_aot.src.compile import compile_variant
from fa4_aot.variants import Variant
for name in sys.argv[1:]:
    compile_variant(Variant.from_name(name))
files = {m: getattr(sys.modules[m], "__file__", None) for m in list(sys.modules) if m.startswith("fa4_aot")}
print(json.dumps({"edges": sorted(edges), "files": files}))
"""


def _compiler_imports() -> set:
    """The fa4_aot modules the compiler reaches through import statements as they ran while
    it compiled a varlen forward and a decode (traced in a fresh process)."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is needed to compile kernels")
    proc = subprocess.run([sys.executable, "-c", _IMPORT_TRACE, "fwd.sm90a.bf16.d64.varlen", "combine.sm90a.bf16.d64"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(proc.stdout.splitlines()[-1])
    graph = {}
    for importer, target in trace["edges"]:
        graph.setdefault(importer, set()).add(target)
    reached, todo = set(), ["fa4_aot.src.compile"]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo += [t for t in graph.get(module, ()) if t.startswith("fa4_aot")]
    return {Path(trace["files"][m]).resolve() for m in reached if trace["files"].get(m)}


def test_the_build_key_covers_every_module_the_compiler_imports(monkeypatch):
    """Each fa4_aot module the compiler imports (traced while it compiles) is hashed into
    the build key, and a change to any of them changes every variant's key: no cubin
    outlives a change to what made it. (A key of src/ and variants.py alone left out
    cubin_info.py and policy.py, which the compiler imports.)"""
    import build_kernels

    sources = build_kernels.kernel_sources()
    imported = _compiler_imports()
    assert imported - set(sources) == set()
    assert {p.name for p in imported} >= {"compile.py", "interfaces.py", "variants.py", "cubin_info.py"}
    variant = Variant.from_name("fwd.sm90a.bf16.d64")
    key = build_kernels.build_key(variant, sources)
    real = Path.read_bytes
    for changed in sources:
        monkeypatch.setattr(Path, "read_bytes", lambda self: real(self) + b"#" if self == changed else real(self))
        assert build_kernels.build_key(variant, sources) != key, changed
    monkeypatch.setattr(Path, "read_bytes", real)


def test_each_worker_pool_serves_one_architecture(monkeypatch):
    """The DSL reads CUTE_DSL_ARCH once, when first imported: a worker compiles only for
    the architecture its pool was started with, and says so if handed another."""
    import build_kernels

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    build_kernels._use_arch("sm_100a")
    assert os.environ["CUTE_DSL_ARCH"] == "sm_100a"  # set, not set by default
    with pytest.raises(build_kernels.BuildError, match="a worker for sm_100a"):
        build_kernels._compile_one(Variant.from_name("fwd.sm90a.bf16.d64"))
