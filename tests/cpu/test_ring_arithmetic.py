"""The ring's arithmetic (tests/ring.py) with the float32 reference as its block functions:
sharded over 2 and 4 ranks, causal (load-balanced) or not, the merged forward and the
summed gradients equal the unsharded ones. What the GPU test (tests/gpu/test_ring.py) then
runs on our kernels."""

import pytest

torch = pytest.importorskip("torch")

from ..reference import attention_ref  # noqa: E402
from ..ring import blocks, reference_block_grad, ring_backward, ring_forward  # noqa: E402


def _attend(q, k, v, causal):
    return attention_ref(q, k, v, causal, upcast=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shards", [2, 4])
def test_the_ring_equals_the_whole_sequence(shards, causal):
    gen = torch.Generator().manual_seed(shards * 2 + causal)
    b, s, hq, hkv, d = 2, 8 * 24, 4, 2, 16
    q, dout = (torch.randn(b, s, hq, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d, generator=gen) for _ in range(2))
    out, lse = ring_forward(q, k, v, shards, causal, _attend)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(qr, kr, vr, causal, upcast=True)
    torch.testing.assert_close(out, ref.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=2e-5, rtol=1e-5)
    ref.backward(dout)
    got = ring_backward(q, k, v, out, dout, lse, shards, causal, reference_block_grad)
    for g, r in zip(got, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(g, r, atol=5e-5, rtol=1e-4)


def test_load_balanced_blocks_cover_the_causal_square_once():
    """Every (query, key) pair the causal mask keeps is in exactly one block, no other pair
    is computed unmasked."""
    s, shards = 64, 4
    seen = torch.zeros(s, s, dtype=torch.int64)
    for rows, cols, causal in blocks(shards, True, s):
        keep = torch.ones(len(rows), len(cols), dtype=torch.bool)
        if causal:
            keep = torch.arange(len(cols))[None, :] <= torch.arange(len(rows))[:, None] + len(cols) - len(rows)
        pairs = keep & (cols[None, :] <= rows[:, None])
        assert torch.equal(pairs, keep), "a block computes a pair the causal mask drops"
        seen[rows[:, None], cols[None, :]] += pairs.long()
    assert torch.equal(seen, torch.tril(torch.ones(s, s, dtype=torch.int64)))
