"""flash_attn_varlen_func's eager repeat path (fa4_aot.torch.varlen._VarlenStep) without a
GPU: the keys a training step's launches are kept under name everything those launches
read, so a kept launch is repeated only for a call that would pack the same parameters.
The kernels' results on a GPU: tests/gpu/test_varlen.py (test_varlen_func_repeats_read_new_values).
"""

import pytest

torch = pytest.importorskip("torch")

from fa4_aot.torch import flash_attn_varlen_func  # noqa: E402
from fa4_aot.torch import varlen  # noqa: E402
from .step_library import RecordingLibrary, assert_keys_apart  # noqa: E402


@pytest.fixture(params=[False, True], ids=["plain order", "heaviest first"])
def fake_gpu(request, monkeypatch):
    """The step's forward and backward on CPU tensors taken as a GPU's: launches recorded;
    the forward's order with a workspace or without."""
    library = RecordingLibrary()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(varlen, "default_library", lambda: library)
    monkeypatch.setattr(varlen, "check_on_gpu", lambda named: None)
    monkeypatch.setattr(varlen, "current_stream", lambda index: 7)
    monkeypatch.setattr(varlen, "as_device_array", lambda t: t)
    monkeypatch.setattr(varlen, "_forward_order", lambda batch, lib: (request.param, 64))
    monkeypatch.setattr(varlen, "_backward_workspace_bytes", lambda *a: 256)
    monkeypatch.setattr(varlen, "run_forward_varlen",
                        lambda *a, aliases=(), workspace=None, **kw: library.launch(
                            "fwd", (*a[3:5], workspace), (key for key, _ in aliases)))
    monkeypatch.setattr(varlen, "run_backward_varlen",
                        lambda *a, aliases=(), **kw: library.launch("bwd", (*a[6:9], a[13]),
                                                                    (key for key, _ in aliases)))
    return library


def _keys(library, q, k, v, dout, cu_q, cu_k, max_q=64, max_k=64, **options):
    """The keys one forward and backward through flash_attn_varlen_func ask for (fresh leaves)."""
    before = len(library.asked)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, **options).backward(dout)
    asked = library.asked[before:]
    assert len(asked) == 2, asked  # one key a direction
    return asked


def _cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_a_kept_step_is_repeated_and_a_new_one_launched(fake_gpu):
    q, k, v, dout = (torch.randn(100, 4, 64, dtype=torch.bfloat16) for _ in range(4))
    cu = _cu(60, 40)
    fwd, bwd = _keys(fake_gpu, q, k, v, dout, cu, cu, causal=True)
    assert fake_gpu.launches == [("fwd", (fwd,)), ("bwd", (bwd,))]  # each kept under the key asked for
    fake_gpu.repeat = True
    _keys(fake_gpu, q, k, v, dout, cu, cu, causal=True)
    assert len(fake_gpu.launches) == 2  # repeated: nothing packed


def test_the_keys_name_every_layout_and_option(fake_gpu):
    """Calls that differ only in what the launches read (a stride at the same pointer, a
    dtype, a length bound, an option, the upstream gradient's layout) ask for keys of their own."""
    t, h, d = 100, 4, 64
    blocks = [torch.randn(t, 2 * h, d, dtype=torch.bfloat16) for _ in range(3)]
    packed = [x[:, :h] for x in blocks]  # strided views, as a fused projection gives them
    dense = [x.view(-1)[:t * h * d].view(t, h, d) for x in blocks]  # the same addresses
    wide = torch.randn(t, 2 * h, d, dtype=torch.bfloat16)
    dout = wide.view(-1)[:t * h * d].view(t, h, d)  # at the strided one's address
    cu_block = torch.zeros(10, dtype=torch.int32)
    cu_block[1:3], cu_block[3:5] = torch.tensor([60, 100]), torch.tensor([60, 100])
    cu = cu_block[:3]
    cu_strided = cu_block[::2][:3]  # cu's address, another stride (values 0, 100, 100)
    cu_more = cu_block[:4]  # cu's address, one sequence more
    cu_k = cu_block[2:5]  # the keys' own buffer
    calls = {
        "base": (dense, dout, (cu, cu), {"causal": True}),
        "q strided": ((packed[0], dense[1], dense[2]), dout, (cu, cu), {"causal": True}),
        "k strided": ((dense[0], packed[1], dense[2]), dout, (cu, cu), {"causal": True}),
        "v strided": ((dense[0], dense[1], packed[2]), dout, (cu, cu), {"causal": True}),
        "cu_seqlens_q strided": (dense, dout, (cu_strided, cu), {"causal": True}),
        "cu_seqlens_k strided": (dense, dout, (cu, cu_strided), {"causal": True}),
        "a sequence more": (dense, dout, (cu_more, cu_more), {"causal": True}),
        "cu_seqlens_k apart": (dense, dout, (cu, cu_k), {"causal": True}),
        "max_seqlen_q": (dense, dout, (cu, cu), {"causal": True, "max_q": 60}),
        "max_seqlen_k": (dense, dout, (cu, cu), {"causal": True, "max_k": 60}),
        "not causal": (dense, dout, (cu, cu), {}),
        "scale": (dense, dout, (cu, cu), {"causal": True, "softmax_scale": 0.1}),
        "deterministic": (dense, dout, (cu, cu), {"causal": True, "deterministic": True}),
        "window": (dense, dout, (cu, cu), {"window_size": (16, 0)}),
        "window, causal": (dense, dout, (cu, cu), {"causal": True, "window_size": (16, 0)}),
        "window to the right": (dense, dout, (cu, cu), {"window_size": (16, 4)}),
        "softcap": (dense, dout, (cu, cu), {"causal": True, "softcap": 30.0}),
        "fp16": ([x.half() for x in dense], dout.half(), (cu, cu), {"causal": True}),
        "k as fp16": ((dense[0], dense[1].view(torch.float16), dense[2]), dout, (cu, cu), {"causal": True}),
        "v as fp16": ((dense[0], dense[1], dense[2].view(torch.float16)), dout, (cu, cu), {"causal": True}),
        "dout strided": (dense, wide[:, :h], (cu, cu), {"causal": True}),  # dout's pointer, other strides
    }
    keys = {name: [fake_gpu.masked(key) for key in _keys(fake_gpu, *tensors, gradient, *lengths, **options)]
            for name, (tensors, gradient, lengths, options) in calls.items()}
    assert_keys_apart(keys, same_forward={"base", "dout strided"})  # the upstream gradient: the backward's alone


def test_the_keys_name_every_pointer(fake_gpu):
    """The same layouts at other addresses (another batch's activations, other length
    buffers) ask for new keys, each input's and the upstream gradient's alone."""
    q, k, v, dout = (torch.randn(50, 2, 64, dtype=torch.bfloat16) for _ in range(4))
    cu_q, cu_k = _cu(20, 30), _cu(20, 30)
    base = [fake_gpu.masked(key) for key in _keys(fake_gpu, q, k, v, dout, cu_q, cu_k)]
    for i in range(6):
        moved = [q, k, v, dout, cu_q, cu_k]
        moved[i] = moved[i].clone()
        fwd, bwd = (fake_gpu.masked(key) for key in _keys(fake_gpu, *moved))
        assert bwd != base[1]
        assert (fwd == base[0]) == (i == 3)  # dout is the backward's alone


def test_sinks_and_seqused_take_the_checked_path(fake_gpu, monkeypatch):
    """Calls the step does not make its own (sinks, seqused) go through the adapters'
    checked functions, not the step's keys."""
    checked = []
    monkeypatch.setattr(varlen, "flash_attn_varlen_fwd", lambda *a, **kw: checked.append("fwd") or (
        torch.zeros_like(a[0]), torch.zeros(a[0].shape[1], a[0].shape[0])))
    q, k, v = (torch.randn(50, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = _cu(20, 30)
    flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, learnable_sink=torch.zeros(2))
    flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, seqused_q=torch.tensor([20, 30], dtype=torch.int32))
    assert checked == ["fwd", "fwd"] and not fake_gpu.asked


def test_the_keys_name_what_the_step_makes(fake_gpu):
    """Each launch's key holds the address of every output, gradient and workspace the step
    made for it: a repeat writes where the step's new tensors are."""
    q, k, v, dout = (torch.randn(50, 2, 64, dtype=torch.bfloat16) for _ in range(4))
    cu = _cu(20, 30)
    fwd, bwd = _keys(fake_gpu, q, k, v, dout, cu, cu)
    made = {"fwd": fake_gpu.made[:-4], "bwd": fake_gpu.made[-4:]}  # the forward's 2 or 3, the backward's 4
    for kind, key in (("fwd", fwd), ("bwd", bwd)):
        assert made[kind] and all(t.data_ptr() in key for t in made[kind]), kind
