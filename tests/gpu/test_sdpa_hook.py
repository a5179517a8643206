"""torch's SDPA with the "fa4_aot" flash-attention implementation active, on an sm_90 GPU.

SDPA's flash backend is forced (sdpa_kernel(FLASH_ATTENTION)) so that the calls reach the
overridden ops; results must pass the project's rule against the float32 reference
(check_out, check_grads: twice the error of the same math in low precision), and each
test counts which path ran: fa4_aot's kernels or torch's own.
"""

import contextlib

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.nn.attention, "register_flash_attention_impl"):
    pytest.skip("this torch has no flash-attention implementation registry", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from fa4_aot.torch import sdpa as torch_sdpa  # noqa: E402

from .test_bwd import check_grads  # noqa: E402
from .test_fwd import check_out  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
    (2, 128, 128, 4, 4),  # square: SDPA's is_causal reaches the flash op
    (2, 200, 513, 4, 2),  # seqlen_q < seqlen_k, GQA (enable_gqa)
    (1, 700, 128, 2, 1),  # seqlen_q > seqlen_k, MQA: causal rows that see no key
]


@pytest.fixture
def counted(monkeypatch):
    """Calls that fa4_aot's kernels take (the hook's plan: a first launch or a repeat of a
    kept one), by kind, and calls of the fallback."""
    counts = {"fwd": 0, "bwd": 0, "fallback": 0}
    plan, call = torch_sdpa._plan, torch_sdpa._call

    def planned(signature, *args):
        taken = plan(signature, *args)
        counts[signature[0]] += taken.reason is None
        return taken

    def fallback(*args, **kwargs):
        counts["fallback"] += 1
        return call(*args, **kwargs)

    monkeypatch.setattr(torch_sdpa, "_plan", planned)
    monkeypatch.setattr(torch_sdpa, "_call", fallback)
    return counts


@pytest.fixture
def hooked():
    torch.nn.attention.activate_flash_attention_impl("fa4_aot")
    yield
    torch.nn.attention.restore_flash_attention_impl()


def _inputs(shape, head_dim, dtype, gen):
    """q (b, h_q, s_q, d), k, v (b, h_kv, s_k, d), leaves, and dout like q: SDPA's layout,
    made as (b, s, h, d) and transposed (the usual model layout)."""
    b, sq, sk, hq, hkv = shape
    make = lambda s, h: torch.randn(b, s, h, head_dim, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, dout = make(sq, hq), make(sk, hkv), make(sk, hkv), make(sq, hq)
    return [t.transpose(1, 2).requires_grad_(True) for t in (q, k, v)], dout.transpose(1, 2)


def _sdpa(q, k, v, causal, scale=None, flash_only=True, dropout_p=0.0):
    """SDPA as a model calls it; causal with seqlen_q != seqlen_k through the lower-right
    bias (SDPA's is_causal is top-left and does not take the flash path there)."""
    s_q, s_k = q.shape[2], k.shape[2]
    kwargs = dict(scale=scale, enable_gqa=q.shape[1] != k.shape[1], dropout_p=dropout_p)
    if causal and s_q != s_k:
        kwargs["attn_mask"] = causal_lower_right(s_q, s_k)
    else:
        kwargs["is_causal"] = causal
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash_only else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _grads(q, k, v, causal, dout, scale=None, flash_only=True, dropout_p=0.0):
    for t in (q, k, v):
        t.grad = None
    out = _sdpa(q, k, v, causal, scale, flash_only, dropout_p)
    out.backward(dout)
    return out.detach(), [t.grad for t in (q, k, v)]


def _bshd(*ts):
    return [t.detach().transpose(1, 2) for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])  # 80: on the 96 kernels
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}x{}".format(*s))
def test_sdpa_runs_on_fa4_aot(dtype, head_dim, causal, shape, gen, hooked, counted):
    (q, k, v), dout = _inputs(shape, head_dim, DTYPES[dtype], gen)
    out, grads = _grads(q, k, v, causal, dout)
    torch.cuda.synchronize()
    assert counted == {"fwd": 1, "bwd": 1, "fallback": 0}
    assert out.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    bq, bk, bv, bout, bdout = _bshd(q, k, v, out, dout)
    check_out(bout, bq, bk, bv, causal)
    check_grads(_bshd(*grads), bq, bk, bv, bdout, bout, causal)


def test_a_given_scale_and_a_strided_grad(gen, hooked, counted):
    """scale reaches both kernels; sum().backward() hands SDPA an expanded grad_out."""
    (q, k, v), _ = _inputs((2, 300, 300, 4, 4), 128, torch.bfloat16, gen)
    out = _sdpa(q, k, v, True, scale=0.3)
    out.float().sum().backward()
    assert counted == {"fwd": 1, "bwd": 1, "fallback": 0}
    bq, bk, bv, bout = _bshd(q, k, v, out)
    check_out(bout, bq, bk, bv, True, scale=0.3)
    check_grads(_bshd(q.grad, k.grad, v.grad), bq, bk, bv, torch.ones_like(bout), bout, True, scale=0.3)


@pytest.mark.parametrize("offset", [0, 4], ids=["views", "copied"])
def test_repeated_calls_read_their_inputs_anew(offset, gen, hooked, counted):
    """The hook keeps a call's launches under its signature and pointers and repeats them
    (views of aligned tensors), or copies misaligned inputs and launches anew (``offset``: q,
    k, v 8 bytes past their blocks): either way, the same tensors refilled in place give
    the new values' attention and gradients, forward and backward, call after call."""
    b, s, h, d = 2, 300, 4, 64

    def make():
        flat = torch.empty(b * s * h * d + offset, device="cuda", dtype=torch.bfloat16)
        return flat[offset:].view(b, s, h, d).transpose(1, 2)

    q, k, v, dout = make(), make(), make(), make()
    for call in range(3):
        for t in (q, k, v, dout):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=gen))
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, grads = _grads(*leaves, True, dout)
        bq, bk, bv, bout, bdout = _bshd(q, k, v, out, dout)
        check_out(bout, bq, bk, bv, True)
        check_grads(_bshd(*grads), bq, bk, bv, bdout, bout, True)
    assert counted == {"fwd": 3, "bwd": 3, "fallback": 0}


@pytest.mark.parametrize("dtype, head_dim, flash_only, dropout_p", [
    (torch.float16, 80, True, 0.1),  # dropout: FA2 takes it, fa4_aot has none
    (torch.float32, 64, False, 0.0),  # SDPA sends fp32 elsewhere: the ops never see it
])
def test_unsupported_cases_match_sdpa_without_the_hook(dtype, head_dim, flash_only, dropout_p, gen, counted):
    (q, k, v), dout = _inputs((2, 200, 300, 4, 4), head_dim, dtype, gen)
    torch.manual_seed(0)  # the same dropout masks both times
    own_out, own_grads = _grads(q, k, v, False, dout, flash_only=flash_only, dropout_p=dropout_p)
    torch.nn.attention.activate_flash_attention_impl("fa4_aot")
    try:
        torch.manual_seed(0)
        out, grads = _grads(q, k, v, False, dout, flash_only=flash_only, dropout_p=dropout_p)
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert counted["fwd"] == counted["bwd"] == 0
    assert counted["fallback"] == (2 if flash_only else 0)
    assert torch.equal(out, own_out)  # the same kernel: a forward is deterministic
    for g, own in zip(grads, own_grads):
        torch.testing.assert_close(g, own, atol=2e-3, rtol=2e-3)  # dq summed by atomics
    if dtype != torch.float32 and not dropout_p:
        bq, bk, bv, bout, bdout = _bshd(q, k, v, out, dout)
        check_grads(_bshd(*grads), bq, bk, bv, bdout, bout, False)


def test_restore_returns_sdpa_to_its_own_kernels(gen, counted):
    (q, k, v), dout = _inputs((2, 256, 256, 4, 4), 128, torch.bfloat16, gen)
    own_out, _ = _grads(q, k, v, True, dout)
    torch.nn.attention.activate_flash_attention_impl("fa4_aot")
    _grads(q, k, v, True, dout)
    torch.nn.attention.restore_flash_attention_impl()
    assert torch.nn.attention.current_flash_attention_impl() is None
    out, _ = _grads(q, k, v, True, dout)
    assert counted == {"fwd": 1, "bwd": 1, "fallback": 0}  # the hooked call only
    assert torch.equal(out, own_out)
