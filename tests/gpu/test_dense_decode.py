"""Decode shapes through the dense entry points (policy.dense_decode): fa4_aot.forward,
flash_attn_fwd, flash_attn_func (with its backward) and the SDPA hook take the decode
kernel on the whole k and v, and give what the decode kernel gives (bitwise: the same
kernel and splits) and what the float32 reference says; other shapes, and a call that
names q_tiles, keep the prefill kernel. The kvcache path without cache_seqlens reads every
sequence's whole cache. Outputs poisoned with NaN before each launch."""

import pytest
import torch

import fa4_aot
import fa4_aot.dense as dense_api
from fa4_aot.torch import flash_attn_fwd, flash_attn_func, flash_attn_with_kvcache

from ..reference import check_attention
from .test_fwd import _poisoned

# (batch, seqlen_q, heads_q, heads_kv, head_dim, seqlen_k): decode shapes the policy routes
DECODE_SHAPES = [
    (2, 1, 32, 8, 128, 5000),  # one token, GQA 4, keys not a multiple of the tile: split
    (3, 4, 16, 2, 64, 2100),  # four tokens, GQA 8
    (1, 16, 4, 4, 256, 4500),  # MHA, 16 tokens, d256: a GPU the prefill kernel leaves idle
    (2, 2, 8, 1, 96, 4096),  # MQA
]


def _inputs(b, sq, hq, hkv, d, sk, gen, dtype=torch.bfloat16):
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


@pytest.fixture
def decode_calls(monkeypatch):
    """The decode launches the dense forward makes, recorded."""
    calls = []
    real = dense_api.prepare_checked

    def spy(arrays, *args, **kwargs):
        calls.append(arrays["q"].shape)
        return real(arrays, *args, **kwargs)

    monkeypatch.setattr(dense_api, "prepare_checked", spy)
    return calls


def _sm_count():
    return fa4_aot.default_library().sm_count(torch.cuda.current_device())


def _workspace(b, sq, hq, hkv, d, sk, **mods):
    need = fa4_aot.forward_workspace_bytes(b, sq, hq, hkv, d, sk, sm_count=_sm_count(), **mods)
    return torch.full((max(need, 1),), 255, dtype=torch.uint8, device="cuda") if need else None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "b{}_q{}_h{}x{}_d{}_k{}".format(*s))
def test_forward_takes_the_decode_kernel(shape, causal, gen, decode_calls):
    b, sq, hq, hkv, d, sk = shape
    q, k, v = _inputs(*shape, gen)
    stream = torch.cuda.current_stream().cuda_stream
    space = _workspace(*shape, causal=causal)
    out, lse = _poisoned(q)
    fa4_aot.forward(q, k, v, out, lse, causal=causal, workspace=space, stream=stream)
    torch.cuda.synchronize()
    assert decode_calls == [(b, sq, hq, d)], "the decode shape did not take the decode kernel"
    check_attention(out, lse, q, k, v, causal)
    # the same kernel with the same splits as the kvcache path on the whole cache: the same bits
    ref_out, ref_lse = _poisoned(q)
    fa4_aot.forward_kvcache(q, k, v, ref_out, ref_lse, None, space, causal=causal, stream=stream)
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    # and bitwise repeatable
    again, again_lse = _poisoned(q)
    fa4_aot.forward(q, k, v, again, again_lse, causal=causal, workspace=space, stream=stream)
    torch.cuda.synchronize()
    assert torch.equal(out, again) and torch.equal(lse, again_lse)


def test_without_a_workspace_a_split_shape_keeps_the_prefill_kernel(gen, decode_calls):
    shape = DECODE_SHAPES[0]
    assert fa4_aot.forward_workspace_bytes(*shape, sm_count=_sm_count()) > 0  # a split decode shape
    q, k, v = _inputs(*shape, gen)
    out, lse = _poisoned(q)
    fa4_aot.forward(q, k, v, out, lse, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert decode_calls == []
    check_attention(out, lse, q, k, v, False)


def test_q_tiles_and_prefill_shapes_keep_the_prefill_kernel(gen, decode_calls):
    stream = torch.cuda.current_stream().cuda_stream
    for shape, q_tiles in (((2, 1, 32, 8, 128, 5000), 1), ((1, 256, 8, 8, 128, 4096), None),
                           ((2, 4, 8, 8, 128, 256), None)):
        q, k, v = _inputs(*shape, gen)
        out, lse = _poisoned(q)
        fa4_aot.forward(q, k, v, out, lse, q_tiles=q_tiles, workspace=_workspace(*shape), stream=stream)
        torch.cuda.synchronize()
        check_attention(out, lse, q, k, v, False)
    assert decode_calls == []


def test_too_small_a_workspace_is_refused_before_any_write(gen):
    shape = DECODE_SHAPES[0]
    q, k, v = _inputs(*shape, gen)
    out, lse = _poisoned(q)
    need = fa4_aot.forward_workspace_bytes(*shape, sm_count=_sm_count())
    space = torch.zeros(need // 2, dtype=torch.uint8, device="cuda")
    with pytest.raises(fa4_aot.Fa4AotError):
        fa4_aot.forward(q, k, v, out, lse, workspace=space, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert out.isnan().all() and lse.isnan().all() and (space == 0).all()


def test_local_mods_take_the_local_decode_kernel(gen, decode_calls):
    """A window with sinks, and a softcap: the local decode kernel, as the reference says
    (9 x 16 query heads: the prefill kernel's CTAs fill the GPU, and the windows' few keys
    still take decode, policy.dense_decode)."""
    b, sq, hq, hkv, d, sk = 9, 3, 16, 2, 64, 3000
    q, k, v = _inputs(b, sq, hq, hkv, d, sk, gen)
    sink = torch.randn(hq, device="cuda", generator=gen)
    for window, cap, sinks in (((128, 0), 0.0, sink), ((700, 5), 20.0, None)):
        out, lse = flash_attn_fwd(q, k, v, window_size=window, softcap=cap, learnable_sink=sinks)
        torch.cuda.synchronize()
        check_attention(out, lse, q, k, v, False, window=window, softcap=cap, sink=sinks)
    assert len(decode_calls) == 2


def test_torch_layers_route_and_the_backward_follows(gen, decode_calls):
    """flash_attn_fwd (allocating the workspace), flash_attn_func forward and backward (the
    dense backward on the decode kernel's out and lse) and the SDPA hook: each the decode
    kernel's bits, gradients against the reference's autograd."""
    shape = (2, 2, 16, 4, 128, 3000)
    q, k, v = _inputs(*shape, gen)
    out, lse = flash_attn_fwd(q, k, v, causal=True)
    ref_out, ref_lse = _poisoned(q)
    fa4_aot.forward_kvcache(q, k, v, ref_out, ref_lse, None, _workspace(*shape, causal=True), causal=True,
                            stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(flash_attn_with_kvcache(q, k, v, causal=True), out)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    got = flash_attn_func(qg, kg, vg, causal=True)
    assert torch.equal(got, out)
    dout = torch.randn_like(got)
    got.backward(dout)
    from ..reference import attention_ref

    qr, kr, vr = (t.float().clone().requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(qr, kr, vr, True, upcast=True)
    ref.backward(dout.float())
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    low, _ = attention_ref(ql, kl, vl, True, upcast=False)
    low.backward(dout)
    for name, g, r, lo in (("dq", qg.grad, qr.grad, ql.grad), ("dk", kg.grad, kr.grad, kl.grad),
                           ("dv", vg.grad, vr.grad, vl.grad)):
        err = (g.float() - r).abs().max().item()
        tol = 2 * (lo.float() - r).abs().max().item() + 1e-5
        assert err <= tol, f"{name} max error {err:.3e} > {tol:.3e}"

    assert len(decode_calls) == 2  # flash_attn_fwd's and flash_attn_func's

    import fa4_aot.torch_sdpa as hook
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain, _ = flash_attn_fwd(q, k, v)
    hook.activate()
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            via_sdpa = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    finally:
        hook.restore()
    torch.cuda.synchronize()
    assert torch.equal(via_sdpa.transpose(1, 2), plain)
    assert len(decode_calls) == 4


@pytest.mark.parametrize("page", [None, 64])
def test_kvcache_without_lengths_reads_the_whole_cache(page, gen):
    """cache_seqlens None: each sequence's whole cache (max_cache, or the page table's
    reach), bitwise what the same lengths given on the device give."""
    b, sq, hq, hkv, d, keys = 3, 2, 16, 4, 128, 1024
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    if page is None:
        kc = torch.randn(b, keys, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn_like(kc)
        table, k_full, v_full = None, kc, vc
    else:
        pages = b * keys // page
        kc = torch.randn(pages + 2, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn_like(kc)
        table = torch.randperm(pages + 2, generator=gen, device="cuda")[:pages].view(b, -1).to(torch.int32)
        k_full, v_full = (c[table.long()].reshape(b, keys, hkv, d) for c in (kc, vc))
    stream = torch.cuda.current_stream().cuda_stream
    need = fa4_aot.forward_kvcache_workspace_bytes(b, sq, hq, hkv, d, keys, num_splits=3)
    space = torch.empty(need, dtype=torch.uint8, device="cuda")
    results = []
    for lengths in (None, torch.full((b,), keys, dtype=torch.int32, device="cuda")):
        out, lse = _poisoned(q)
        fa4_aot.forward_kvcache(q, kc, vc, out, lse, lengths, space, page_table=table, causal=True, num_splits=3,
                                stream=stream)
        torch.cuda.synchronize()
        results.append((out, lse))
    check_attention(*results[0], q, k_full, v_full, True)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
