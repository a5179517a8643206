"""Context parallelism's arithmetic on our kernels, on one GPU (issue 41, item 2): the
sequence split over 2 and 4 ranks (causal: load-balanced chunks), each rank's queries
against each rank's keys by flash_attn_fwd (the diagonal causal, the rest full, with
seqlen_q != seqlen_k), merged by LSE; the backward by flash_attn_bwd per block with the
merged out and LSE, dq, dk, dv summed (tests/ring.py). The merged out, LSE and gradients
against the float32 reference within the dense tolerances (check_attention, check_grads:
the ring adds one 16-bit rounding of each block's out and gradients, which the twice-
the-low-precision-error rule covers or this test says otherwise)."""

import pytest
import torch

from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd

from ..reference import check_attention
from ..ring import ring_backward, ring_forward
from .test_bwd import check_grads


def _attend(q, k, v, causal):
    return flash_attn_fwd(q, k, v, causal=causal)


def _grad(q, k, v, out, dout, lse, causal):
    return flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shards", [2, 4])
def test_the_ring_on_our_kernels_equals_the_whole_sequence(shards, causal, head_dim, gen):
    b, s, hq, hkv = 2, 8 * 100, 8, 2  # chunks of 100 (200 when not causal at 4 ranks): ragged tiles
    mk = lambda h: torch.randn(b, s, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    out, lse = ring_forward(q, k, v, shards, causal, _attend)
    torch.cuda.synchronize()
    check_attention(out, lse, q, k, v, causal, what=f"{shards} ranks: ")
    got = ring_backward(q, k, v, out, dout, lse, shards, causal, _grad)
    torch.cuda.synchronize()
    check_grads(got, q, k, v, dout, out, causal)
