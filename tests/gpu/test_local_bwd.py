"""The local backward kernels (sliding windows, attention sinks, softcap) against float32
autograd of the reference with the window, sinks and cap applied, on an sm_90 GPU: dense
and varlen, every built local backward (the capped ones at caps 50 and 2), the forward tests' windows (0, 1, inside a tile, off the tile sizes,
past the sequence, left-only, right-only, both, with causal, sinks alone), GQA/MQA,
seqlen_q != seqlen_k, rows that see no key, varlen mixes with empty sequences; the sinks'
gradient; bitwise repeats where deterministic; the torch layer's autograd and its
torch.compile trace. Gradients and workspace NaN-poisoned, inputs fresh; the tolerance is
test_bwd.check_grads' (twice the worse of PyTorch's low-precision autograd and the
flash recipe from the kernels' own 16-bit output), the sinks' gradient likewise."""

import pytest

torch = pytest.importorskip("torch")

import fa4_aot  # noqa: E402
from fa4_aot.errors import DTypeError, OptionError, OverlapError, ShapeError  # noqa: E402
from fa4_aot.torch import flash_attn_bwd, flash_attn_fwd  # noqa: E402
from fa4_aot.variants import MATRIX  # noqa: E402

from ..reference import attention_bwd_from_out, attention_bwd_tensor_cores, attention_ref, check_attention  # noqa: E402
from .test_fwd import DTYPES, _inputs  # noqa: E402
from .test_local import CASE_IDS, CASES, MIXES, SHAPES, _cap, _sinks  # noqa: E402
from .test_varlen import _lengths_to_cu, _packed  # noqa: E402

BWD_LOCAL = [v for v in MATRIX if v.kind == "bwd" and v.local and not v.varlen]
BWD_LOCAL_VARLEN = [v for v in MATRIX if v.kind == "bwd" and v.local and v.varlen]


def _window(case):
    left, right, causal, _ = case
    return left, 0 if causal else right


def _reference(q, k, v, dout, window, sinks, upcast, cap=0.0):
    """Autograd through attention_ref: [dq, dk, dv, dsink or None] and the LSE."""
    leaves = [x.detach().clone().float() if upcast else x.detach().clone() for x in (q, k, v)]
    sink = None if sinks is None else sinks.detach().clone()
    for x in leaves + ([sink] if sink is not None else []):
        x.requires_grad_(True)
    out, lse = attention_ref(*leaves, window=window, sink=sink, upcast=upcast, softcap=cap)
    out.backward(dout.float() if upcast else dout)
    return [x.grad for x in leaves] + [None if sink is None else sink.grad], lse.detach()


def grad_errors(got, q, k, v, dout, out, window, sinks, cap=0.0):
    """[(error, tolerance)] of dq, dk, dv (and dsink where ``sinks``): test_bwd.check_grads'
    rule with the window and sinks. dsink's own recipe: -sum exp(sink - lse) rowsum(dO o
    out) over the rows, from the kernels' 16-bit out (what the kernels compute, with
    float32 sums); its floor 1e-6 of the terms' magnitude (the order of the float32 sum)."""
    ref, lse = _reference(q, k, v, dout, window, sinks, True, cap)
    low, _ = _reference(q, k, v, dout, window, sinks, False, cap)
    recipe = attention_bwd_from_out(q, k, v, dout, out, operands=q.dtype, window=window, sink=sinks, softcap=cap)
    cores = attention_bwd_tensor_cores(q, k, v, dout, out, window=window, sink=sinks, softcap=cap)
    err = lambda x, r: (x.float() - r).abs().max().item()  # noqa: E731
    checks = []
    for g, r, lo, re, tc in zip(got[:3], ref, low, recipe, cores):
        tol = 2 * max(err(lo, r), err(re.to(q.dtype), r), err(tc.to(q.dtype), r)) + 1e-5
        checks.append((err(g, r), tol, g.isnan().any().item()))
    if sinks is not None:
        dsum = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (b, h, s_q)
        terms = -torch.exp(sinks[None, :, None] - lse) * dsum
        own = terms.sum((0, 2))
        tol = 2 * max(err(low[3], ref[3]), err(own, ref[3])) + 1e-6 * (terms.abs().sum().item() + 1)
        checks.append((err(got[3], ref[3]), tol, got[3].isnan().any().item()))
    return checks


def _assert_within(checks, what=""):
    for name, (e, tol, nan) in zip(("dq", "dk", "dv", "dsink"), checks):
        assert not nan, f"{what}{name} has NaN (unwritten) elements"
        assert e <= tol, f"{what}{name} max error {e:.3e} > {tol:.3e}"


def _workspace(q, deterministic):
    """NaN bytes (0xff) the size the backward asks: the kernels clear or overwrite what they read."""
    b, s_q, h_q, d = q.shape
    size = fa4_aot.backward_workspace_bytes(b, s_q, h_q, d, deterministic=deterministic, local=True)
    return torch.full((size,), 0xFF, dtype=torch.uint8, device=q.device)


def _run(variant, case, shape, gen, cap=0.0):
    """Forward and backward of one case (the forward checked against the reference first,
    so the recipe measures the math): (q, k, v, dout, out, sinks, grads)."""
    left, right, causal, sink = case
    q, k, v = _inputs(shape, variant.head_dim, DTYPES[variant.dtype], gen)
    dout = torch.randn_like(q)
    sinks = _sinks(shape[3], gen) if sink else None
    out, lse = flash_attn_fwd(q, k, v, causal=causal, window_size=(left, right), learnable_sink=sinks, softcap=cap)
    check_attention(out, lse, q, k, v, False, what=f"forward {shape}: ", window=_window(case), sink=sinks,
                    softcap=cap)
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    dsink = None if sinks is None else torch.full_like(sinks, float("nan"))
    got = flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, deterministic=variant.deterministic,
                         window_size=(left, right), learnable_sink=sinks, dsink=dsink, dq=grads[0], dk=grads[1],
                         dv=grads[2], workspace=_workspace(q, variant.deterministic), softcap=cap)
    torch.cuda.synchronize()
    assert all(g is h for g, h in zip(got, grads + ([dsink] if sink else [])))
    return q, k, v, dout, out, sinks, got


@pytest.mark.parametrize("variant", BWD_LOCAL, ids=lambda v: v.name)
@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_local_backward_matches_reference(variant, case, gen):
    cap = _cap(variant, case)
    for shape in SHAPES:
        q, k, v, dout, out, sinks, got = _run(variant, CASES[case], shape, gen, cap)
        _assert_within(grad_errors(got, q, k, v, dout, out, _window(CASES[case]), sinks, cap), f"{shape}: ")


@pytest.mark.parametrize("variant", [v for v in BWD_LOCAL if v.head_dim == 64], ids=lambda v: v.name)
@pytest.mark.parametrize("case", [5, 4], ids=[CASE_IDS[5], CASE_IDS[4]])
def test_local_backward_with_more_items_than_multiprocessors(variant, case, gen):
    """512 (key tile, KV head, batch) items, about four per SM of an H200: the persistent
    kernel (head_dim 64 bf16, not deterministic) walks several each, every item its own
    window range; the others launch past one wave."""
    cap = _cap(variant, case)
    q, k, v, dout, out, sinks, got = _run(variant, CASES[case], (8, 2000, 2000, 4, 4), gen, cap)
    _assert_within(grad_errors(got, q, k, v, dout, out, _window(CASES[case]), sinks, cap))


@pytest.mark.parametrize("variant", [v for v in BWD_LOCAL if v.head_dim == 64 and not v.deterministic],
                         ids=lambda v: v.name)
def test_local_backward_past_4096_keys(variant, gen):
    """Past 4096 keys the local backward still stores each query tile's first dQ share
    (policy.first_write_dq counts the window's span) where the plain kernels have the
    preprocess clear the accumulator: gpt-oss's window and sinks, GQA 4, 4200 keys."""
    q, k, v, dout, out, sinks, got = _run(variant, CASES[5], (1, 4200, 4200, 8, 2), gen, _cap(variant, 5))
    _assert_within(grad_errors(got, q, k, v, dout, out, _window(CASES[5]), sinks, _cap(variant, 5)))


@pytest.mark.parametrize("variant", [v for v in BWD_LOCAL + BWD_LOCAL_VARLEN if v.deterministic],
                         ids=lambda v: v.name)
def test_local_deterministic_backward_is_bitwise_repeatable(variant, gen):
    """Twice on the same inputs (window and sinks): the same bits, dsink included."""
    shape = (2, 1000, 1000, 4, 2)
    q, k, v = _inputs(shape, variant.head_dim, DTYPES[variant.dtype], gen)
    dout, sinks = torch.randn_like(q), _sinks(4, gen)
    options = {"causal": True, "window_size": (300, 0), "learnable_sink": sinks,
               "softcap": 30.0 if variant.softcap else 0.0}
    if variant.varlen:
        from fa4_aot.torch import flash_attn_varlen_bwd, flash_attn_varlen_fwd

        cu = _lengths_to_cu([1000, 1000])
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v, dout)]
        out, lse = flash_attn_varlen_fwd(*flat[:3], cu, cu, 1000, 1000, **options)
        runs = [flash_attn_varlen_bwd(*flat[:3], out, flat[3], lse, cu, cu, 1000, 1000, deterministic=True,
                                      **options) for _ in range(2)]
    else:
        out, lse = flash_attn_fwd(q, k, v, **options)
        runs = [flash_attn_bwd(q, k, v, out, dout, lse, deterministic=True, **options) for _ in range(2)]
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), *runs):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("variant", BWD_LOCAL_VARLEN, ids=lambda v: v.name)
@pytest.mark.parametrize("case", [0, 1, 4, 5, 6, 7, 8], ids=[CASE_IDS[i] for i in (0, 1, 4, 5, 6, 7, 8)])
def test_local_varlen_backward_matches_reference(variant, case, gen):
    """Each sequence's window within it; a sequence of no keys gets dq 0, one of no
    queries dk, dv 0; dsink sums every sequence's rows."""
    _check_varlen_backward(variant, case, MIXES, gen)


@pytest.mark.parametrize("variant", [v for v in BWD_LOCAL_VARLEN if v.head_dim == 64 and not v.deterministic],
                         ids=lambda v: v.name)
def test_local_varlen_backward_past_4096_keys(variant, gen):
    """As the dense test past 4096 keys: the first dQ shares stored (the window's span
    counted, policy.first_write_dq) beside an empty sequence and rows that see no key."""
    _check_varlen_backward(variant, 5, [([4200, 0, 130], [4300, 7, 100], 8, 2)], gen)


def _check_varlen_backward(variant, case, mixes, gen):
    """The varlen backward of CASES[case] on each of ``mixes`` ((lengths_q, lengths_k,
    heads_q, heads_kv)) against the reference, sequence by sequence."""
    from fa4_aot.torch import flash_attn_varlen_bwd, flash_attn_varlen_fwd

    left, right, causal, sink = CASES[case]
    cap = _cap(variant, case)
    dtype, d = DTYPES[variant.dtype], variant.head_dim
    for lq, lk, hq, hkv in mixes:
        q, k, v = _packed(lq, hq, d, dtype, gen), _packed(lk, hkv, d, dtype, gen), _packed(lk, hkv, d, dtype, gen)
        dout = torch.randn_like(q)
        sinks = _sinks(hq, gen) if sink else None
        cu_q, cu_k = _lengths_to_cu(lq), _lengths_to_cu(lk)
        out, lse = flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                         window_size=(left, right), learnable_sink=sinks, softcap=cap)
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        dsink = None if sinks is None else torch.full_like(sinks, float("nan"))
        flash_attn_varlen_bwd(q, k, v, out, dout, lse, cu_q, cu_k, max(lq), max(lk), causal=causal,
                              deterministic=variant.deterministic, window_size=(left, right), learnable_sink=sinks,
                              dsink=dsink, dq=grads[0], dk=grads[1], dv=grads[2], softcap=cap)
        torch.cuda.synchronize()
        dq, dk, dv = grads
        at_q = at_k = 0
        sink_ref, sink_tol = 0.0, 0.0
        for sq, sk in zip(lq, lk):
            what = f"sequence {sq} x {sk}: "
            rows_q, rows_k = slice(at_q, at_q + sq), slice(at_k, at_k + sk)
            if sq and sk:
                one = lambda x, rows: x[rows][None]  # noqa: E731
                got = [one(dq, rows_q), one(dk, rows_k), one(dv, rows_k)]
                if sinks is not None:
                    got.append(torch.zeros_like(sinks))  # the sum is checked below
                checks = grad_errors(got, one(q, rows_q), one(k, rows_k), one(v, rows_k), one(dout, rows_q),
                                     one(out, rows_q), _window(CASES[case]), sinks, cap)
                _assert_within(checks[:3], what)
                if sinks is not None:
                    ref, _ = _reference(one(q, rows_q), one(k, rows_k), one(v, rows_k), one(dout, rows_q),
                                        _window(CASES[case]), sinks, True, cap)
                    sink_ref, sink_tol = sink_ref + ref[3], sink_tol + checks[3][1]
            else:  # no keys: dq 0; no queries: dk, dv 0
                assert torch.equal(dq[rows_q], torch.zeros_like(dq[rows_q])), what
                assert torch.equal(dk[rows_k], torch.zeros_like(dk[rows_k])), what
                assert torch.equal(dv[rows_k], torch.zeros_like(dv[rows_k])), what
            at_q, at_k = at_q + sq, at_k + sk
        if sinks is not None:
            assert not dsink.isnan().any()
            err = (dsink - sink_ref).abs().max().item()
            assert err <= sink_tol, f"dsink max error {err:.3e} > {sink_tol:.3e}"


def test_local_func_gradients_reach_q_k_v_and_the_sinks(gen):
    """flash_attn_func (GQA, causal with a window, sinks, a cap of 30): autograd gives q,
    k, v and the sinks their gradients, as the reference's; flash_attn_varlen_func the same."""
    from fa4_aot.torch import flash_attn_func, flash_attn_varlen_func

    shape = (2, 700, 700, 8, 2)
    q, k, v = _inputs(shape, 64, torch.bfloat16, gen)
    dout, sinks = torch.randn_like(q), _sinks(8, gen)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    out = flash_attn_func(*leaves[:3], causal=True, window_size=(128, 0), learnable_sink=leaves[3], softcap=30.0)
    out.backward(dout)
    _assert_within(grad_errors([x.grad for x in leaves], q, k, v, dout, out.detach(), (128, 0), sinks, 30.0))
    packed = [x.detach().clone().reshape(-1, *x.shape[2:]).requires_grad_() for x in (q, k, v)]
    sink_leaf = sinks.detach().clone().requires_grad_()
    cu = _lengths_to_cu([700, 700])
    flat = flash_attn_varlen_func(*packed, cu, cu, 700, 700, causal=True, window_size=(128, 0),
                                  learnable_sink=sink_leaf, softcap=30.0)
    flat.backward(dout.reshape(-1, 8, 64))
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), [x.grad.reshape(y.shape) for x, y in zip(packed, leaves)]
                          + [sink_leaf.grad], [x.grad for x in leaves]):
        tol = 1e-5 + (1e-2 if name != "dsink" else 1e-4) * b.abs().max().item()  # two orders of one sum
        assert (a.float() - b.float()).abs().max().item() <= tol, name


def test_local_func_backward_traces_under_torch_compile(gen):
    """flash_attn_func with a window and sinks under torch.compile: forward and backward
    custom ops, the eager call's gradients bit for bit (deterministic)."""
    from fa4_aot.torch import flash_attn_func

    q, k, v = _inputs((2, 300, 300, 4, 2), 64, torch.bfloat16, gen)
    sinks = _sinks(4, gen)

    def loss(q, k, v, sinks):
        out = flash_attn_func(q, k, v, causal=True, window_size=(100, 0), learnable_sink=sinks, deterministic=True,
                              softcap=30.0)
        return (out.float() ** 2).sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), *grads):
        assert torch.equal(a, b), name


def test_local_backward_refusals_write_nothing(gen):
    """Typed errors before any launch: a dsink without sinks, a dsink of the wrong shape,
    dtype or place (over dq), a bad window or cap; the gradients stay NaN."""
    q, k, v = _inputs((1, 64, 64, 4, 2), 64, torch.bfloat16, gen)
    out, lse = flash_attn_fwd(q, k, v, window_size=(16, 0))
    sinks = torch.zeros(4, device="cuda")
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    bad = [({"softcap": -1.0}, OptionError), ({"softcap": float("nan")}, OptionError),
           ({"dsink": torch.zeros(4, device="cuda")}, OptionError),
           ({"learnable_sink": sinks, "dsink": torch.zeros(3, device="cuda")}, ShapeError),
           ({"learnable_sink": sinks, "dsink": torch.zeros(4, device="cuda", dtype=torch.bfloat16)}, DTypeError),
           ({"learnable_sink": sinks, "dsink": grads[0].view(-1)[:8].view(torch.float32)}, OverlapError),
           ({"window_size": (-3, 0)}, OptionError)]
    for options, error in bad:
        with pytest.raises(error):
            flash_attn_bwd(q, k, v, out, torch.randn_like(q), lse, dq=grads[0], dk=grads[1], dv=grads[2],
                           **{"window_size": (16, 0), **options})
        torch.cuda.synchronize()
        assert all(g.isnan().all() for g in grads), options
    # a dsink alone is refused even right after a good call with every other tensor the
    # same (a repeat of that call's launches must not stand in for the checks)
    dout = torch.randn_like(q)
    same = {"dq": grads[0], "dk": grads[1], "dv": grads[2], "window_size": (16, 0),
            "workspace": torch.empty(fa4_aot.backward_workspace_bytes(1, 64, 4, 64, local=True), dtype=torch.uint8,
                                     device="cuda")}
    flash_attn_bwd(q, k, v, out, dout, lse, **same)
    with pytest.raises(OptionError):
        flash_attn_bwd(q, k, v, out, dout, lse, **same, dsink=torch.zeros(4, device="cuda"))
