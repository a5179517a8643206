"""PyTorch adapter for packed variable-length sequences (imports torch; re-exported by
``fa4_aot.torch``).

    from fa4_aot.torch import flash_attn_varlen_func
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)

Differentiable (the gradient flows to q, k and v through fa4_aot.backward_varlen) and
traceable by torch.compile: a trace takes custom ops for both directions, an eager call an
autograd.Function over the same functions (``VarlenAttention``: no torch.library dispatch).
"""

from __future__ import annotations

import functools
import math

import torch

from ..varlen import (
    backward_varlen, backward_varlen_workspace_bytes, default_forward_order, forward_varlen, forward_varlen_workspace_bytes,
    run_backward_varlen, run_forward_varlen,
)
from ..launch import checks
from ..launch.calls import default_library
from .tensors import (
    DTYPES, as_device_array, check_on_gpu, check_packed, current_stream, kernel_ready_dout, needs_grad, passed,
)

def flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                          seqused_q=None, seqused_k=None, causal: bool = False, softmax_scale: float | None = None,
                          out=None, lse=None, order: str | None = None, workspace=None, window_size=(-1, -1),
                          softcap: float = 0.0, learnable_sink=None):
    """(out, lse): out (total_q, h_q, d) like q, lse (h_q, total_q) float32; rows of no
    sequence (past seqused, or past the last cu_seqlens_q) are left as allocated.
    ``order``: the sequences' order (fa4_aot.forward_varlen; None: the policy's); the
    heaviest-first order's workspace (uint8) comes from torch's allocator unless given.
    ``window_size``, ``softcap``, ``learnable_sink``: fa4_aot.forward_varlen's."""
    check_packed({"q": q, "k": k, "v": v}, {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                                            **passed(seqused_q=seqused_q, seqused_k=seqused_k, out=out, lse=lse,
                                                     workspace=workspace, learnable_sink=learnable_sink)})
    out = q.new_empty((*q.shape[:2], v.shape[-1])) if out is None else out
    if lse is None:
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if workspace is None and order in ("lpt", None):
        lpt, size = _forward_order(batch, default_library())
        if order == "lpt" or lpt:
            workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
    extra = {n: as_device_array(t) for n, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k),
                                                ("workspace", workspace), ("learnable_sink", learnable_sink))
             if t is not None}
    forward_varlen(*(as_device_array(t) for t in (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)), max_seqlen_q,
                   max_seqlen_k, causal=causal, softmax_scale=softmax_scale, order=order,
                   window_size=window_size, softcap=softcap,
                   stream=torch.cuda.current_stream(q.device).cuda_stream, **extra)
    return out, lse


@torch.library.custom_op("fa4_aot::fwd_varlen", mutates_args=(), device_types="cuda")
def _fwd_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, causal: bool,
                   softmax_scale: float, deterministic: bool, window_left: int = -1, window_right: int = -1,
                   softcap: float = 0.0, learnable_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 seqused_q=seqused_q, seqused_k=seqused_k, causal=causal, softmax_scale=softmax_scale,
                                 window_size=(window_left, window_right), softcap=softcap,
                                 learnable_sink=learnable_sink)


@_fwd_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, causal,
      softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0, learnable_sink=None):
    return (q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def flash_attn_varlen_bwd(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                          max_seqlen_k: int, *, seqused_q=None, seqused_k=None, causal: bool = False,
                          softmax_scale: float | None = None, deterministic: bool = False, dq=None, dk=None, dv=None,
                          workspace=None, order: str | None = None, window_size=(-1, -1), softcap: float = 0.0,
                          learnable_sink=None, dsink=None):
    """(dq, dk, dv) like q, k, v, and with ``learnable_sink`` dsink (h_q,) float32 too;
    see fa4_aot.backward_varlen. Rows of no sequence are left as allocated (zeroed here,
    so that autograd sums them as no gradient); the workspace (uint8, with room for the
    heaviest-first order) comes from torch's allocator unless given; ``order``: the
    sequences' order (None: the policy's)."""
    check_packed({"q": q, "k": k, "v": v, "out": out, "dout": dout},
                 {"lse": lse, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                  **passed(seqused_q=seqused_q, seqused_k=seqused_k, dq=dq, dk=dk, dv=dv, workspace=workspace,
                           learnable_sink=learnable_sink, dsink=dsink)})
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if workspace is None:
        local = checks.score_mods(causal, window_size, softcap, learnable_sink is not None).local
        size = _backward_workspace_bytes(q.shape[0], cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[2],
                                         v.shape[-1], DTYPES.get(q.dtype), bool(causal), bool(deterministic), local,
                                         default_library())
        workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
    if learnable_sink is not None and dsink is None:
        dsink = torch.empty_like(learnable_sink, memory_format=torch.contiguous_format)
    used = {n: as_device_array(t) for n, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k),
                                                ("learnable_sink", learnable_sink), ("dsink", dsink)) if t is not None}
    backward_varlen(*(as_device_array(t) for t in (q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k)),
                    max_seqlen_q, max_seqlen_k, as_device_array(workspace), causal=causal,
                    softmax_scale=softmax_scale, deterministic=deterministic,
                    stream=torch.cuda.current_stream(q.device).cuda_stream, order=order, window_size=window_size,
                    softcap=softcap, **used)
    return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)


@functools.lru_cache(maxsize=256)
def _forward_order(batch: int, library) -> tuple[bool, int]:
    """(whether the policy orders ``batch`` sequences heaviest first, the workspace bytes
    that order takes), for ``library``'s kernels: asked once per batch size."""
    return default_forward_order(batch, library=library) == "lpt", forward_varlen_workspace_bytes(max(batch, 1),
                                                                                                  library=library)


@functools.lru_cache(maxsize=256)
def _backward_workspace_bytes(total_q, batch, heads_q, head_dim, head_dim_v, dtype, causal, deterministic, local,
                              library) -> int:
    """backward_varlen_workspace_bytes of a problem, kept per problem (a refusal is
    raised, not kept)."""
    return backward_varlen_workspace_bytes(total_q, batch, heads_q, head_dim, causal=causal,
                                           deterministic=deterministic, head_dim_v=head_dim_v, dtype=dtype,
                                           local=local, library=library)


@torch.library.custom_op("fa4_aot::bwd_varlen", mutates_args=(), device_types="cuda")
def _bwd_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, causal: bool,
                   softmax_scale: float, deterministic: bool, window_left: int = -1, window_right: int = -1,
                   softcap: float = 0.0, learnable_sink: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink); dsink empty (0,) without sinks."""
    grads = flash_attn_varlen_bwd(q, k, v, out, kernel_ready_dout(dout), lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  seqused_q=seqused_q, seqused_k=seqused_k, causal=causal,
                                  softmax_scale=softmax_scale, deterministic=deterministic,
                                  window_size=(window_left, window_right), softcap=softcap,
                                  learnable_sink=learnable_sink)
    return (*grads, q.new_empty((0,), dtype=torch.float32)) if learnable_sink is None else grads


@_bwd_varlen_op.register_fake
def _(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
      causal, softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0, learnable_sink=None):
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
            q.new_empty((0,) if learnable_sink is None else learnable_sink.shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, causal,
     softmax_scale, deterministic, left, right, softcap, sink) = (*inputs, -1, -1, 0.0, None)[:16]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sink)
    ctx.max_seqlen = (max_seqlen_q, max_seqlen_k)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
    ctx.window, ctx.softcap = (left, right), softcap


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sink = ctx.saved_tensors
    if not needs_grad(ctx, 15):
        sink = None  # no sinks' gradient asked for: none computed
    dq, dk, dv, dsink = _bwd_varlen_op(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlen,
                                       seqused_q, seqused_k, ctx.causal, ctx.softmax_scale, ctx.deterministic,
                                       *ctx.window, ctx.softcap, sink)
    return dq, dk, dv, *(None,) * 12, dsink if sink is not None else None


_fwd_varlen_op.register_autograd(_backward, setup_context=_setup_context)


class VarlenAttention(torch.autograd.Function):
    """Eager autograd over the varlen kernels: what ``fa4_aot::fwd_varlen`` and its
    registered autograd do (the same functions, the same results), without torch.library's
    per-call dispatch, which costs several times the launches' host time
    (fa4_aot.torch.autograd.FlashAttention, the dense twin); torch.compile traces the ops.
    A call without sinks or seqused takes the step's own repeat path (``_VarlenStep``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, causal,
                softmax_scale, deterministic, window_left, window_right, softcap, learnable_sink):
        ctx.step = None
        options = (causal, softmax_scale, deterministic, window_left, window_right, softcap)
        if learnable_sink is None and seqused_q is None and seqused_k is None and \
                _VarlenStep.takes(q, k, v, cu_seqlens_q, cu_seqlens_k):
            out, lse = _VarlenStep.forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           options)
        else:
            out, lse = flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             seqused_q=seqused_q, seqused_k=seqused_k, causal=causal,
                                             softmax_scale=softmax_scale, window_size=(window_left, window_right),
                                             softcap=softcap, learnable_sink=learnable_sink)
        _setup_context(ctx, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                             causal, softmax_scale, deterministic, window_left, window_right, softcap,
                             learnable_sink), (out, lse))
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return (None,) * 16
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sink = ctx.saved_tensors
        if ctx.step is not None and type(dout) is _Tensor:
            return (*_VarlenStep.backward(ctx, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, kernel_ready_dout(dout)),
                    *(None,) * 13)
        if not ctx.needs_input_grad[15]:
            sink = None  # no sinks' gradient asked for: none computed
        grads = flash_attn_varlen_bwd(q, k, v, out, kernel_ready_dout(dout), lse, cu_seqlens_q, cu_seqlens_k,
                                      *ctx.max_seqlen, seqused_q=seqused_q, seqused_k=seqused_k, causal=ctx.causal,
                                      softmax_scale=ctx.softmax_scale, deterministic=ctx.deterministic,
                                      window_size=ctx.window, softcap=ctx.softcap, learnable_sink=sink)
        return *grads[:3], *(None,) * 12, grads[3] if sink is not None else None


_Tensor = torch.Tensor


class _VarlenStep:
    """A training step's varlen attention (no sinks, no seqused) on its repeat path, as
    fa4_aot.torch.autograd._Step is the dense step's: the outputs, gradients and workspaces
    are made here, their sizes, strides and dtypes following from q's, k's, v's and the
    cu_seqlens' layouts, the max lengths and the options (the signature), so only their
    pointers join the keys beside the inputs'. A step whose launches were made before with
    the same signature and pointers (the caching allocator gives a training loop's the same
    ones step after step) launches them again with no check and no packing; a new key takes
    the checked path (run_forward_varlen, run_backward_varlen: every check, then the
    launches kept under it too). The kernels read cu_seqlens' values on the device, so a
    batch of other lengths in the same buffers repeats the same launches.
    (docs/design.md, "Run time: the host path")"""

    @staticmethod
    def takes(q, k, v, cu_seqlens_q, cu_seqlens_k) -> bool:
        """Plain CUDA tensors of the packed ranks (others take the checked path, whose
        checks say what is wrong with them)."""
        return (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and type(cu_seqlens_q) is _Tensor
                and type(cu_seqlens_k) is _Tensor and q.is_cuda and q.dim() == 3 and k.dim() == 3 and v.dim() == 3
                and cu_seqlens_q.dim() == 1 and cu_seqlens_k.dim() == 1)

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options):
        causal, scale, deterministic, left, right, softcap = options
        library, device = default_library(), q.get_device()
        signature = ("varlen step", q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(),
                     v.dtype, cu_seqlens_q.shape, cu_seqlens_q.stride(), cu_seqlens_q.dtype, cu_seqlens_k.shape,
                     cu_seqlens_k.stride(), cu_seqlens_k.dtype, max_seqlen_q, max_seqlen_k, device, *options, library)
        lpt, size = _forward_order(cu_seqlens_q.shape[0] - 1, library)
        out = q.new_empty((*q.shape[:2], v.shape[-1]))
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        workspace = torch.empty(size, dtype=torch.uint8, device=q.device) if lpt else None
        stream = current_stream(device)
        key = (signature, q.data_ptr(), k.data_ptr(), v.data_ptr(), cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(),
               out.data_ptr(), lse.data_ptr(), workspace.data_ptr() if lpt else 0, stream)
        if not library.launch_again(key):
            extra = {} if workspace is None else {"workspace": as_device_array(workspace)}
            run_forward_varlen(*(as_device_array(t) for t in (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)),
                               max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=scale,
                               window_size=(left, right), softcap=softcap, stream=stream, library=library,
                               aliases=((key, ()),), **extra)
        ctx.step = (signature, library)
        return out, lse

    @staticmethod
    def backward(ctx, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dout) -> tuple:
        """(dq, dk, dv) for the forward ``ctx`` keeps (its signature and library, ``ctx.step``):
        zeros where no sequence's rows are, as the checked path's."""
        signature, library = ctx.step
        left, right = ctx.window
        local = checks.score_mods(ctx.causal, ctx.window, ctx.softcap, False).local
        size = _backward_workspace_bytes(q.shape[0], cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[2], v.shape[-1],
                                         DTYPES.get(q.dtype), bool(ctx.causal), bool(ctx.deterministic), local,
                                         library)
        dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
        dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
        dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
        workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
        stream = current_stream(q.get_device())
        key = (signature, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), dout.data_ptr(),
               dout.shape, dout.stride(), dout.dtype, cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(),
               dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), workspace.data_ptr(), stream)
        if not library.launch_again(key):
            run_backward_varlen(*(as_device_array(t) for t in (q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q,
                                                                cu_seqlens_k)),
                                *ctx.max_seqlen, as_device_array(workspace), causal=ctx.causal,
                                softmax_scale=ctx.softmax_scale, deterministic=ctx.deterministic, stream=stream,
                                library=library, window_size=(left, right), softcap=ctx.softcap,
                                aliases=((key, ()),))
        return dq, dk, dv


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                           seqused_q=None, seqused_k=None, softmax_scale: float | None = None, causal: bool = False,
                           deterministic: bool = False, return_lse: bool = False, window_size=(-1, -1),
                           softcap: float = 0.0, learnable_sink=None):
    """flash-attn's varlen attention: q (total_q, h_q, d), k, v (total_k, h_kv, d),
    cu_seqlens int32 (batch + 1,) on the device, max_seqlen ints from the caller; see
    fa4_aot.forward_varlen. Differentiable (q, k, v; not through lse) and traceable by
    torch.compile (custom ops; eager calls: ``VarlenAttention``). ``deterministic``: the
    backward's dq is summed in a fixed order (the forward always is). ``window_size``,
    ``softcap``, ``learnable_sink``: as fa4_aot.forward_varlen's; the gradient flows to
    learnable_sink too."""
    extra = passed(seqused_q=seqused_q, seqused_k=seqused_k, learnable_sink=learnable_sink)
    check_packed({"q": q, "k": k, "v": v}, {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, **extra})
    check_on_gpu({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, **extra})
    scale = checks.softmax_scale(softmax_scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    max_q, max_k = checks.positive_int("max_seqlen_q", max_seqlen_q), checks.positive_int("max_seqlen_k", max_seqlen_k)
    causal = checks.flag("causal", causal)
    mods = checks.score_mods(causal, window_size, softcap, learnable_sink is not None)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_q, seqused_k,
            causal if mods.local else mods.causal, scale, checks.flag("deterministic", deterministic), mods.left,
            mods.right, mods.softcap, learnable_sink)
    # traced: the custom ops; eager: the autograd.Function over the same functions
    out, lse = _fwd_varlen_op(*args) if torch.compiler.is_compiling() else VarlenAttention.apply(*args)
    return (out, lse) if checks.flag("return_lse", return_lse) else out
