"""flash_attn_func's eager repeat path (fa4_aot.torch.autograd._Step) without a GPU: the keys
a training step's launches are kept under name everything those launches read, so a kept
launch is repeated only for a call that would pack the same parameters. The kernels'
results on a GPU: tests/gpu/test_bwd.py (test_torch_entry_point_repeats_read_new_values).
"""

import pytest

torch = pytest.importorskip("torch")

from fa4_aot.torch import autograd  # noqa: E402
from fa4_aot.torch import flash_attn_func  # noqa: E402
from .step_library import RecordingLibrary, assert_keys_apart  # noqa: E402


@pytest.fixture
def fake_gpu(monkeypatch):
    """The step's forward and backward on CPU tensors taken as a GPU's: launches recorded."""
    library = RecordingLibrary()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(autograd._Step, "workspaces", {})
    monkeypatch.setattr(autograd, "default_library", lambda: library)
    monkeypatch.setattr(autograd, "current_stream", lambda index: 7)
    monkeypatch.setattr(autograd, "forward_workspace_size", lambda *a, **kw: 0)
    monkeypatch.setattr(autograd, "backward_workspace_size", lambda *a, **kw: 256)
    monkeypatch.setattr(autograd, "launch_forward", lambda *a, keep=(), **kw: library.launch("fwd", a[3:6], keep))
    monkeypatch.setattr(autograd, "launch_backward", lambda *a, keep=(), **kw: library.launch("bwd", a[6:10], keep))
    return library


def _keys(library, q, k, v, dout, **options):
    """The keys one forward and backward through flash_attn_func ask for (fresh leaves)."""
    before = len(library.asked)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    flash_attn_func(*leaves, **options).backward(dout)
    asked = library.asked[before:]
    assert len(asked) == 2, asked  # one key a direction
    return asked


def test_a_kept_step_is_repeated_and_a_new_one_launched(fake_gpu):
    q, k, v, dout = (torch.randn(2, 64, 4, 64, dtype=torch.bfloat16) for _ in range(4))
    fwd, bwd = _keys(fake_gpu, q, k, v, dout, causal=True)
    assert fake_gpu.launches == [("fwd", (fwd,)), ("bwd", (bwd,))]  # each kept under the key asked for
    fake_gpu.repeat = True
    _keys(fake_gpu, q, k, v, dout, causal=True)
    assert len(fake_gpu.launches) == 2  # repeated: nothing packed


def test_the_keys_name_every_layout_and_option(fake_gpu):
    """Calls that differ only in what the launches read (a stride at the same pointer, a
    dtype, an option, the upstream gradient's layout) ask for keys of their own."""
    b, s, h, d = 2, 64, 4, 64
    blocks = [torch.randn(b, s, 2 * h, d, dtype=torch.bfloat16) for _ in range(3)]
    packed = [x[:, :, :h] for x in blocks]  # strided views, as a fused projection gives them
    dense = [x.view(-1)[:b * s * h * d].view(b, s, h, d) for x in blocks]  # the same addresses
    wide = torch.randn(b, s, 2 * h, d, dtype=torch.bfloat16)
    dout = wide.view(-1)[:b * s * h * d].view(b, s, h, d)  # at the strided one's address
    calls = {
        "base": (dense, dout, {"causal": True}),
        "q strided": ((packed[0], dense[1], dense[2]), dout, {"causal": True}),
        "k strided": ((dense[0], packed[1], dense[2]), dout, {"causal": True}),
        "v strided": ((dense[0], dense[1], packed[2]), dout, {"causal": True}),
        "not causal": (dense, dout, {}),
        "scale": (dense, dout, {"causal": True, "softmax_scale": 0.1}),
        "deterministic": (dense, dout, {"causal": True, "deterministic": True}),
        "window": (dense, dout, {"window_size": (16, 0)}),
        "window, causal": (dense, dout, {"causal": True, "window_size": (16, 0)}),  # the base's but left
        "window to the right": (dense, dout, {"window_size": (16, 4)}),  # the window's but right
        "softcap": (dense, dout, {"causal": True, "softcap": 30.0}),
        "fp16": ([t.half() for t in dense], dout.half(), {"causal": True}),
        "k as fp16": ((dense[0], dense[1].view(torch.float16), dense[2]), dout, {"causal": True}),  # refused, never kept
        "v as fp16": ((dense[0], dense[1], dense[2].view(torch.float16)), dout, {"causal": True}),
        "dout strided": (dense, wide[:, :, :h], {"causal": True}),  # dout's pointer, other strides
    }
    keys = {name: [fake_gpu.masked(key) for key in _keys(fake_gpu, *tensors, gradient, **options)]
            for name, (tensors, gradient, options) in calls.items()}
    assert_keys_apart(keys, same_forward={"base", "dout strided"})  # the upstream gradient: the backward's alone


def test_the_keys_name_every_pointer(fake_gpu):
    """The same layouts at other addresses (another batch's activations) ask for new keys,
    each input's and the upstream gradient's alone."""
    q, k, v, dout = (torch.randn(1, 32, 2, 64, dtype=torch.bfloat16) for _ in range(4))
    base = [fake_gpu.masked(key) for key in _keys(fake_gpu, q, k, v, dout)]
    for i in range(4):
        moved = [q, k, v, dout]
        moved[i] = moved[i].clone()
        fwd, bwd = (fake_gpu.masked(key) for key in _keys(fake_gpu, *moved))
        assert bwd != base[1]
        assert (fwd == base[0]) == (i == 3)  # dout is the backward's alone


def test_a_direct_call_keys_causal_apart_from_its_window(fake_gpu):
    """FlashAttention.apply (exported) takes causal beside the window as given: causal with
    no window and neither ask for keys of their own (the checked path makes right 0 of the
    one, -1 of the other)."""
    q, k, v, dout = (torch.randn(1, 32, 2, 64, dtype=torch.bfloat16) for _ in range(4))
    keys = []
    for causal in (True, False):
        before = len(fake_gpu.asked)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        autograd.FlashAttention.apply(*leaves, causal, 0.125, False, -1, -1, 0.0, None)[0].backward(dout)
        keys.append([fake_gpu.masked(key) for key in fake_gpu.asked[before:]])
    assert keys[0][0] != keys[1][0] and keys[0][1] != keys[1][1]
