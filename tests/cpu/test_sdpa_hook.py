"""fa4_aot.torch.sdpa without a GPU: registration, activation, the fallback path and the
decision between fa4_aot and torch's kernel. The kernels' results: tests/gpu/test_sdpa_hook.py.
"""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
attention = torch.nn.attention
if not hasattr(attention, "register_flash_attention_impl"):
    pytest.skip("this torch has no flash-attention implementation registry", allow_module_level=True)

from fa4_aot.errors import FrameworkError  # noqa: E402
from fa4_aot.torch import sdpa as torch_sdpa  # noqa: E402
from fa4_aot.torch.sdpa import OPS, built_keys, fallback_reason  # noqa: E402
from fa4_aot.variants import DTYPES, HEAD_DIMS, MATRIX  # noqa: E402

BUILT = built_keys(MATRIX)
H200 = (9, 0)
FLASH_OP = "aten::_scaled_dot_product_flash_attention"


def _table_line(op: str, key: str) -> list[str]:
    return [line for line in torch._C._dispatch_dump_table(op).splitlines() if line.startswith(f"{key}:")]


@pytest.fixture
def restored():
    """Whatever a test activates is given back."""
    yield
    attention.restore_flash_attention_impl(_raise_warn=False)


def test_import_registers_and_activates_nothing():
    code = (
        "import torch, torch.nn.attention as A\n"
        f"before = (A.current_flash_attention_impl(), torch._C._dispatch_dump_table('{FLASH_OP}'))\n"
        "import fa4_aot.torch.sdpa\n"
        f"after = (A.current_flash_attention_impl(), torch._C._dispatch_dump_table('{FLASH_OP}'))\n"
        "assert 'fa4_aot' in A.list_flash_attention_impls(), A.list_flash_attention_impls()\n"
        "assert before == after, (before, after)\n"
        "assert after[0] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_activate_and_restore_round_trip(restored):
    before = {op: _table_line(f"aten::{op}", "CUDA") for op in OPS}
    attention.activate_flash_attention_impl("fa4_aot")
    assert attention.current_flash_attention_impl() == "fa4_aot"
    for op in OPS:
        assert "torch/sdpa.py" in _table_line(f"aten::{op}", "CUDA")[0]
    attention.activate_flash_attention_impl("fa4_aot")  # again: the registry restores first
    assert attention.current_flash_attention_impl() == "fa4_aot"
    attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None
    assert {op: _table_line(f"aten::{op}", "CUDA") for op in OPS} == before


def test_module_activate_and_restore(restored):
    torch_sdpa.activate()
    assert attention.current_flash_attention_impl() == "fa4_aot"
    torch_sdpa.restore()
    assert attention.current_flash_attention_impl() is None


def test_unsupported_calls_reach_the_previous_kernel(monkeypatch):
    """On the Meta key (where the ops have torch's kernels on a CPU build too): a call
    fa4_aot does not take goes to the kernel registered before, positional, keyword-only
    and defaulted arguments intact; remove() gives the ops back."""
    q = torch.empty(2, 4, 8, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    expected = torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, 0.0, True, scale=0.5)
    before = _table_line(FLASH_OP, "Meta")
    calls = []
    call = torch_sdpa._call
    monkeypatch.setattr(torch_sdpa, "_call", lambda *a, **kw: calls.append(a[2:]) or call(*a, **kw))
    handle = torch_sdpa.register_kernels("Meta")
    try:
        assert "torch/sdpa.py" in _table_line(FLASH_OP, "Meta")[0]
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, 0.0, True, scale=0.5)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            q, q, k, k, out[0], out[1], out[2], out[3], out[4], out[5], 0.0, True, out[6], out[7], scale=0.5)
    finally:
        handle.remove()
    assert len(calls) == 2
    assert [getattr(t, "shape", t) for t in out] == [getattr(t, "shape", t) for t in expected]
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert _table_line(FLASH_OP, "Meta") == before
    handle.remove()  # twice: harmless


def test_no_previous_kernel_raises_a_framework_error():
    """A CPU build has no CUDA kernel to fall back to; on the CPU key, neither."""
    handle = torch_sdpa.register_kernels("CPU")
    try:
        q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
        with pytest.raises(FrameworkError, match="fall back"):
            torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)
    finally:
        handle.remove()


def test_activation_without_get_kernel_raises(monkeypatch, restored):
    monkeypatch.delattr(torch.library, "get_kernel")
    with pytest.raises(FrameworkError, match="get_kernel"):
        attention.activate_flash_attention_impl("fa4_aot")
    assert attention.current_flash_attention_impl() is None


def test_a_torch_without_the_registry_imports_and_refuses_activation():
    code = (
        "import torch.nn.attention as A\n"
        "del A.register_flash_attention_impl\n"
        "import fa4_aot.torch.sdpa as S\n"
        "from fa4_aot.errors import FrameworkError\n"
        "try:\n"
        "    S.activate()\n"
        "except FrameworkError as e:\n"
        "    assert 'registry' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('activate() did not raise')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- the decision
def _reason(dtype="bf16", q=(2, 8, 100, 128), k=(2, 2, 300, 128), v=None, dropout_p=0.0, causal=False,
            capability=H200, built=BUILT, **kw):
    return fallback_reason(dtype, q, k, k if v is None else v, dropout_p=dropout_p, causal=causal,
                           capability=capability, built=built, **kw)


# the head dims with a backward: the hook takes a call only where both backwards are built
WITH_BACKWARD = tuple(d for d in HEAD_DIMS if d <= 256)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", WITH_BACKWARD)
@pytest.mark.parametrize("causal", [False, True])
def test_built_cases_run_on_fa4_aot(dtype, head_dim, causal):
    assert _reason(dtype, (2, 8, 100, head_dim), (2, 2, 300, head_dim), causal=causal) is None


@pytest.mark.parametrize("case, match", [
    (dict(dtype=None), "dtype"),  # fp32, or q, k, v of mixed dtypes
    (dict(dropout_p=0.1), "dropout"),
    (dict(return_debug_mask=True), "debug"),
    (dict(capability=None), "CUDA device"),  # CPU, meta, or tensors on two devices
    (dict(capability=(8, 0)), "no fa4_aot kernels"),  # A100: no sm80 cubins
    (dict(capability=(10, 0)), "no fa4_aot kernels"),  # B200: sm100a is declared, not built
    (dict(q=(2, 8, 100, 36), k=(2, 2, 300, 36)), "head_dim 36"),  # not a multiple of 8
    (dict(q=(2, 8, 100, 264), k=(2, 2, 300, 264)), "head_dim 264"),  # past the widest built
    (dict(q=(2, 8, 100, 512), k=(2, 2, 300, 512)), "head_dim 512"),  # a forward, no backward
    (dict(v=(2, 2, 300, 64)), "head_dim"),  # v's head_dim differs
    (dict(q=(2, 6, 100, 128), k=(2, 4, 300, 128)), "multiple"),  # 6 query heads over 4 KV heads
    (dict(q=(2, 8, 0, 128)), "zero"),
    (dict(q=(1, 70000, 4, 128), k=(1, 70000, 4, 128)), "limits"),  # heads past the grid's y
    (dict(q=(800, 64, 65536, 64), k=(800, 64, 16, 64)), "limits"),  # b*h*s_q past int32
    (dict(q=(2, 8, 100)), "4-d"),
    (dict(built=frozenset()), "no fa4_aot kernels"),
])
def test_unsupported_cases_fall_back(case, match):
    reason = _reason(**case)
    assert reason is not None and match in reason, reason


@pytest.mark.parametrize("head_dim", [8, 32, 72, 80, 200, 248])
def test_head_dims_between_the_built_ones_run_on_fa4_aot(head_dim):
    assert _reason("bf16", (2, 8, 100, head_dim), (2, 2, 300, head_dim)) is None


def test_a_head_dim_runs_where_the_narrowest_wider_one_is_built():
    """80 takes 96's kernels (the forward's choice, Manifest.kernel_head_dim): where 96 is
    built causal only, a non-causal 80 falls back rather than taking 128's; where no 96 is
    built at all, 128's."""
    causal_96 = frozenset(k for k in BUILT if k[2] != 96 or k[3])
    assert "head_dim 80" in _reason("bf16", (2, 8, 100, 80), (2, 2, 300, 80), built=causal_96)
    assert _reason("bf16", (2, 8, 100, 80), (2, 2, 300, 80), causal=True, built=causal_96) is None
    no_96 = frozenset(k for k in BUILT if k[2] != 96)
    assert _reason("bf16", (2, 8, 100, 80), (2, 2, 300, 80), built=no_96) is None


def test_built_keys_need_both_backwards():
    assert BUILT == {("sm90a", dt, d, c) for dt in DTYPES for d in WITH_BACKWARD for c in (False, True)}
    some = [v for v in MATRIX if not (v.kind == "bwd" and v.head_dim == 96 and v.deterministic)]
    assert {d for _, _, d, _ in built_keys(some)} == set(WITH_BACKWARD) - {96}


def test_layouts_are_viewed_not_copied():
    """SDPA's (b, h, s, d) tensors reach the kernels as (b, s, h, d) views where they can;
    an expanded grad_out or a misaligned slice is copied."""
    q = torch.randn(2, 8, 100, 64, dtype=torch.bfloat16)
    view = torch_sdpa._bshd(q)
    assert view.shape == (2, 100, 8, 64) and view.data_ptr() == q.data_ptr()
    from_bshd = torch.randn(2, 100, 8, 64, dtype=torch.bfloat16).transpose(1, 2)  # the usual LLM layout
    assert torch_sdpa._bshd(from_bshd).is_contiguous()
    expanded = torch.ones((), dtype=torch.bfloat16).expand(2, 8, 100, 64)
    assert torch.equal(torch_sdpa._bshd(expanded), expanded.transpose(1, 2))
    assert torch_sdpa._bshd(expanded).stride(-1) == 1
    odd = torch.randn(2, 8, 100, 72, dtype=torch.bfloat16)[..., 4:68]  # 8-byte offset, 144-byte rows
    assert torch_sdpa._kernel_ready(torch_sdpa._bshd(odd))
    assert torch_sdpa._bshd(odd).data_ptr() != odd.data_ptr()
    out = torch_sdpa._empty_bhsd_like(odd, torch_sdpa._like_ready(odd))
    assert out.shape == odd.shape and torch_sdpa._kernel_ready(out.transpose(1, 2))
    columns = torch.randn(2, 8, 64, 100, dtype=torch.bfloat16).transpose(2, 3)  # dense, d not the last axis
    assert torch_sdpa._like_ready(q) and not torch_sdpa._like_ready(columns)
    out = torch_sdpa._empty_bhsd_like(columns, torch_sdpa._like_ready(columns))
    assert out.shape == columns.shape and torch_sdpa._kernel_ready(out.transpose(1, 2))


# ---------------------------------------------------------------- the hook's repeats
class _Library:
    """A library's launch_again and the hook's launches, without a GPU: the keys asked
    for, the launches with the keys they are kept under; ``repeat``: whether launch_again
    finds a kept launch (the CPU's allocator reuses addresses less than the caching one)."""

    def __init__(self):
        self.asked, self.launches, self.repeat = [], [], False

    def launch_again(self, key):
        self.asked.append(key)
        return self.repeat

    def launch(self, q, keep):
        self.launches.append((q.data_ptr(), keep))


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch_sdpa._forward and _backward on CPU tensors: every call taken, launches recorded."""
    library, reasons = _Library(), []
    monkeypatch.setattr(torch_sdpa, "_PLANS", {})
    monkeypatch.setattr(torch_sdpa, "default_library", lambda: library)
    monkeypatch.setattr(torch_sdpa, "current_stream", lambda index: 7)
    monkeypatch.setattr(torch_sdpa, "_reason", lambda *a, **kw: reasons.append(a) and None)
    monkeypatch.setattr(torch_sdpa, "forward_workspace_size", lambda *a, **kw: 0)
    monkeypatch.setattr(torch_sdpa, "backward_workspace_size", lambda *a, **kw: 256)
    monkeypatch.setattr(torch_sdpa, "_launch_forward", lambda q, *rest, stream=None, keep=(): library.launch(q, keep))
    monkeypatch.setattr(torch_sdpa, "_launch_backward", lambda q, *rest, stream=None, keep=(): library.launch(q, keep))
    library.reasons = reasons
    return library


def _bhsd(b, h, s, d, offset=0):
    """A (b, s, h, d)-contiguous tensor as (b, h, s, d), ``offset`` elements past an
    allocation's start (4: 8 bytes, a pointer the kernels cannot take)."""
    flat = torch.randn(b * s * h * d + offset, dtype=torch.bfloat16)[offset:]
    return flat.view(b, s, h, d).transpose(1, 2)


def test_aligned_views_are_kept_under_their_pointers_and_repeated(fake_gpu):
    """A call whose tensors are kernel-ready views keeps its launch under the signature, the
    stream and every pointer it launches with; a call whose key is kept only repeats."""
    q, k = _bhsd(2, 8, 100, 64), _bhsd(2, 2, 300, 64)
    out, lse, *_ = torch_sdpa._forward(None, None, q, k, k, 0.0, True)
    asked = fake_gpu.asked[-1]
    assert asked[1:] == (7, q.data_ptr(), k.data_ptr(), k.data_ptr(), out.data_ptr(), lse.data_ptr(), None)
    assert fake_gpu.launches == [(q.data_ptr(), (asked,))]
    fake_gpu.repeat = True
    torch_sdpa._forward(None, None, q, k, k, 0.0, True)
    assert len(fake_gpu.launches) == 1 and len(fake_gpu.asked) == 2
    assert len(fake_gpu.reasons) == 1  # decided once for the signature
    torch_sdpa._forward(None, None, q, k, k, 0.0, False)
    assert len(fake_gpu.reasons) == 2 and fake_gpu.asked[-1][0] != asked[0]  # another signature


def test_copied_inputs_are_never_kept(fake_gpu):
    """A misaligned slice is copied: its launch reads the copy, so nothing is kept or asked
    for under the caller's pointers and every call launches (a kept launch would read a
    block the next call need not have written)."""
    fake_gpu.repeat = True
    k = _bhsd(2, 2, 300, 64)
    shifted = _bhsd(2, 8, 100, 64, offset=4)  # strides the kernels take, 8 bytes past alignment
    rows = torch.randn(2, 100, 8, 68, dtype=torch.bfloat16)[..., 4:].transpose(1, 2)  # 136-byte rows
    for q in (shifted, rows):
        for _ in range(2):
            torch_sdpa._forward(None, None, q, k, k, 0.0, False)
        assert all(ptr != q.data_ptr() for ptr, _ in fake_gpu.launches[-2:])  # the copy's
    assert [keep for _, keep in fake_gpu.launches] == [()] * 4 and fake_gpu.asked == []


def test_backward_is_kept_only_with_views_and_a_contiguous_lse(fake_gpu):
    q, k = _bhsd(1, 4, 64, 64), _bhsd(1, 4, 64, 64)
    out, dout = _bhsd(1, 4, 64, 64), _bhsd(1, 4, 64, 64)
    args = (None, None, None, None, 0.0, False, None, None)
    dq, dk, dv = torch_sdpa._backward(None, None, dout, q, k, k, out, torch.randn(1, 4, 64), *args)
    key = fake_gpu.asked[-1]
    assert key[1:7] == (7, q.data_ptr(), k.data_ptr(), k.data_ptr(), out.data_ptr(), dout.data_ptr())
    assert key[8:11] == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    assert fake_gpu.launches == [(q.data_ptr(), (key,))]
    fake_gpu.repeat = True
    for _ in range(2):
        torch_sdpa._backward(None, None, dout, q, k, k, out, torch.randn(1, 4, 128)[..., ::2], *args)
    assert [keep for _, keep in fake_gpu.launches[1:]] == [(), ()] and len(fake_gpu.asked) == 1
