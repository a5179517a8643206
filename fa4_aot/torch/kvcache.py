"""What ``flash_attn_with_kvcache`` does once its arguments are read (decode.py), and what
its torch.compile custom op (ops.py's fa4_aot::kvcache) calls: the cache append and the
decode launch. Imports torch."""

from __future__ import annotations

import functools

import torch

from .. import policy
from ..decode import forward_kvcache_workspace_bytes, prepare_kvcache
from ..errors import DeviceError, DTypeError, ShapeError
from ..launch.calls import default_library
from .tensors import as_device_array, current_stream, repeat_key


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantized(x, descale, cache_dtype):
    """x (batch, new, heads_kv, d) as the cache stores it: itself, or for an FP8 cache
    x / descale (float32 (batch, heads_kv) or one value; None: 1) rounded to nearest,
    saturated at the format's largest value."""
    if cache_dtype == x.dtype:
        return x
    x = x.float()
    if descale is not None:
        x = x / (descale.reshape(descale.shape[0], 1, descale.shape[1], 1) if descale.dim() == 2 else descale)
    return x.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def append(k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale=None, v_descale=None):
    """k, v into the cache at each sequence's end (see decode.py's docstring), quantized
    where the cache is FP8."""
    k, v = quantized(k, k_descale, k_cache.dtype), quantized(v, v_descale, v_cache.dtype)
    batch, new = k.shape[0], k.shape[1]
    positions = cache_seqlens.long()[:, None] + torch.arange(new, device=k.device)[None, :]  # (b, new)
    if page_table is None:
        positions = positions.clamp(0, k_cache.shape[1] - 1)
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, new)
        k_cache[rows, positions] = k
        v_cache[rows, positions] = v
        return
    page_size, max_pages = k_cache.shape[1], page_table.shape[1]
    entry = (positions // page_size).clamp(0, max_pages - 1)
    pages = torch.gather(page_table.long(), 1, entry).clamp(0, k_cache.shape[0] - 1)
    k_cache[pages, positions % page_size] = k
    v_cache[pages, positions % page_size] = v


def attend_with_cache(q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale, causal, num_splits,
                      window_size, softcap, learnable_sink, k_descale=None, v_descale=None):
    """flash_attn_with_kvcache's work once cache_seqlens is a tensor (or None without
    appending: the whole cache): (out, lse). A call whose tensors (pointers, shapes,
    strides, dtypes) and options were launched before appends and repeats the kept
    launches (a serving loop's step after step: the caching allocator gives the same
    addresses); any other is checked in full before the cache is written."""
    device = as_device_array(q).device  # on a GPU (a typed refusal where not)
    if k is not None:
        check_new(q, k_cache, v_cache, k, v)
    batch = q.shape[0]
    new = k.shape[1] if k is not None else 0
    # the lengths the attention covers: the cache's and, appended, the new keys (a new tensor:
    # the caller's cache_seqlens is not changed)
    lengths = (cache_seqlens + new).to(torch.int32) if new else cache_seqlens  # None: the whole cache
    out = q.new_empty((*q.shape[:3], v_cache.shape[-1]))
    lse = torch.empty((batch, q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    library = default_library()
    reach = k_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
    need = _workspace_bytes(batch, q.shape[1], q.shape[2], k_cache.shape[2], q.shape[3], v_cache.shape[-1], reach,
                            num_splits, library.sm_count(device), library)
    workspace = torch.empty(need, dtype=torch.uint8, device=q.device) if need else None
    stream = current_stream(device)
    optional = (lengths, page_table, learnable_sink, workspace, k_descale, v_descale)
    repeat = repeat_key("kvcache", [t for t in (q, k_cache, v_cache, out, lse, *optional) if t is not None],
                        (*(t is None for t in optional), softmax_scale, causal, num_splits, window_size, softcap,
                         policy.DECODE_TURN_STRIDE, device, stream))
    try:
        hash(repeat)
    except TypeError:  # an option that is not hashable: never kept (the checks say what they make of it)
        repeat = None
    if repeat is not None and library.kept(repeat):  # checked when kept: append, then the same launches
        if k is not None:
            append(k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale, v_descale)
        if library.launch_again(repeat):
            return out, lse
    # every check, and the launches packed, before the cache is written: a refused call
    # leaves the cache as it was
    prepared = prepare_kvcache(*(as_device_array(t) for t in (q, k_cache, v_cache, out, lse)),
                               as_device_array(lengths) if lengths is not None else None,
                               as_device_array(workspace) if workspace is not None else None,
                               page_table=as_device_array(page_table) if page_table is not None else None,
                               causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                               window_size=window_size, softcap=softcap,
                               learnable_sink=as_device_array(learnable_sink) if learnable_sink is not None else None,
                               k_descale=as_device_array(k_descale) if k_descale is not None else None,
                               v_descale=as_device_array(v_descale) if v_descale is not None else None,
                               stream=stream)
    if k is not None:
        append(k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale, v_descale)
    prepared.issue(repeat)  # kept under the repeat key (None: not kept)
    return out, lse


@functools.lru_cache(maxsize=256)
def _workspace_bytes(batch, seqlen_q, heads_q, heads_kv, head_dim, head_dim_v, reach, num_splits, sm_count,
                     library) -> int:
    """forward_kvcache_workspace_bytes of a call (a refusal is raised, not kept)."""
    return forward_kvcache_workspace_bytes(batch, seqlen_q, heads_q, heads_kv, head_dim, reach,
                                           num_splits=num_splits, sm_count=sm_count, head_dim_v=head_dim_v,
                                           library=library)


def check_new(q, k_cache, v_cache, k, v) -> None:
    """The keys and values to append: (batch, seqlen_new, heads_kv, head_dim) each (v's head
    dim v_cache's), of the cache's dtype (an FP8 cache: q's, quantized when appended) and
    device."""
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        want = (q.shape[0], k.shape[1], *cache.shape[2:])
        if tuple(t.shape) != want:
            raise ShapeError(f"{name} {tuple(t.shape)} must be (batch, seqlen_new, heads_kv, head_dim) = {want}")
        dtype = q.dtype if k_cache.dtype == torch.float8_e4m3fn else k_cache.dtype
        if t.dtype != dtype:
            raise DTypeError(f"{name} is {t.dtype}; it must be {dtype} (a {k_cache.dtype} cache's)")
        if t.device != k_cache.device:
            raise DeviceError(f"{name} is on {t.device}, the cache on {k_cache.device}")
