"""PyTorch adapter: torch ops (traceable by torch.compile) and autograd over the kernels.

    from fa4_aot.torch import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # differentiable
    out, lse = flash_attn_func(q, k, v, return_lse=True)

This package imports torch; nothing else in fa4_aot does. Its modules: ``tensors`` (torch
tensors as arrays, streams), ``dense`` (flash_attn_fwd, flash_attn_bwd), ``autograd``
(flash_attn_func), ``ops`` (its custom ops, registered by its first torch.compile trace),
``varlen``, ``decode`` (flash_attn_with_kvcache), ``sdpa`` (torch SDPA's backend).
Launches go to torch's current stream; outputs and the backward's workspace come from
torch's caching allocator. All but flash_attn_fwd and flash_attn_bwd are imported on
first use (``_LAZY``): registering a custom op costs milliseconds (torch.library reads
the source of each) that a caller of those two alone need not spend.
"""

from __future__ import annotations

from .dense import flash_attn_bwd, flash_attn_fwd
from .tensors import as_device_array

# name -> the module that defines it, imported on first use
_LAZY = {"flash_attn_func": "autograd", "FlashAttention": "autograd", "fwd_op": "ops", "bwd_op": "ops",
         "flash_attn_varlen_func": "varlen", "flash_attn_varlen_fwd": "varlen", "flash_attn_varlen_bwd": "varlen",
         "VarlenAttention": "varlen",
         "flash_attn_with_kvcache": "decode"}

__all__ = ["as_device_array", "flash_attn_bwd", "flash_attn_fwd", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
