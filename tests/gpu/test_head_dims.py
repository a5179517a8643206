"""Head dims between the built ones (any multiple of 8 up to 256) on the narrowest built
variant at least as wide (docs/design.md, "Head dims"), against the float32 reference, on
an sm_90 GPU: dense, varlen and decode, forward and backward (deterministic too), GQA,
boundary shapes, windows, sinks and softcap, the torch layer's autograd and the SDPA hook.

Every tensor, input and output, is a view of the first d columns of a tensor 8 columns
wider whose extra columns hold NaN: a kernel that reads past the tensors' head dim brings
NaN into what it computes, and one that writes there replaces the NaN (checked after each
call). Outputs are NaN-poisoned, inputs fresh draws; tolerances are the dense tests'.

    PYTHONPATH=$PWD python -m pytest tests/gpu/test_head_dims.py -q
"""

import pytest

torch = pytest.importorskip("torch")

import fa4_aot  # noqa: E402
from fa4_aot.errors import UnsupportedVariantError  # noqa: E402
from fa4_aot.launch.calls import default_library  # noqa: E402
from fa4_aot.torch import (  # noqa: E402
    flash_attn_bwd, flash_attn_func, flash_attn_fwd, flash_attn_varlen_bwd, flash_attn_varlen_fwd,
)
from fa4_aot.variants import MATRIX  # noqa: E402

from ..reference import check_attention  # noqa: E402
from .test_bwd import check_grads  # noqa: E402
from .test_decode import _cache as decode_cache, _check as check_decode, _run as run_decode  # noqa: E402
from .test_local import _sinks  # noqa: E402
from .test_local_bwd import _assert_within, grad_errors  # noqa: E402
from .test_varlen import _check_grads_by_sequence, _check_sequences, _lengths_to_cu  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PAD = 8  # NaN columns past each tensor's head dim
# a head dim each built one serves (none of them built), and the edges: the narrowest
# (8: one 16-byte chunk) and 8 below each built one
SERVED = {64: 40, 96: 80, 128: 112, 192: 160, 256: 232, 512: 512}  # 512: its own width only
EDGES = [8, 56, 88, 120, 184, 248]


def _sarm(variants):
    return [v for v in variants if v.arch == "sm90a"]


# q's head dim for v too (the 192/128 pair kernels: PAIR_BWD and the pair tests below)
FWD = _sarm(v for v in MATRIX if v.kind == "fwd" and not v.varlen and not v.local and not v.head_dim_v)
BWD = _sarm(v for v in MATRIX if v.kind == "bwd" and not v.varlen and not v.local and v.dtype == "bf16"
            and not v.head_dim_v)
VARLEN = _sarm(v for v in MATRIX if v.kind == "fwd" and v.varlen and not v.local and v.dtype == "bf16"
               and not v.head_dim_v)
VARLEN_BWD = _sarm(v for v in MATRIX if v.kind == "bwd" and v.varlen and not v.local and v.dtype == "bf16"
                   and not v.head_dim_v)
PAIR_BWD = _sarm(v for v in MATRIX if v.kind == "bwd" and v.head_dim_v and not v.varlen)
DECODE = _sarm(v for v in MATRIX if v.kind == "decode" and not v.local and v.kv_dtype == "same")
LOCAL = _sarm(v for v in MATRIX if v.kind == "fwd" and v.local and not v.varlen and v.dtype == "bf16")
LOCAL_BWD = _sarm(v for v in MATRIX if v.kind == "bwd" and v.local and not v.varlen and v.dtype == "bf16"
                  and not v.deterministic)
DECODE_LOCAL = _sarm(v for v in MATRIX if v.kind == "decode" and v.local and v.dtype == "bf16" and v.kv_dtype == "same")

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
    (1, 1, 1, 2, 2),  # one token: a single, mostly padded tile
    (2, 1000, 1000, 4, 2),  # GQA, ragged last q and k tiles
    (2, 128, 700, 2, 2),  # seqlen_q < seqlen_k: causal diagonal far right
    (2, 700, 128, 2, 1),  # seqlen_q > seqlen_k, MQA: causal rows that see no key
]
BWD_SHAPES = [(3, 17, 17, 2, 1), (2, 1000, 1000, 4, 2), (2, 700, 128, 2, 2)]


def _wide(lead: tuple, d: int, dtype, gen=None):
    """A (*lead, d) view of a (*lead, d + PAD) tensor: a fresh draw in its d columns (NaN
    there where ``gen`` is None: an output), NaN past them."""
    full = torch.full((*lead, d + PAD), float("nan"), device="cuda", dtype=dtype)
    if gen is not None:
        full[..., :d] = torch.randn(*lead, d, device="cuda", dtype=dtype, generator=gen)
    return full[..., :d]


def _untouched(*views):
    """Each view's extra columns (its base's past the view) still NaN: nothing written there."""
    for t in views:
        assert t._base[..., t.shape[-1]:].isnan().all(), "a kernel wrote past the tensors' head dim"


def _dense(shape, d, dtype, gen):
    b, sq, sk, hq, hkv = shape
    return _wide((b, sq, hq), d, dtype, gen), _wide((b, sk, hkv), d, dtype, gen), _wide((b, sk, hkv), d, dtype, gen)


def _poisoned(q):
    b, sq, hq, d = q.shape
    return _wide((b, sq, hq), d, q.dtype), torch.full((b, hq, sq), float("nan"), device="cuda")


def _workspace(q, causal, deterministic, local=False):
    b, sq, hq, d = q.shape
    size = fa4_aot.backward_workspace_bytes(b, sq, hq, d, causal=causal, deterministic=deterministic, local=local)
    return torch.full((size,), 0xFF, dtype=torch.uint8, device="cuda")


# ---------------------------------------------------------------- dense
@pytest.mark.parametrize("variant", FWD, ids=lambda v: v.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}x{}".format(*s))
def test_forward_on_the_next_wider_variant(variant, shape, gen):
    q, k, v = _dense(shape, SERVED[variant.head_dim], DTYPES[variant.dtype], gen)
    out, lse = _poisoned(q)
    flash_attn_fwd(q, k, v, causal=variant.causal, out=out, lse=lse, q_tiles=variant.q_tiles)
    torch.cuda.synchronize()
    check_attention(out, lse, q, k, v, variant.causal)
    _untouched(out)


@pytest.mark.parametrize("d", EDGES)
def test_forward_at_the_edges(d, gen):
    for causal in (False, True):
        q, k, v = _dense((2, 300, 513, 4, 2), d, torch.bfloat16, gen)
        out, lse = _poisoned(q)
        flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse)
        torch.cuda.synchronize()
        check_attention(out, lse, q, k, v, causal)
        _untouched(out)


def _backward_case(shape, d, dtype, causal, deterministic, q_tiles, gen):
    """Forward, then backward into NaN-poisoned wide gradients: (q, k, v, dout, out, grads)."""
    q, k, v = _dense(shape, d, dtype, gen)
    dout = _wide(q.shape[:3], d, dtype, gen)
    out, lse = _poisoned(q)
    flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse)
    grads = [_wide(x.shape[:3], d, dtype) for x in (q, k, v)]
    flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=deterministic, q_tiles=q_tiles,
                   dq=grads[0], dk=grads[1], dv=grads[2], workspace=_workspace(q, causal, deterministic))
    torch.cuda.synchronize()
    return q, k, v, dout, out, grads


@pytest.mark.parametrize("variant", BWD, ids=lambda v: v.name)
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}x{}".format(*s))
def test_backward_on_the_next_wider_variant(variant, shape, gen):
    options = (variant.causal, variant.deterministic, variant.q_tiles)
    q, k, v, dout, out, grads = _backward_case(shape, SERVED[variant.head_dim], torch.bfloat16, *options, gen)
    check_grads(grads, q, k, v, dout, out, variant.causal)
    _untouched(*grads)
    if variant.deterministic:
        seeded = lambda: torch.Generator(device="cuda").manual_seed(7)  # noqa: E731
        once = _backward_case(shape, SERVED[variant.head_dim], torch.bfloat16, *options, seeded())[5]
        again = _backward_case(shape, SERVED[variant.head_dim], torch.bfloat16, *options, seeded())[5]
        assert all(torch.equal(a, b) for a, b in zip(once, again)), "deterministic runs differ"


@pytest.mark.parametrize("d, dtype, causal", [(72, torch.float16, False), (8, torch.bfloat16, True),
                                              (248, torch.bfloat16, True), (136, torch.float16, True)])
def test_backward_fp16_and_the_edges(d, dtype, causal, gen):
    q, k, v, dout, out, grads = _backward_case((2, 300, 257, 4, 2), d, dtype, causal, False, None, gen)
    check_grads(grads, q, k, v, dout, out, causal)
    _untouched(*grads)


def test_packed_qkv_of_one_projection(gen):
    """q, k, v as views of one (b, s, 3, h, 80) projection (a ViT's), forward and
    backward through the autograd layer, against the reference; the same on contiguous copies."""
    qkv = torch.randn(2, 577, 3, 4, 80, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    check_grads(qkv.grad.unbind(2), *(x.detach() for x in (q, k, v)), dout, out.detach(), False)
    copies = [x.detach().contiguous().requires_grad_(True) for x in (q, k, v)]
    again = flash_attn_func(*copies)
    again.backward(dout)
    assert torch.equal(again, out)


def test_torch_autograd_and_lse(gen):
    q, k, v = (_wide((2, 333, 4), 72, torch.bfloat16, gen).requires_grad_(True) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 333)
    check_attention(out.detach(), lse.detach(), q.detach(), k.detach(), v.detach(), True)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_grads([x.grad for x in (q, k, v)], *(x.detach() for x in (q, k, v)), dout, out.detach(), True)


# ---------------------------------------------------------------- varlen
MIXES = [  # (query lengths, key lengths, heads_q, heads_kv)
    ([1, 0, 130, 257, 64], [1, 5, 130, 300, 1000], 4, 4),  # one-token, empty, tile +-1, sq != sk
    ([700, 3, 0, 191], [700, 3, 0, 193], 6, 2),  # GQA; an empty sequence in both q and k
]


def _packed(lengths, heads, d, gen=None, dtype=torch.bfloat16):
    return _wide((sum(lengths), heads), d, dtype, gen)


@pytest.mark.parametrize("variant", VARLEN, ids=lambda v: v.name)
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: f"{len(m[0])}seqs_h{m[2]}x{m[3]}")
def test_varlen_forward_on_the_next_wider_variant(variant, mix, gen):
    lq, lk, hq, hkv = mix
    d = SERVED[variant.head_dim]
    q, k, v = _packed(lq, hq, d, gen), _packed(lk, hkv, d, gen), _packed(lk, hkv, d, gen)
    out = _packed(lq, hq, d)
    lse = torch.full((hq, sum(lq)), float("nan"), device="cuda")
    flash_attn_varlen_fwd(q, k, v, _lengths_to_cu(lq), _lengths_to_cu(lk), max(lq), max(lk), causal=variant.causal,
                          out=out, lse=lse)
    torch.cuda.synchronize()
    _check_sequences(out, lse, q, k, v, lq, lk, lq, lk, variant.causal)
    _untouched(out)


@pytest.mark.parametrize("variant", VARLEN_BWD, ids=lambda v: v.name)
def test_varlen_backward_on_the_next_wider_variant(variant, gen):
    lq, lk, hq, hkv = MIXES[variant.head_dim % 2]
    d = SERVED[variant.head_dim]
    q, k, v = _packed(lq, hq, d, gen), _packed(lk, hkv, d, gen), _packed(lk, hkv, d, gen)
    dout, out = _packed(lq, hq, d, gen), _packed(lq, hq, d)
    cu_q, cu_k = _lengths_to_cu(lq), _lengths_to_cu(lk)
    lse = torch.full((hq, sum(lq)), float("nan"), device="cuda")
    flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=variant.causal, out=out, lse=lse)
    size = fa4_aot.backward_varlen_workspace_bytes(sum(lq), len(lq), hq, d, causal=variant.causal,
                                                   deterministic=variant.deterministic)
    grads = [_packed(lq, hq, d), _packed(lk, hkv, d), _packed(lk, hkv, d)]
    flash_attn_varlen_bwd(q, k, v, out, dout, lse, cu_q, cu_k, max(lq), max(lk), causal=variant.causal,
                          deterministic=variant.deterministic, dq=grads[0], dk=grads[1], dv=grads[2],
                          workspace=torch.full((size,), 0xFF, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    _check_grads_by_sequence(grads, q, k, v, out, dout, lq, lk, lq, lk, variant.causal)
    _untouched(*grads)


# ---------------------------------------------------------------- decode
# (batch, seqlen_q, heads_q, heads_kv, max_cache, page_size or None), each with its edge
DECODE_CASES = [
    (4, 1, 32, 8, 1000, None),  # GQA 4, one token, cache not a multiple of the tile
    (4, 16, 16, 1, 300, 48),  # MQA: 256 packed rows; pages of 48 keys
    (2, 128, 8, 8, 700, 64),  # the most query tokens decode takes
]


def _cache(batch, max_cache, heads_kv, d, page, gen, d_v=None):
    """test_decode's cache (pages permuted), every tensor a wide view."""
    return decode_cache(batch, max_cache, heads_kv, d, torch.bfloat16, page, gen, d_v,
                        make=lambda lead, width: _wide(lead, width, torch.bfloat16, gen))


def _decode(q, k, v, lengths, table, causal, splits, **mods):
    """test_decode's run into a wide NaN-poisoned out, its extra columns checked after."""
    out, lse = run_decode(q, k, v, lengths, table, causal, splits, out=_wide(q.shape[:3], v.shape[-1], q.dtype),
                          **mods)
    _untouched(out)
    return out, lse


@pytest.mark.parametrize("variant", [v for v in DECODE if v.dtype == "bf16"], ids=lambda v: v.name)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"b{c[0]}_q{c[1]}_h{c[2]}x{c[3]}_k{c[4]}_p{c[5]}")
def test_decode_on_the_next_wider_variant(variant, case, gen):
    batch, sq, hq, hkv, max_cache, page = case
    d = SERVED[variant.head_dim]
    q = _wide((batch, sq, hq), d, torch.bfloat16, gen)
    k, v, table, k_full, v_full = _cache(batch, max_cache, hkv, d, page, gen)
    lengths = torch.randint(1, max_cache + 1, (batch,), generator=gen, device="cuda", dtype=torch.int32)
    lengths[0] = max_cache
    for splits in (None, 1, 3):  # 3: the combine writes out
        out, lse = _decode(q, k, v, lengths, table, variant.causal, splits)
        check_decode(out, lse, q, k_full, v_full, lengths, variant.causal)


def test_dense_decode_shapes_and_the_kvcache_layer(gen):
    """A decode shape through fa4_aot.forward (the decode kernel, full cache) and
    flash_attn_with_kvcache with an append, at head dim 80."""
    from fa4_aot.torch import flash_attn_with_kvcache

    q, k, v = _dense((2, 1, 8192, 32, 4), 80, torch.bfloat16, gen)
    out, lse = flash_attn_fwd(q, k, v)
    check_attention(out, lse, q, k, v, False)
    kc, vc = (_wide((2, 1000, 4), 80, torch.bfloat16, gen) for _ in range(2))
    k_new, v_new = (_wide((2, 3, 4), 80, torch.bfloat16, gen) for _ in range(2))
    lengths = torch.tensor([500, 997], dtype=torch.int32, device="cuda")
    q = _wide((2, 3, 32), 80, torch.bfloat16, gen)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lengths, causal=True, return_lse=True)
    torch.cuda.synchronize()
    _untouched(kc, vc)
    for b, n in enumerate((503, 1000)):
        assert torch.equal(kc[b, n - 3:n], k_new[b]) and torch.equal(vc[b, n - 3:n], v_new[b])
        check_attention(out[b:b + 1], lse[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], True)


# ---------------------------------------------------------------- local
@pytest.mark.parametrize("variant", LOCAL, ids=lambda v: v.name)
def test_local_forward_and_backward(variant, gen):
    """A window of (100, 20) and sinks (softcap 30 where built), forward then backward with
    the sinks' gradient."""
    d = SERVED[variant.head_dim]
    cap = 30.0 if variant.softcap else 0.0
    q, k, v = _dense((2, 700, 900, 4, 2), d, torch.bfloat16, gen)
    sinks = _sinks(4, gen)
    out, lse = _poisoned(q)
    flash_attn_fwd(q, k, v, window_size=(100, 20), softcap=cap, learnable_sink=sinks, out=out, lse=lse,
                   q_tiles=variant.q_tiles)
    torch.cuda.synchronize()
    check_attention(out, lse, q, k, v, False, window=(100, 20), sink=sinks, softcap=cap)
    _untouched(out)
    if not any(b.head_dim == variant.head_dim and b.softcap == variant.softcap for b in LOCAL_BWD):
        return
    dout = _wide(q.shape[:3], d, torch.bfloat16, gen)
    grads = [_wide(x.shape[:3], d, torch.bfloat16) for x in (q, k, v)]
    dsink = torch.full_like(sinks, float("nan"))
    flash_attn_bwd(q, k, v, out, dout, lse, window_size=(100, 20), softcap=cap, learnable_sink=sinks, dsink=dsink,
                   dq=grads[0], dk=grads[1], dv=grads[2], workspace=_workspace(q, False, False, local=True))
    torch.cuda.synchronize()
    _assert_within(grad_errors([*grads, dsink], q, k, v, dout, out, (100, 20), sinks, cap))
    _untouched(*grads)


@pytest.mark.parametrize("variant", DECODE_LOCAL, ids=lambda v: v.name)
def test_local_decode(variant, gen):
    d = SERVED[variant.head_dim]
    cap = 30.0 if variant.softcap else 0.0
    q = _wide((4, 1, 32), d, torch.bfloat16, gen)
    k, v, table, k_full, v_full = _cache(4, 2000, 8, d, 64, gen)
    lengths = torch.tensor([2000, 1, 130, 1777], dtype=torch.int32, device="cuda")
    sinks = _sinks(32, gen)
    for splits in (None, 1, 3):
        out, lse = _decode(q, k, v, lengths, table, False, splits, window_size=(300, 0), softcap=cap,
                           learnable_sink=sinks)
        check_decode(out, lse, q, k_full, v_full, lengths, False, window=(300, 0), sink=sinks, softcap=cap)


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("d", [4, 36, 100, 264, 384, 504, 520])
def test_a_head_dim_no_variant_serves_is_refused_before_launch(d, gen):
    """Not a multiple of 8, or past 256 and not 512: a typed error, nothing written (q,
    k, v one tensor of one head and one token, so that no stride rule refuses it first)."""
    q = torch.randn(1, 1, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = torch.full_like(q, float("nan")), torch.full((1, 1, 1), float("nan"), device="cuda")
    with pytest.raises(UnsupportedVariantError, match=f"head_dim {d}"):
        fa4_aot.forward(q, q, q, out, lse, stream=torch.cuda.current_stream().cuda_stream)
    with pytest.raises(UnsupportedVariantError, match=f"head_dim {d}"):
        fa4_aot.backward_workspace_bytes(1, 64, 2, d)
    torch.cuda.synchronize()
    assert out.isnan().all() and lse.isnan().all()


def test_head_dim_512_backward_is_refused_before_launch(gen):
    """512 has a forward and decode, no backward: its workspace and autograd are typed
    errors naming the head dim; a dense call of a decode shape at 512 takes the decode
    kernel (two warpgroups, half the head dim each)."""
    q = torch.randn(1, 1, 2, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 8192, 2, 512, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    with pytest.raises(UnsupportedVariantError, match="head_dim 512"):
        fa4_aot.backward_workspace_bytes(1, 64, 2, 512)
    out, lse = _poisoned(q)
    flash_attn_fwd(q, k, v, out=out, lse=lse)  # one token against 8k keys: a decode shape
    torch.cuda.synchronize()
    check_attention(out, lse, q, k, v, False)
    q.requires_grad_(True)
    with pytest.raises(UnsupportedVariantError, match="head_dim 512"):
        flash_attn_func(q, k, v).sum().backward()


# ---------------------------------------------------------------- v's head dim not q's
# (q/k head dim, v head dim): DeepSeek V3's 192/128 on the d192 kernels; v wider than q on
# the d128 kernels; two sizes between the built ones on the d96 kernels
PAIRS = [(192, 128), (64, 128), (96, 40)]
PAIR_IDS = [f"qk{d}_v{dv}" for d, dv in PAIRS]


def _pair(shape, d, dv, dtype, gen):
    b, sq, sk, hq, hkv = shape
    return (_wide((b, sq, hq), d, dtype, gen), _wide((b, sk, hkv), d, dtype, gen),
            _wide((b, sk, hkv), dv, dtype, gen))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}x{}".format(*s))
def test_forward_with_v_of_its_own_head_dim(pair, causal, shape, dtype, gen):
    """192/128 on the d192v128 kernels (test_own_head_dim_v_rows says they are taken), the
    other pairs on q's or v's head dim."""
    d, dv = pair
    q, k, v = _pair(shape, d, dv, dtype, gen)
    b, sq, hq = q.shape[:3]
    out, lse = _wide((b, sq, hq), dv, dtype), torch.full((b, hq, sq), float("nan"), device="cuda")
    flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse)
    torch.cuda.synchronize()
    check_attention(out, lse, q, k, v, causal)
    _untouched(out)


def test_own_head_dim_v_rows():
    """The forward's and backward's rows for 192/128 are the d192v128 kernels (v of 128
    columns or fewer beside q's 136-192), the d192 ones for a wider v or with a window."""
    manifest = default_library().manifest
    for varlen in (False, True):
        axes = dict(kind="fwd", dtype="bf16", head_dim=192, causal=True, varlen=varlen, local=False, softcap=False)
        assert manifest.own_head_dim_v(axes, 128)["head_dim_v"] == 128
        assert manifest.own_head_dim_v(axes, 72)["head_dim_v"] == 128
        assert "head_dim_v" not in manifest.own_head_dim_v(axes, 136)
        assert "head_dim_v" not in manifest.own_head_dim_v({**axes, "causal": False, "local": True}, 128)
        for det in (False, True):
            bwd = dict(kind="bwd", dtype="fp16", head_dim=192, causal=False, deterministic=det, varlen=varlen)
            assert manifest.own_head_dim_v(bwd, 128)["head_dim_v"] == 128


def _pair_backward(shape, d, dv, dtype, causal, deterministic, gen):
    q, k, v = _pair(shape, d, dv, dtype, gen)
    b, sq, hq = q.shape[:3]
    dout = _wide((b, sq, hq), dv, dtype, gen)
    out, lse = _wide((b, sq, hq), dv, dtype), torch.full((b, hq, sq), float("nan"), device="cuda")
    flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse)
    grads = [_wide(x.shape[:3], x.shape[3], dtype) for x in (q, k, v)]
    size = fa4_aot.backward_workspace_bytes(b, sq, hq, d, causal=causal, deterministic=deterministic, head_dim_v=dv)
    flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=deterministic, dq=grads[0], dk=grads[1],
                   dv=grads[2], workspace=torch.full((size,), 0xFF, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    return q, k, v, dout, out, grads


# and one past policy.first_write_dq's 4096 keys: the preprocess clears the accumulator
@pytest.mark.parametrize("variant", PAIR_BWD, ids=lambda v: v.name)
@pytest.mark.parametrize("shape", BWD_SHAPES + [(1, 130, 4300, 2, 1)], ids=lambda s: "b{}_q{}_k{}_h{}x{}".format(*s))
def test_backward_192_128_with_gqa(variant, shape, gen):
    """Every d192v128 backward (GQA and MQA shapes among them: dK and dV summed over a group
    of query heads; test_own_head_dim_v_rows says the calls take them); deterministic ones
    twice, bitwise."""
    dtype = DTYPES[variant.dtype]
    q, k, v, dout, out, grads = _pair_backward(shape, 192, 128, dtype, variant.causal, variant.deterministic, gen)
    check_grads(grads, q, k, v, dout, out, variant.causal)
    _untouched(*grads)
    if variant.deterministic:
        seeded = lambda: torch.Generator(device="cuda").manual_seed(11)  # noqa: E731
        once = _pair_backward(shape, 192, 128, dtype, variant.causal, True, seeded())[5]
        again = _pair_backward(shape, 192, 128, dtype, variant.causal, True, seeded())[5]
        assert all(torch.equal(a, b) for a, b in zip(once, again)), "deterministic runs differ"


@pytest.mark.parametrize("pair", PAIRS[1:], ids=PAIR_IDS[1:])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_other_pairs(pair, causal, gen):
    q, k, v, dout, out, grads = _pair_backward((2, 300, 257, 4, 2), *pair, torch.bfloat16, causal, False, gen)
    check_grads(grads, q, k, v, dout, out, causal)
    _untouched(*grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True], ids=["nondet", "det"])
def test_varlen_192_128(causal, dtype, deterministic, gen):
    """The d192v128 varlen kernels, forward and backward."""
    lq, lk, hq, hkv = MIXES[1]
    q, k, v = (_packed(lq, hq, 192, gen, dtype), _packed(lk, hkv, 192, gen, dtype),
               _packed(lk, hkv, 128, gen, dtype))
    dout, out = _packed(lq, hq, 128, gen, dtype), _packed(lq, hq, 128, dtype=dtype)
    cu_q, cu_k = _lengths_to_cu(lq), _lengths_to_cu(lk)
    lse = torch.full((hq, sum(lq)), float("nan"), device="cuda")
    flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, out=out, lse=lse)
    torch.cuda.synchronize()
    _check_sequences(out, lse, q, k, v, lq, lk, lq, lk, causal)
    size = fa4_aot.backward_varlen_workspace_bytes(sum(lq), len(lq), hq, 192, causal=causal,
                                                   deterministic=deterministic, head_dim_v=128)
    grads = [_packed(lq, hq, 192, dtype=dtype), _packed(lk, hkv, 192, dtype=dtype), _packed(lk, hkv, 128, dtype=dtype)]
    flash_attn_varlen_bwd(q, k, v, out, dout, lse, cu_q, cu_k, max(lq), max(lk), causal=causal,
                          deterministic=deterministic, dq=grads[0], dk=grads[1], dv=grads[2],
                          workspace=torch.full((size,), 0xFF, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    _check_grads_by_sequence(grads, q, k, v, out, dout, lq, lk, lq, lk, causal)
    _untouched(out, *grads)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"b{c[0]}_q{c[1]}_h{c[2]}x{c[3]}_k{c[4]}_p{c[5]}")
def test_decode_192_128(case, causal, gen):
    batch, sq, hq, hkv, max_cache, page = case
    q = _wide((batch, sq, hq), 192, torch.bfloat16, gen)
    k, v, table, k_full, v_full = _cache(batch, max_cache, hkv, 192, page, gen, d_v=128)
    lengths = torch.randint(1, max_cache + 1, (batch,), generator=gen, device="cuda", dtype=torch.int32)
    for splits in (None, 1, 3):
        out, lse = _decode(q, k, v, lengths, table, causal, splits)
        check_decode(out, lse, q, k_full, v_full, lengths, causal)


def test_torch_layers_with_v_of_its_own_head_dim(gen):
    """flash_attn_func's autograd (out and dv of v's head dim) and flash_attn_with_kvcache
    with an append, at 192/128."""
    from fa4_aot.torch import flash_attn_with_kvcache

    q, k = (torch.randn(2, 333, h, 192, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
            for h in (8, 2))
    v = torch.randn(2, 333, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 333, 8, 128)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_grads([x.grad for x in (q, k, v)], *(x.detach() for x in (q, k, v)), dout, out.detach(), True)
    kc = torch.randn(2, 300, 2, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new = torch.randn(2, 1, 2, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_new = torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    lengths = torch.tensor([10, 299], dtype=torch.int32, device="cuda")
    q1 = torch.randn(2, 1, 8, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = flash_attn_with_kvcache(q1, kc, vc, k_new, v_new, cache_seqlens=lengths, return_lse=True)
    assert out.shape == (2, 1, 8, 128)
    for b, n in enumerate((11, 300)):
        check_attention(out[b:b + 1], lse[b:b + 1], q1[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], False)


@pytest.mark.parametrize("causal", [False, True])
def test_192_128_as_views_of_one_projection(causal, gen):
    """q, k (192) and v (128) as column slices of one (b, s, h, 512) projection (rows of
    1024 bytes, v starting at byte 768), GQA-free as MLA's expanded heads are, on the
    d192v128 kernels through the autograd layer, against the reference; the same on
    contiguous copies: out, dk and dv bitwise (dq's fp32 adds may land in another order)."""
    proj = torch.randn(2, 333, 4, 512, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    q, k, v = proj[..., :192], proj[..., 192:384], proj[..., 384:]
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    grads = (proj.grad[..., :192], proj.grad[..., 192:384], proj.grad[..., 384:])
    check_grads(grads, *(x.detach() for x in (q, k, v)), dout, out.detach(), causal)
    copies = [x.detach().contiguous().requires_grad_(True) for x in (q, k, v)]
    again = flash_attn_func(*copies, causal=causal)
    again.backward(dout)
    assert torch.equal(again, out)
    assert all(torch.equal(c.grad, g) for c, g in zip(copies[1:], grads[1:]))


def test_mismatched_head_dims_are_refused_before_launch(gen):
    q, k = (torch.randn(1, 64, 2, 192, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    v = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    lse = torch.full((1, 2, 64), float("nan"), device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    like_q = torch.full_like(q, float("nan"))
    with pytest.raises(fa4_aot.ShapeError, match="v's head_dim"):  # out takes v's head dim, not q's
        fa4_aot.forward(q, k, v, like_q, lse, stream=stream)
    out = torch.full((1, 64, 2, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(fa4_aot.ShapeError, match="like k"):  # v's keys must be k's
        fa4_aot.forward(q, k, v[:, :32], out, lse, stream=stream)
    with pytest.raises(UnsupportedVariantError, match="head_dim 36"):
        fa4_aot.forward(q, k, v[..., :36], out[..., :36], lse, stream=stream)
    torch.cuda.synchronize()
    assert like_q.isnan().all() and out.isnan().all() and lse.isnan().all()
