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
from .dense import flash_attn_bwd, flash_attn_fwd
from .tensors import KERNEL_DTYPES

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
    from ..launch.calls import default_library

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
def _kernel_ready(view: torch.Tensor) -> bool:
    """A (b, s, h, d) view the kernels address as it is: last dim contiguous, the other
    strides (of axes longer than 1) and the pointer 16-byte aligned."""
    size = view.element_size()
    return (view.stride(-1) == 1 and view.data_ptr() % 16 == 0
            and all(n == 1 or (st > 0 and st * size % 16 == 0) for n, st in zip(view.shape[:3], view.stride()[:3])))


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """(b, h, s, d) -> the (b, s, h, d) view fa4_aot takes; a copy only where that view is
    not kernel-ready (an expanded grad_out, a misaligned slice)."""
    view = t.transpose(1, 2)
    return view if _kernel_ready(view) else view.contiguous()


def _empty_bhsd_like(t: torch.Tensor) -> torch.Tensor:
    """A (b, h, s, d) output with ``t``'s strides where they suit the kernels (empty_like
    keeps a dense tensor's layout), else (b, s, h, d)-contiguous underneath."""
    out = torch.empty_like(t)
    if not _kernel_ready(out.transpose(1, 2)):
        b, h, s, d = t.shape
        out = torch.empty((b, s, h, d), dtype=t.dtype, device=t.device).transpose(1, 2)
    return out


def _forward(fallback, keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
             scale=None):
    """aten::_scaled_dot_product_flash_attention: q (b, h_q, s_q, d), k, v (b, h_kv, s_k, d)
    -> (out like q, lse float32 (b, h_q, s_q), None, None, s_q, s_k, rng_state, offset,
    debug mask), as torch's own FA4 returns them for dense inputs."""
    if _reason(query, key, value, dropout_p, is_causal, return_debug_mask) is not None:
        return _call(fallback, keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
    out = _empty_bhsd_like(query)  # (b, h_q, s_q, d)
    b, h_q, s_q, _ = query.shape
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=query.device)
    flash_attn_fwd(_bshd(query), _bshd(key), _bshd(value), softmax_scale=scale, causal=bool(is_causal),
                   out=out.transpose(1, 2), lse=lse)
    # dropout 0: the RNG fields are placeholders (torch's own flash op leaves them
    # unfilled too); zeros would cost two fill kernels a call, as long as a short decode
    rng_state = torch.empty((2,), dtype=torch.uint64, device=query.device)
    philox_offset = torch.empty((), dtype=torch.uint64, device=query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, s_q, key.shape[2], rng_state, philox_offset, debug_mask


def _backward(fallback, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
              dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward -> (dq, dk, dv) in (b, h, s, d),
    shaped like query, key, value."""
    if _reason(query, key, value, dropout_p, is_causal) is not None:
        return _call(fallback, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                     max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=scale)
    dq, dk, dv = (_empty_bhsd_like(t) for t in (query, key, value))
    flash_attn_bwd(_bshd(query), _bshd(key), _bshd(value), _bshd(out), _bshd(grad_out), logsumexp.contiguous(),
                   softmax_scale=scale, causal=bool(is_causal),
                   deterministic=torch.are_deterministic_algorithms_enabled(),
                   dq=dq.transpose(1, 2), dk=dk.transpose(1, 2), dv=dv.transpose(1, 2))
    return dq, dk, dv


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
