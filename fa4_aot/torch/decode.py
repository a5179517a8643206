"""PyTorch adapter for decode against a KV cache (imports torch; re-exported by
``fa4_aot.torch``).

    from fa4_aot.torch import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)

flash-attn's names and semantics: ``k``/``v`` (batch, seqlen_new, heads_kv, head_dim),
when given, are written into the cache in place at positions cache_seqlens[b] ..
cache_seqlens[b] + seqlen_new - 1 (through page_table for a paged cache) before
attending, and the attention then covers cache_seqlens + seqlen_new keys;
``cache_seqlens`` itself is not changed. Nothing synchronizes with the host: positions
past the cache are clamped to its last row (metadata that lies overwrites a wrong row of
the cache, never memory outside it). Inference only: no gradient.

An FP8 cache (float8_e4m3fn, with ``k_descale``, ``v_descale`` as flash-attn 3's: float32
(batch, heads_kv) or one value, None: 1): ``k``, ``v`` are q's dtype and are quantized
into it as k / k_descale, rounded to nearest and saturated at +-448.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError
from ..launch import checks
from .kvcache import attend_with_cache
from .tensors import check_on_gpu, check_tensors, passed


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, page_table=None,
                            softmax_scale: float | None = None, causal: bool = False, num_splits: int | None = None,
                            return_lse: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                            learnable_sink=None, k_descale=None, v_descale=None):
    """flash-attn's decode: q (batch, seqlen_q, heads_q, head_dim); k_cache, v_cache
    (batch, max_cache, heads_kv, head_dim) or, with page_table int32 (batch, max_pages),
    (num_pages, page_size, heads_kv, head_dim); cache_seqlens int32 (batch,) on the device
    (None: every cache full); see fa4_aot.forward_kvcache (``window_size``, ``softcap``,
    ``learnable_sink``, and an FP8 cache's ``k_descale``, ``v_descale`` too). Returns out, and lse (batch, heads_q, seqlen_q) float32 too
    where ``return_lse``. Under torch.compile a custom op that mutates the caches
    (``fa4_aot::kvcache`` in ops.py, traced without a graph break); eagerly the same code, called
    directly (a custom op's dispatch costs host time); capturable in a CUDA graph either way
    (the lengths stay on the device, nothing synchronizes)."""
    check_tensors({"q": q, "k_cache": k_cache, "v_cache": v_cache},
                  passed(page_table=page_table, learnable_sink=learnable_sink, k_descale=k_descale,
                         v_descale=v_descale))
    if (k is None) != (v is None):
        raise ShapeError("k and v are appended together: give both or neither")
    if k is not None:
        check_tensors({"k": k, "v": v})
    new = k.shape[1] if k is not None else 0
    compiling = torch.compiler.is_compiling()
    if cache_seqlens is None and (new or compiling):  # eagerly without appending: the kernel's whole cache
        rows = k_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
        cache_seqlens = torch.full((q.shape[0],), rows - new, dtype=torch.int32, device=q.device)
    elif type(cache_seqlens) is int:
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if cache_seqlens is not None:
        check_tensors({}, {"cache_seqlens": cache_seqlens})
    if compiling:  # traced: the custom op, its options as the op's types
        mods = checks.score_mods(checks.flag("causal", causal), window_size, softcap, learnable_sink is not None)
        check_on_gpu({n: t for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                                        ("cache_seqlens", cache_seqlens), ("page_table", page_table),
                                        ("learnable_sink", learnable_sink), ("k_descale", k_descale),
                                        ("v_descale", v_descale)) if t is not None})
        from .ops import kvcache_op  # registered by the first trace

        out, lse = kvcache_op(q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale, causal,
                              num_splits, mods.left, mods.right, mods.softcap, learnable_sink, k_descale, v_descale)
    else:
        out, lse = attend_with_cache(q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale, causal,
                                     num_splits, window_size, softcap, learnable_sink, k_descale, v_descale)
    return (out, lse) if checks.flag("return_lse", return_lse) else out
