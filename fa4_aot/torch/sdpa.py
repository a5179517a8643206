"""torch's SDPA on fa4_aot's kernels: a flash-attention implementation named "fa4_aot".

    import torch, fa4_aot.torch_sdpa                      # registers; activates nothing
    torch.nn.attention.activate_flash_attention_impl("fa4_aot")
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.nn.attention.restore_flash_attention_impl()     # SDPA's own kernels again

Activation overrides the CUDA kernels of two aten ops, the ones SDPA's flash backend
calls: ``_scaled_dot_product_flash_attention`` and its ``_backward``. A call that
``fallback_reason`` accepts (dense bf16/fp16, a head_dim whose forward and backward are
built for the device, dropout 0, q/k/v on one sm_90 device, ...) runs fa4_aot's kernels;
every other call goes to the kernel that was registered for the op before activation
(torch's own FA2), fetched with ``torch.library.get_kernel``. Forward and backward decide
from the same fields (dtype, sizes, dropout, device), so a backward always takes the LSE
of its own kind of forward. SDPA itself picks the flash backend first: fp32, an
attn_mask, or is_causal with seqlen_q != seqlen_k never reach these ops (SDPA takes
another backend), and a causal call with ``torch.nn.attention.bias.causal_lower_right``
does (the flash op's causal mask is bottom-right aligned, as fa4_aot's is).

``_flash_attention_forward``/``_backward`` (the bshd ops under SDPA's own CUDA kernel)
are left to torch: SDPA reaches them only through that kernel, which the override
replaces wherever fa4_aot runs.

On a torch without the registry (torch.nn.attention.register_flash_attention_impl) the
import registers nothing; ``activate()`` then raises fa4_aot.FrameworkError, as does
activation on a torch without ``torch.library.get_kernel`` (no fallback possible).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import FrameworkError
from ..launch import checks
from ..variants import arch_for_capability, serving_head_dim
from ..launch.calls import default_library
from .dense import backward_workspace_size, forward_workspace_size, launch_backward, launch_forward
from .tensors import KERNEL_DTYPES, current_stream

__all__ = ["NAME", "OPS", "activate", "built_keys", "fallback_reason", "register_kernels", "restore"]

NAME = "fa4_aot"
OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
_REGISTRY_FUNCTIONS = ("register_flash_attention_impl", "activate_flash_attention_impl",
                       "restore_flash_attention_impl", "list_flash_attention_impls",
                       "current_flash_attention_impl")


# ---------------------------------------------------------------- the decision
def fallback_reason(dtype: str | None, q_shape: tuple, k_shape: tuple, v_shape: tuple, *, dropout_p: float,
                    causal: bool, capability: tuple[int, int] | None, built: frozenset,
                    return_debug_mask: bool = False) -> str | None:
    """None where fa4_aot runs the call, else why torch's kernel does. A pure function.

    dtype: "bf16", "fp16" or None (another dtype); shapes (batch, heads, seqlen, head_dim)
    as SDPA's flash op takes them; capability: the device's (major, minor), None when q,
    k, v are not on one CUDA device; built: (arch, dtype, head_dim, causal) for which the
    forward and both backwards (deterministic or not) are built (``built_keys``): a head dim
    that is a multiple of 8 runs on the narrowest built one at least as wide.
    """
    if dtype is None:
        return "dtype is not bf16 or fp16"
    if dropout_p != 0.0:
        return "dropout_p is not 0"
    if return_debug_mask:
        return "return_debug_mask is set"
    if capability is None:
        return "q, k, v are not on one CUDA device"
    if any(len(s) != 4 for s in (q_shape, k_shape, v_shape)):
        return "q, k, v are not 4-d (dense)"
    (b, h_q, s_q, d), (b_k, h_kv, s_k, d_k) = q_shape, k_shape
    if tuple(v_shape) != tuple(k_shape) or b_k != b or d_k != d:
        return "k, v shapes differ from q's or from each other (batch, head_dim)"
    if min(*q_shape, *k_shape) <= 0:
        return "a zero size"
    if h_q % h_kv:
        return "heads_q is not a multiple of heads_kv"
    if b * h_q * s_q > checks.INT32_MAX or max(b, h_q) > checks.GRID_YZ_MAX or max(s_q, s_k) > checks.INT32_MAX:
        return "sizes past the kernels' index or grid limits"
    arch = arch_for_capability(capability)
    served = serving_head_dim({dim for a, _, dim, _ in built if a == arch}, d)  # the forward's choice
    if served is None or (arch, dtype, served, bool(causal)) not in built:
        return f"no fa4_aot kernels built for {arch or capability}, {dtype}, head_dim {d}, causal={bool(causal)}"
    return None


def built_keys(variants) -> frozenset:
    """(arch, dtype, head_dim, causal) with a dense forward and both dense backwards among
    ``variants`` (a manifest's)."""
    have = {(v.kind, v.arch, v.dtype, v.head_dim, v.causal, v.deterministic) for v in variants if not v.varlen}
    return frozenset((a, dt, d, c) for kind, a, dt, d, c, det in have
                     if kind == "fwd" and {("bwd", a, dt, d, c, x) for x in (False, True)} <= have)


@functools.cache
def _built() -> frozenset:
    return built_keys(default_library().manifest.variants)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _reason(query, key, value, dropout_p, causal, return_debug_mask=False) -> str | None:
    devices = {t.device for t in (query, key, value)}
    device = next(iter(devices))
    capability = _capability(device.index) if len(devices) == 1 and device.type == "cuda" else None
    dtypes = {t.dtype for t in (query, key, value)}
    dtype = KERNEL_DTYPES.get(query.dtype) if len(dtypes) == 1 else None
    return fallback_reason(dtype, tuple(query.shape), tuple(key.shape), tuple(value.shape), dropout_p=dropout_p,
                           causal=causal, capability=capability, built=_built() if capability else frozenset(),
                           return_debug_mask=return_debug_mask)


# ---------------------------------------------------------------- the kernels
def _layout_ready(shape, stride, size: int) -> bool:
    """A (b, s, h, d) layout the kernels address as it is: last dim contiguous, the other
    strides (of axes longer than 1) 16-byte multiples."""
    return stride[-1] == 1 and all(n == 1 or (st > 0 and st * size % 16 == 0) for n, st in zip(shape[:3], stride[:3]))


def _kernel_ready(view: torch.Tensor) -> bool:
    """A (b, s, h, d) view the kernels address as it is: its layout (_layout_ready) and a
    16-byte-aligned pointer."""
    return _layout_ready(view.shape, view.stride(), view.element_size()) and view.data_ptr() % 16 == 0


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """(b, h, s, d) -> the (b, s, h, d) view fa4_aot takes; a copy only where that view is
    not kernel-ready (an expanded grad_out, a misaligned slice: a fresh block, where
    contiguous() would keep a contiguous view's misaligned pointer)."""
    view = t.transpose(1, 2)
    return view if _kernel_ready(view) else view.clone(memory_format=torch.contiguous_format)


def _like_ready(t: torch.Tensor) -> bool:
    """Whether torch.empty_like(t) (b, h, s, d) has a kernel-ready (b, s, h, d) layout
    (empty_like keeps a dense tensor's strides): read off a meta tensor, nothing allocated."""
    view = torch.empty_like(t, device="meta").transpose(1, 2)
    return _layout_ready(view.shape, view.stride(), view.element_size())


def _empty_bhsd_like(t: torch.Tensor, like: bool) -> torch.Tensor:
    """A (b, h, s, d) output: empty_like(t) where ``like`` (_like_ready(t)), else (b, s, h,
    d)-contiguous underneath (the caching allocator's blocks are 512-byte aligned)."""
    if like:
        return torch.empty_like(t)
    b, h, s, d = t.shape
    return torch.empty((b, s, h, d), dtype=t.dtype, device=t.device).transpose(1, 2)


# ---------------------------------------------------------------- a call's plan
@dataclass(frozen=True)
class _Plan:
    """What the hook decides once for a signature of its calls (every tensor's sizes,
    strides, dtype and device, and the options): whether fa4_aot runs it (``reason`` None),
    whether every input's (b, s, h, d) view is kernel-ready by its strides (then a call
    whose pointers are 16-byte aligned needs no copy, and its launches are kept under a key
    of the signature and its pointers: the next such call is launched again at once, the
    host path of benchmarks/experiments/entry_host_probe.py), and the workspace's bytes."""

    reason: str | None
    views: bool = False
    like: tuple = ()  # _like_ready of each output's model (out: query; dq, dk, dv: query, key, value)
    workspace: int = 0


_PLANS: dict = {}
_MAX_PLANS = 1024  # a serving process's shapes change call by call: the plans are dropped past this


def _signature(kind: str, tensors, options) -> tuple:
    key = [kind, *options]
    for t in tensors:
        key += (t.shape, t.stride(), t.dtype, t.device)
    return tuple(key)


def _plan(signature: tuple, make, *args) -> _Plan:
    """The plan of ``signature``: kept, or ``make(*args)`` the first time (a function and
    its arguments, not a closure: a repeated call builds nothing it does not use)."""
    plan = _PLANS.get(signature)
    if plan is None:
        plan = make(*args)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[signature] = plan
    return plan


def _forward_plan(query, key, value, dropout_p, is_causal, return_debug_mask) -> _Plan:
    why = _reason(query, key, value, dropout_p, is_causal, return_debug_mask)
    if why is not None:
        return _Plan(why)
    views = [t.transpose(1, 2) for t in (query, key, value)]
    return _Plan(None, _views_ready(query, key, value), (_like_ready(query),),
                 forward_workspace_size(*views, bool(is_causal)))


def _backward_plan(query, key, value, out, grad_out, logsumexp, dropout_p, is_causal, deterministic) -> _Plan:
    why = _reason(query, key, value, dropout_p, is_causal)
    if why is not None:
        return _Plan(why)
    views = [t.transpose(1, 2) for t in (query, key, value)]
    return _Plan(None, _views_ready(query, key, value, out, grad_out) and logsumexp.is_contiguous(),
                 tuple(_like_ready(t) for t in (query, key, value)),
                 backward_workspace_size(*views, bool(is_causal), deterministic))


def _views_ready(*tensors) -> bool:
    """Every (b, h, s, d) tensor's (b, s, h, d) view kernel-ready by its strides (read off
    the tensor: its view's shape and strides are its own with axes 1 and 2 swapped)."""
    for t in tensors:
        (b, h, s, d), (sb, sh, ss, sd) = t.shape, t.stride()
        if not _layout_ready((b, s, h, d), (sb, ss, sh, sd), t.element_size()):
            return False
    return True


def _aligned(*pointers) -> bool:
    bits = 0
    for p in pointers:
        bits |= p
    return bits % 16 == 0


def _forward(fallback, keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
             scale=None):
    """aten::_scaled_dot_product_flash_attention: q (b, h_q, s_q, d), k, v (b, h_kv, s_k, d)
    -> (out like q, lse float32 (b, h_q, s_q), None, None, s_q, s_k, rng_state, offset,
    debug mask), as torch's own FA4 returns them for dense inputs."""
    library = default_library()
    signature = _signature("fwd", (query, key, value), (dropout_p, is_causal, return_debug_mask, scale, library))
    plan = _plan(signature, _forward_plan, query, key, value, dropout_p, is_causal, return_debug_mask)
    if plan.reason is not None:
        return _call(fallback, keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
    device = query.device
    out = _empty_bhsd_like(query, *plan.like)  # (b, h_q, s_q, d)
    b, h_q, s_q, _ = query.shape
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=device)
    workspace = torch.empty(plan.workspace, dtype=torch.uint8, device=device) if plan.workspace else None
    pointers = (query.data_ptr(), key.data_ptr(), value.data_ptr())
    if plan.views and _aligned(*pointers):  # views, no copies: what the pointers hold is what is launched
        again = (signature, current_stream(device.index), *pointers, out.data_ptr(), lse.data_ptr(),
                 None if workspace is None else workspace.data_ptr())
        if not library.launch_again(again):
            _launch_forward(*(t.transpose(1, 2) for t in (query, key, value, out)), lse, workspace, scale,
                            is_causal, stream=again[1], keep=(again,))
    else:
        _launch_forward(_bshd(query), _bshd(key), _bshd(value), out.transpose(1, 2), lse, workspace, scale, is_causal)
    # dropout 0: the RNG fields are placeholders (torch's own flash op leaves them
    # unfilled too); zeros would cost two fill kernels a call, as long as a short decode
    rng_state = torch.empty((2,), dtype=torch.uint64, device=device)
    philox_offset = torch.empty((), dtype=torch.uint64, device=device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=device)
    return out, lse, None, None, s_q, key.shape[2], rng_state, philox_offset, debug_mask


def _launch_forward(q, k, v, out, lse, workspace, scale, causal, stream=None, keep=()) -> None:
    """The hook's forward launch on (b, s, h, d) views (launch_forward: every check)."""
    launch_forward(q, k, v, out, lse, workspace, softmax_scale=scale, causal=bool(causal), q_tiles=None,
                   window_size=(-1, -1), softcap=0.0, learnable_sink=None, stream=stream, keep=keep)


def _backward(fallback, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
              dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward -> (dq, dk, dv) in (b, h, s, d),
    shaped like query, key, value."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    tensors = (query, key, value, out, grad_out)
    library = default_library()
    signature = _signature("bwd", (*tensors, logsumexp), (dropout_p, is_causal, scale, deterministic, library))
    plan = _plan(signature, _backward_plan, *tensors, logsumexp, dropout_p, is_causal, deterministic)
    if plan.reason is not None:
        return _call(fallback, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                     max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=scale)
    dq, dk, dv = (_empty_bhsd_like(t, like) for t, like in zip((query, key, value), plan.like))
    workspace = torch.empty(plan.workspace, dtype=torch.uint8, device=query.device)
    pointers = tuple(t.data_ptr() for t in tensors)
    if plan.views and _aligned(*pointers):
        again = (signature, current_stream(query.device.index), *pointers, logsumexp.data_ptr(), dq.data_ptr(),
                 dk.data_ptr(), dv.data_ptr(), workspace.data_ptr())
        if not library.launch_again(again):
            _launch_backward(*(t.transpose(1, 2) for t in tensors), logsumexp,
                             *(t.transpose(1, 2) for t in (dq, dk, dv)), workspace, scale, is_causal,
                             deterministic, stream=again[1], keep=(again,))
    else:
        _launch_backward(*(_bshd(t) for t in tensors), logsumexp.contiguous(),
                         *(t.transpose(1, 2) for t in (dq, dk, dv)), workspace, scale, is_causal, deterministic)
    return dq, dk, dv


def _launch_backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, scale, causal, deterministic, stream=None,
                     keep=()) -> None:
    """The hook's backward launch on (b, s, h, d) views (launch_backward: every check)."""
    launch_backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, softmax_scale=scale, causal=bool(causal),
                    deterministic=deterministic, q_tiles=None, window_size=(-1, -1), softcap=0.0,
                    learnable_sink=None, dsink=None, stream=stream, keep=keep)


def _call(fallback, keyset, *args, **kwargs):
    if fallback is None:
        raise FrameworkError("this torch has no CUDA kernel of its own for SDPA's flash op to fall back to; "
                             "restore_flash_attention_impl() or use a CUDA build of torch")
    return fallback.call_boxed(keyset, *args, **kwargs)


# ---------------------------------------------------------------- registration
def _previous_kernel(op: str, dispatch_key: str):
    """The kernel ``op`` has for ``dispatch_key`` now (None where it has none, as on a CPU
    build of torch), to call where fa4_aot does not run."""
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"aten::{op}", dispatch_key):
        return None
    return torch.library.get_kernel(f"aten::{op}", dispatch_key)


@dataclass
class _Handle:
    """What the registry keeps while "fa4_aot" is active; remove() gives the ops back."""

    library: torch.library.Library | None

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
        self.library = None


def register_kernels(dispatch_key: str = "CUDA") -> _Handle:
    """The registry's register_fn: override OPS for ``dispatch_key``, falling back to the
    kernels they had. FrameworkError where this torch cannot give those kernels."""
    if not callable(getattr(torch.library, "get_kernel", None)):
        raise FrameworkError(f"torch {torch.__version__} has no torch.library.get_kernel, so the fa4_aot SDPA "
                             "hook could not fall back to torch's kernels; it needs torch 2.9 or newer")
    previous = {op: _previous_kernel(op, dispatch_key) for op in OPS}
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    for op, impl in zip(OPS, (_forward, _backward)):
        library.impl(op, functools.partial(impl, previous[op]), dispatch_key, with_keyset=True)
    return _Handle(library)


def _registry():
    attention = torch.nn.attention
    if not all(hasattr(attention, name) for name in _REGISTRY_FUNCTIONS):
        raise FrameworkError(f"torch {torch.__version__} has no flash-attention implementation registry "
                             "(torch.nn.attention.activate_flash_attention_impl); use fa4_aot.torch.flash_attn_func")
    return attention


def activate() -> None:
    """torch.nn.attention.activate_flash_attention_impl("fa4_aot"), or FrameworkError on a
    torch without the registry."""
    _registry().activate_flash_attention_impl(NAME)


def restore() -> None:
    """torch.nn.attention.restore_flash_attention_impl(): SDPA's own kernels again."""
    _registry().restore_flash_attention_impl()


if all(hasattr(torch.nn.attention, name) for name in _REGISTRY_FUNCTIONS):
    torch.nn.attention.register_flash_attention_impl(NAME, register_fn=register_kernels)
