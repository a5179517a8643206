"""The public signatures, pinned: names, kinds and defaults.

Tensors are positional, every option keyword-only (a positional option is a TypeError,
not a silently misread argument); the backward takes q, k, v, out, dout, lse in that
order in every layer (FA4's _flash_attn_bwd order); the torch functions take FA4's /
flash-attn's option names.
"""

import inspect

import pytest

import fa4_aot

P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
EMPTY = inspect.Parameter.empty


def spec(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def positional(*names):
    return [(n, P, EMPTY) for n in names]


def options(**defaults):
    return [(n, K, d) for n, d in defaults.items()]


RAW = {
    "forward": positional("q", "k", "v", "out", "lse")
    + options(softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, learnable_sink=None,
              workspace=None, q_tiles=None, stream=0, library=None),
    "forward_workspace_bytes": positional("batch", "seqlen_q", "heads_q", "heads_kv", "head_dim", "seqlen_k")
    + options(causal=False, window_size=(-1, -1), softcap=0.0, learnable_sink=False, dtype="bf16", sm_count=None,
              head_dim_v=None, library=None),
    "backward": positional("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv", "workspace")
    + options(softmax_scale=None, causal=False, deterministic=False, window_size=(-1, -1), softcap=0.0,
              learnable_sink=None, dsink=None, q_tiles=None, stream=0, library=None),
    "backward_workspace_bytes": positional("batch", "seqlen_q", "heads_q", "head_dim")
    + options(causal=False, deterministic=False, seqlen_k=None, heads_kv=None, dtype=None, local=False,
              head_dim_v=None, library=None),
}

TORCH = {
    "flash_attn_func": positional("q", "k", "v")
    + options(softmax_scale=None, causal=False, deterministic=False, return_lse=False, window_size=(-1, -1),
              softcap=0.0, learnable_sink=None),
    "flash_attn_fwd": positional("q", "k", "v")
    + options(softmax_scale=None, causal=False, out=None, lse=None, q_tiles=None, window_size=(-1, -1), softcap=0.0,
              learnable_sink=None),
    "flash_attn_bwd": positional("q", "k", "v", "out", "dout", "lse")
    + options(softmax_scale=None, causal=False, deterministic=False, dq=None, dk=None, dv=None, workspace=None,
              q_tiles=None, window_size=(-1, -1), softcap=0.0, learnable_sink=None, dsink=None),
}


@pytest.mark.parametrize("name", sorted(RAW))
def test_raw_signatures(name):
    assert spec(getattr(fa4_aot, name)) == RAW[name]


@pytest.mark.parametrize("name", sorted(TORCH))
def test_torch_signatures(name):
    adapter = pytest.importorskip("fa4_aot.torch")
    assert spec(getattr(adapter, name)) == TORCH[name]


def test_the_backward_order_is_the_same_in_every_layer():
    adapter = pytest.importorskip("fa4_aot.torch")
    raw = [n for n, kind, _ in spec(fa4_aot.backward) if kind == P]
    torch_side = [n for n, kind, _ in spec(adapter.flash_attn_bwd) if kind == P]
    assert raw[:6] == torch_side == ["q", "k", "v", "out", "dout", "lse"]


def test_a_positional_option_is_a_type_error():
    adapter = pytest.importorskip("fa4_aot.torch")
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="positional"):
        adapter.flash_attn_func(q, q, q, True)
    with pytest.raises(TypeError, match="positional"):
        adapter.flash_attn_fwd(q, q, q, True)
    with pytest.raises(TypeError, match="positional"):
        adapter.flash_attn_bwd(q, q, q, q, q, q, True)
    with pytest.raises(TypeError, match="positional"):
        fa4_aot.forward(q, q, q, q, q, True)
