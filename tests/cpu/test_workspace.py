"""The backward's workspace, laid out by the manifest rows' rules; no GPU needed.

The rows here are what the build writes (fa4_aot/src/sm90/bwd/config.py, pure Python) for
every backward variant of the matrix, so each test covers variants the CPU build does
not compile; test_sizes_of_the_built_rows checks the rows a real build wrote. The sizes
must equal those of the formula the run time used before it read the rules (``old_bytes``,
a copy of it).
"""

import json

import pytest

from fa4_aot import dense as api, policy
from fa4_aot.launch import workspace as ws
from fa4_aot.errors import LayoutError, ShapeError, UnsupportedVariantError
from fa4_aot.launch.manifest import Manifest
from fa4_aot.variants import MATRIX, Variant, serving_head_dim

from .test_inputs import BASE

config = pytest.importorskip("fa4_aot.src.sm90.bwd.config")

BWD = [v for v in MATRIX if v.kind == "bwd" and not v.varlen and not v.local]
LOCAL = [v for v in MATRIX if v.kind == "bwd" and not v.varlen and v.local]


def row_of(v: Variant) -> dict:
    """The manifest row fields the run time reads, as build_kernels.py writes them (JSON)."""
    cfg = config.BwdConfig.of(v)
    return json.loads(json.dumps({"name": v.name, "variant": v.to_dict(), "config": cfg.to_dict(),
                                  "workspace": config.workspace_rule(cfg)}))


class RulesLibrary:
    """A KernelLibrary stand-in whose manifest holds ``rows`` (default: every backward)."""

    def __init__(self, variants=BWD):
        rows = [row_of(v) for v in variants]

        class _Manifest:
            data = {"kernels": rows}

            def matching(self, **axes):  # as fa4_aot.launch.manifest.Manifest.matching
                return [r for r in rows if all(r["variant"].get(a) == x for a, x in axes.items())]

            def kernel_head_dim(self, kind, head_dim):  # as Manifest.kernel_head_dim
                served = serving_head_dim({r["variant"]["head_dim"] for r in rows if r["variant"]["kind"] == kind},
                                          head_dim)
                if served is None:
                    raise UnsupportedVariantError(f"head_dim {head_dim}: not served")
                return served

        _Manifest.rows = {r["name"]: r for r in rows}
        self.manifest = _Manifest()


LIBRARY = RulesLibrary()


# ---------------------------------------------------------------- the formula before the rules
OLD_TILE_M = {64: 64, 96: 64, 128: 64, 192: 64, 256: 64}
OLD_TILE_N = {64: 128, 96: 128, 128: 128, 192: 96, 256: 80}
OLD_TAIL_MAX_TILES, OLD_TAIL_COUNTERS = 96, 4


def old_regions(b, sq, hq, d, causal, det, seqlen_k=None, heads_kv=None):
    chains = 2 if det and not causal else 1
    tile_m = 80 if d == 128 and not causal else OLD_TILE_M[d]
    tile_n = OLD_TILE_N[d]
    split = not causal and not det and d in (64, 96, 128)
    tiles = OLD_TAIL_MAX_TILES
    if seqlen_k is not None and heads_kv is not None:
        items = 0 if hq != heads_kv else -(-seqlen_k // tile_n) * heads_kv * b
        tiles = min(OLD_TAIL_MAX_TILES, items)
    m_blocks = -(-sq // tile_m)
    rows = b * hq * m_blocks * tile_m * 4
    partial = tiles * 2 * tile_n * d * 4 if split else 0
    return [("lse2", rows), ("dsum", rows), ("dq_accum", chains * b * m_blocks * tile_m * hq * d * 4),
            ("dq_semaphore", chains * b * hq * m_blocks * 4), ("dq_done", b * hq * 4),
            ("tail_counters", OLD_TAIL_MAX_TILES * OLD_TAIL_COUNTERS * 4), ("dkv_partial", partial)]


def old_bytes(*args, **kw):
    regions = old_regions(*args, **kw)
    return sum(-(-size // 256) * 256 for _, size in regions[:-1]) + regions[-1][1]


PROBLEMS = [  # (batch, seqlen_q, heads_q, seqlen_k, heads_kv)
    (1, 1, 1, 1, 1), (2, 100, 8, 300, 2), (2, 100, 8, 300, 8), (3, 17, 3, 17, 3), (2, 1000, 5, 1000, 5),
    (1, 257, 7, 513, 7), (16, 1024, 32, 1024, 32), (4, 81, 4, 80, 1), (1, 16384, 16, 16384, 16),
]


def sizes_of(b, sq, hq, d, sk, hkv):
    return {"batch": b, "seqlen_q": sq, "heads_q": hq, "head_dim": d, "seqlen_k": sk, "heads_kv": hkv}


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal,det", [(False, False), (True, False), (False, True), (True, True)])
def test_sizes_equal_the_old_formulas(d, causal, det):
    for b, sq, hq, sk, hkv in PROBLEMS:
        most = api.backward_workspace_bytes(b, sq, hq, d, causal=causal, deterministic=det, library=LIBRARY)
        assert most == old_bytes(b, sq, hq, d, causal, det)
        exact = api.backward_workspace_bytes(b, sq, hq, d, causal=causal, deterministic=det, seqlen_k=sk,
                                             heads_kv=hkv, library=LIBRARY)
        assert exact == old_bytes(b, sq, hq, d, causal, det, sk, hkv)
        for dtype in ("bf16", "fp16"):
            assert api.backward_workspace_bytes(b, sq, hq, d, causal=causal, deterministic=det, dtype=dtype,
                                                library=LIBRARY) == most
        # every row of the variant (q_tiles 1 and 2) lays out the same regions
        for v in BWD:
            if (v.head_dim, v.causal, v.deterministic) == (d, causal, det):
                row = row_of(v)
                got = ws.regions(row["workspace"], api._workspace_names(row, sizes_of(b, sq, hq, d, sk, hkv)))
                assert got == old_regions(b, sq, hq, d, causal, det, sk, hkv), v.name


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("det", [False, True])
def test_local_rows_are_the_causal_layout_and_the_sinks_partial_sums(d, det):
    """A local backward (window, sinks) lays its workspace out as the causal one, and then
    the sinks' gradient's partial sums: one float per warp of each preprocess block."""
    local = RulesLibrary(BWD + LOCAL)
    for b, sq, hq, sk, hkv in PROBLEMS:
        causal = old_regions(b, sq, hq, d, True, det, sk, hkv)
        tile_m = OLD_TILE_M[d]
        sinks = ("sink_partial", hq * b * -(-sq // tile_m) * (tile_m // 8) * 4)
        for v in LOCAL:
            if (v.head_dim, v.deterministic) == (d, det):
                row = row_of(v)
                got = ws.regions(row["workspace"], api._workspace_names(row, sizes_of(b, sq, hq, d, sk, hkv)))
                assert got == causal + [sinks], v.name
        most = api.backward_workspace_bytes(b, sq, hq, d, deterministic=det, local=True, library=local)
        assert most == sum(-(-size // 256) * 256 for _, size in causal) + sinks[1]  # each region 256-aligned
        assert api.backward_workspace_bytes(b, sq, hq, d, causal=True, deterministic=det, library=local) \
            == old_bytes(b, sq, hq, d, True, det), "a local row sized a plain call"


def test_sizes_of_the_built_rows(built):
    """The rules a real build wrote give the same sizes, and the rows' configs are the
    build's (one config and rule per backward row)."""
    library = RulesLibrary([])
    library.manifest = Manifest(built[0])
    rows = [r for r in library.manifest.data["kernels"] if r["variant"]["kind"] == "bwd"]
    assert rows
    for row in rows:
        v = Variant.from_dict(row["variant"])
        assert row["config"] == row_of(v)["config"] and row["workspace"] == row_of(v)["workspace"]
        for b, sq, hq, sk, hkv in PROBLEMS:
            got = api.backward_workspace_bytes(b, sq, hq, v.head_dim, causal=v.causal, deterministic=v.deterministic,
                                               seqlen_k=sk, heads_kv=hkv, dtype=v.dtype, local=v.local,
                                               library=library)
            if v.local:  # the causal layout, and the sinks' partial sums last
                regions = old_regions(b, sq, hq, v.head_dim, True, v.deterministic, sk, hkv)
                sinks = hq * b * -(-sq // row["config"]["tile_m"]) * (row["config"]["tile_m"] // 8) * 4
                assert got == sum(-(-size // 256) * 256 for _, size in regions) + sinks
            else:
                assert got == old_bytes(b, sq, hq, v.head_dim, v.causal, v.deterministic, sk, hkv)


def test_a_head_dim_not_built_is_refused():
    with pytest.raises(UnsupportedVariantError, match="head_dim 264"):
        api.backward_workspace_bytes(2, 100, 8, 264, library=LIBRARY)
    with pytest.raises(UnsupportedVariantError):
        api.backward_workspace_bytes(2, 100, 8, 64, dtype="fp32", library=LIBRARY)


def carve(v: Variant, problem: tuple, size: int, ptr: int = BASE) -> dict:
    b, sq, hq, d, sk, hkv = problem
    row = row_of(v)
    return ws.carve(row["workspace"], api._workspace_names(row, sizes_of(b, sq, hq, d, sk, hkv)), ptr, size)


def variant(d, causal, det=False, q_tiles=1):
    return Variant("bwd", "sm90a", "bf16", d, causal, deterministic=det, q_tiles=q_tiles)


def test_workspace_is_carved_aligned_and_checked():
    problem = (2, 100, 8, 128, 300, 2)
    need = api.backward_workspace_bytes(2, 100, 8, 128, seqlen_k=300, heads_kv=2, library=LIBRARY)
    regions = carve(variant(128, False), problem, need)
    starts = sorted(r["ptr"] for r in regions.values())
    assert all(s % 256 == 0 for s in starts) and starts[0] == BASE
    assert regions["dq_accum"]["shape"] == (2, 100, 8, 128)
    assert regions["dq_accum"]["strides"] == (100 * 8 * 128, 8 * 128, 128, 1)
    with pytest.raises(ShapeError, match="workspace has"):
        carve(variant(128, False), problem, need - 1)
    with pytest.raises(LayoutError, match="256-byte"):
        carve(variant(128, False), problem, need, BASE + 16)


def test_deterministic_non_causal_workspace_holds_every_dq_copy():
    """The deterministic non-causal backward adds dQ into ``chains`` copies (batch-major in
    one tensor) with as many semaphores; a workspace sized for another mode is refused."""
    chains = row_of(variant(128, False, True))["config"]["chains"]
    assert chains > 1 and row_of(variant(128, True, True))["config"]["chains"] == 1
    assert row_of(variant(128, False))["config"]["chains"] == 1
    causal = api.backward_workspace_bytes(2, 100, 8, 128, causal=True, library=LIBRARY)
    assert api.backward_workspace_bytes(2, 100, 8, 128, causal=True, deterministic=True, library=LIBRARY) == causal
    need = api.backward_workspace_bytes(2, 100, 8, 128, deterministic=True, library=LIBRARY)
    assert need > causal
    problem = (2, 100, 8, 128, 300, 2)
    regions = carve(variant(128, False, True), problem, need)
    assert regions["dq_accum"]["shape"] == (2 * chains, 100, 8, 128)
    assert regions["dq_semaphore"]["ptr"] - regions["dq_accum"]["ptr"] >= chains * 2 * 100 * 8 * 128 * 4
    with pytest.raises(ShapeError, match="same causal and deterministic"):
        carve(variant(128, False, True), problem, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_workspace_statistics_rows_are_padded_to_whole_query_tiles(causal):
    """The kernel copies each query tile's LSE2 / D values with one bulk copy (4 * tile_m
    bytes): every (batch, head) row of them must be a whole number of tiles, 16-byte
    aligned."""
    row = row_of(variant(128, causal))
    tile_m = row["config"]["tile_m"]
    assert tile_m == (64 if causal else 80)
    for seqlen_q in (1, 63, 64, 65, 79, 80, 81, 100, 1000):
        regions = dict(ws.regions(row["workspace"], api._workspace_names(row, sizes_of(2, seqlen_q, 8, 128, 1, 8))))
        padded = -(-seqlen_q // tile_m) * tile_m
        assert regions["lse2"] == regions["dsum"] == 2 * 8 * padded * 4
        assert padded * 4 % 16 == 0
        assert regions["dq_semaphore"] == 2 * 8 * (padded // tile_m) * 4


@pytest.mark.parametrize("causal", [False, True])
def test_workspace_accumulator_holds_whole_query_tiles(causal):
    """At head_dim 96 and 128 the dQ writer adds whole query tiles (fragment order) into
    the accumulator, the last one past seqlen_q: every copy must hold them all, and still
    the (b * copies, s_q, h, d) rows the 2D TMA reduce of the other head dims addresses."""
    for seqlen_q in (1, 63, 64, 65, 81, 1000):
        for deterministic in (False, True):
            row = row_of(variant(128, causal, deterministic))
            tile_m, chains = row["config"]["tile_m"], row["config"]["chains"]
            regions = dict(ws.regions(row["workspace"],
                                      api._workspace_names(row, sizes_of(3, seqlen_q, 4, 128, 1, 4))))
            padded = -(-seqlen_q // tile_m) * tile_m
            assert regions["dq_accum"] == chains * 3 * 4 * padded * 128 * 4
            assert regions["dq_accum"] >= chains * 3 * seqlen_q * 4 * 128 * 4


def test_workspace_regions_fit_the_reported_size():
    """carve starts every region at a 256-byte boundary: the size the API reports must
    count that padding, or the last region would run past a workspace of exactly that
    size."""
    for b, s, h, d in ((1, 1, 1, 64), (3, 17, 3, 96), (2, 1000, 5, 128), (1, 257, 7, 256)):
        for causal, deterministic in ((False, False), (True, True), (False, True)):
            size = api.backward_workspace_bytes(b, s, h, d, causal=causal, deterministic=deterministic,
                                                library=LIBRARY)
            row = row_of(variant(d, causal, deterministic))
            names = api._workspace_names(row, {"batch": b, "seqlen_q": s, "heads_q": h, "head_dim": d})
            regions = ws.carve(row["workspace"], names, BASE, size)
            assert all(r["ptr"] % 256 == 0 for r in regions.values())
            for name, bytes_ in ws.regions(row["workspace"], names):
                assert regions[name]["ptr"] + bytes_ <= BASE + size


def test_workspace_partial_sums_are_sized_by_the_problem_when_told():
    """backward_workspace_bytes with seqlen_k and heads_kv sizes the split last wave's
    partial sums for the problem's key tiles (fewer than the rule's tail_max_tiles when it
    has fewer, none with GQA); without them, for the most. A workspace of either size is
    taken, and one byte less than the exact size is refused."""
    row = row_of(variant(128, False))
    most_tiles = row["workspace"]["constants"]["tail_max_tiles"]
    assert row["config"]["tail_split"]
    for heads_kv in (2, 8):  # GQA: no split; MHA: 3 key tiles x 8 heads x 2 = 48 tiles
        most = api.backward_workspace_bytes(2, 100, 8, 128, library=LIBRARY)
        exact = api.backward_workspace_bytes(2, 100, 8, 128, seqlen_k=300, heads_kv=heads_kv, library=LIBRARY)
        tiles = min(most_tiles, 3 * heads_kv * 2) if heads_kv == 8 else 0
        assert most - exact == (most_tiles - tiles) * 2 * 128 * 128 * 4
        for size in (most, exact):
            carve(variant(128, False), (2, 100, 8, 128, 300, heads_kv), size)
        with pytest.raises(ShapeError, match="workspace has"):
            carve(variant(128, False), (2, 100, 8, 128, 300, heads_kv), exact - 1)
    # causal and deterministic variants keep no partial sums: the same size either way
    for causal, det in ((True, False), (False, True)):
        assert api.backward_workspace_bytes(2, 100, 8, 128, causal=causal, deterministic=det, library=LIBRARY) \
            == api.backward_workspace_bytes(2, 100, 8, 128, causal=causal, deterministic=det, seqlen_k=300,
                                            heads_kv=8, library=LIBRARY)


def test_a_rule_naming_an_unknown_size_is_a_manifest_error():
    from fa4_aot.errors import ManifestError

    rule = {"align": 256, "constants": {"query_tile": 64}, "regions": [{"name": "x", "itemsize": 4,
                                                                       "count": ["batch", "warp_count"]}]}
    with pytest.raises(ManifestError, match="warp_count"):
        ws.regions(rule, ws.names(rule, {"batch": 1, "seqlen_q": 1}))


def test_partial_tiles_bound_follows_the_rows_key_tile():
    for v in BWD:
        row = row_of(v)
        sizes = sizes_of(2, 1000, 4, v.head_dim, 3000, 4)
        most = row["workspace"]["constants"]["tail_max_tiles"]
        assert policy.partial_tiles(sizes, row["config"], most) == min(most, -(-3000 // row["config"]["tile_n"]) * 8)
