"""maxsim_from_hidden (the fused projection head) on the CPU: scores, argmax and the gradients of Q,
H, W and bias against torch's ``F.linear -> F.normalize -> maxsim`` in float64 (lik_cupy.torch.maxsim
on the projected tensor, itself checked against autograd elsewhere, and a plain einsum once), through
the top-level function, lik_cupy.torch (its operators pass torch.library.opcheck) and lik_cupy.jax;
masks and lengths, no bias, no normalisation, the chunking, and the argument errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import lik_cupy

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import lik_cupy.torch as lt  # noqa: E402

NQ, LQ, ND, LD, HID, DIM = 3, 5, 7, 6, 24, 8


def _data(rng, dtype=np.float64, nq=NQ, nd=ND):
    Q = rng.standard_normal((nq, LQ, DIM))
    H = rng.standard_normal((nd, LD, HID))
    W = rng.standard_normal((DIM, HID)) / HID**0.5
    b = rng.standard_normal(DIM) * 0.1
    return [x.astype(dtype) for x in (Q, H, W, b)]


def _lengths(rng, n, limit, empty=()):
    lens = rng.integers(1, limit + 1, n)
    lens[list(empty)] = 0
    return lens


def _reference(Q, H, W, b, *, normalize=True, eps=1e-12, **valid):
    """Scores and argmax of the unfused pipeline on float64 torch tensors (autograd intact)."""
    D = F.linear(H, W, b)
    if normalize:
        D = F.normalize(D, dim=-1, eps=eps)
    return lt.maxsim(Q, D, return_argmax=True, **valid)


def _t(x, grad=False):
    return torch.tensor(np.asarray(x, np.float64), requires_grad=grad)


def _valid_cases(rng):
    q_len, d_len = _lengths(rng, NQ, LQ, empty=(1,)), _lengths(rng, ND, LD, empty=(2,))
    q_mask = np.arange(LQ)[None, :] < q_len[:, None]
    d_mask = rng.random((ND, LD)) < 0.6
    d_mask[4] = False
    yield "none", {}
    yield "lengths", {"q_lengths": q_len, "d_lengths": d_len}
    yield "masks", {"q_mask": q_mask, "d_mask": d_mask}


def _torch_valid(valid: dict) -> dict:
    return {k: torch.tensor(v) for k, v in valid.items()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_scores_and_gradients_match_unfused_float64(rng, bias, normalize):
    Q, H, W, b = _data(rng)
    b = b if bias else None
    for name, valid in _valid_cases(rng):
        tv = _torch_valid(valid)
        leaves = [_t(x, True) for x in (Q, H, W)] + ([_t(b, True)] if bias else [None])
        ref, ref_a = _reference(*leaves, normalize=normalize, **tv)
        scores, amax = lt.maxsim_from_hidden(*[x if x is None else x.detach() for x in leaves], **tv,
                                             normalize=normalize, return_argmax=True)
        assert torch.equal(amax, ref_a), name
        assert torch.allclose(scores, ref.detach(), rtol=1e-12, atol=1e-12, equal_nan=True), name
        g = torch.tensor(rng.standard_normal(ref.shape))
        g[torch.isinf(ref)] = 0  # an empty document's -inf score: no gradient either way
        want = torch.autograd.grad((ref.masked_fill(torch.isinf(ref), 0) * g).sum(), [x for x in leaves if x is not None])
        got = lik_cupy.maxsim_from_hidden_backward(g.numpy(), Q, H, W, b, amax.numpy(), valid.get("d_mask"),
                                                   d_lengths=valid.get("d_lengths"), normalize=normalize)
        assert (got[3] is None) == (not bias)
        for x, y, what in zip(got, want, "Q H W bias".split()):
            np.testing.assert_allclose(x, y.numpy(), rtol=1e-10, atol=1e-12, err_msg=f"{name}: d{what}")
        # through autograd
        ours = [x if x is None else x.detach().clone().requires_grad_() for x in leaves]
        s = lt.maxsim_from_hidden(*ours, **tv, normalize=normalize)
        (s.masked_fill(torch.isinf(s), 0) * g).sum().backward()
        for x, y, what in zip([x for x in ours if x is not None], want, "Q H W bias".split()):
            assert torch.allclose(x.grad, y, rtol=1e-10, atol=1e-12), f"{name}: autograd d{what}"


def test_matches_a_plain_einsum(rng):
    """The reference itself: the unfused pipeline written out (every token valid)."""
    Q, H, W, b = _data(rng)
    D = H @ W.T + b
    D /= np.linalg.norm(D, axis=-1, keepdims=True)
    want = np.einsum("isk,jtk->ijst", Q, D).max(axis=-1).sum(axis=-1)
    np.testing.assert_allclose(lik_cupy.maxsim_from_hidden(Q, H, W, b, backend="cpu"), want, rtol=1e-12)


def test_chunking_changes_nothing(rng):
    Q, H, W, b = _data(rng)
    d_len = _lengths(rng, ND, LD, empty=(3,))
    whole = lik_cupy.maxsim_from_hidden(Q, H, W, b, d_lengths=d_len, return_argmax=True)
    g = np.where(np.isinf(whole[0]), 0, rng.standard_normal(whole[0].shape))
    grads = lik_cupy.maxsim_from_hidden_backward(g, Q, H, W, b, whole[1], d_lengths=d_len)
    for budget in (1, LD * DIM * 8 * 2, LD * DIM * 8 * 3 + 5):  # one document per chunk, two, three
        s, a = lik_cupy.maxsim_from_hidden(Q, H, W, b, d_lengths=d_len, return_argmax=True, max_chunk_bytes=budget)
        assert np.array_equal(s, whole[0]) and np.array_equal(a, whole[1])
        for x, y in zip(lik_cupy.maxsim_from_hidden_backward(g, Q, H, W, b, a, d_lengths=d_len,
                                                             max_chunk_bytes=budget), grads):
            np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-15)


@pytest.mark.filterwarnings("error")  # infinite padding warned 'invalid value encountered in matmul'
def test_one_query_2d_and_masked_padding_never_read(rng):
    Q, H, W, b = _data(rng)
    d_len = _lengths(rng, ND, LD)
    H_nan = H.copy()
    for j, n in enumerate(d_len):
        H_nan[j, n:] = (np.nan, np.inf, -np.inf)[j % 3]  # padding may hold anything
    s = lik_cupy.maxsim_from_hidden(Q[1], H_nan, W, b, d_lengths=d_len, q_lengths=3)
    assert s.shape == (ND,)
    np.testing.assert_array_equal(s, lik_cupy.maxsim_from_hidden(Q[1:2, :3], H, W, b, d_lengths=d_len)[0])


def test_no_documents_or_no_tokens(rng):
    Q, H, W, b = _data(rng)
    s, a = lik_cupy.maxsim_from_hidden(Q, H[:0], W, b, return_argmax=True)
    assert s.shape == (NQ, 0) and a.shape == (NQ, 0, LQ)
    assert np.isneginf(lik_cupy.maxsim_from_hidden(Q, H[:, :0], W, b)).all()  # documents without tokens


def test_rows_at_the_eps_floor(rng):
    """A projected token below eps is scaled by 1/eps, not normalised (F.normalize), and so is its gradient."""
    Q, H, W, _ = _data(rng)
    H[0, 1] = 0
    H[2, 3] *= 1e-6
    eps = 1e-3
    leaves = [_t(x, True) for x in (Q, H, W)]
    ref, ref_a = _reference(*leaves, None, eps=eps)
    s, a = lik_cupy.maxsim_from_hidden(Q, H, W, eps=eps, return_argmax=True)
    np.testing.assert_allclose(s, ref.detach().numpy(), rtol=1e-12)
    g = rng.standard_normal(s.shape)
    want = torch.autograd.grad((ref * torch.tensor(g)).sum(), leaves)
    for x, y in zip(lik_cupy.maxsim_from_hidden_backward(g, Q, H, W, None, a, eps=eps), want):
        np.testing.assert_allclose(x, y.numpy(), rtol=1e-9, atol=1e-12)


def test_a_row_exactly_at_eps_is_normalised_as_torch_does(rng):
    """F.normalize divides by max(|x|, eps), and its gradient goes through the norm where |x| >= eps
    (clamp_min's backward): a row whose norm is exactly eps took the floor's gradient."""
    Q, H, _, _ = _data(rng)
    eps = 2.0**-10
    W = np.zeros((DIM, HID))
    W[:, :DIM] = np.eye(DIM)
    H[1, 2] = 0
    H[1, 2, 0] = eps  # projected to (eps, 0, ...): its norm is eps exactly
    Q[0, 0] = 0
    Q[0, 0, 0] = 5.0  # and it wins this query token
    leaves = [_t(x, True) for x in (Q, H, W)]
    ref, ref_a = _reference(*leaves, None, eps=eps)
    s, a = lik_cupy.maxsim_from_hidden(Q, H, W, eps=eps, return_argmax=True)
    assert a[0, 1, 0] == 2
    g = rng.standard_normal(s.shape)
    want = torch.autograd.grad((ref * torch.tensor(g)).sum(), leaves)
    for x, y in zip(lik_cupy.maxsim_from_hidden_backward(g, Q, H, W, None, a, eps=eps), want):
        np.testing.assert_allclose(x, y.numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_low_precision_inputs_keep_their_dtype(rng, dtype):
    """The CPU path computes in float64 from the inputs' values: the float64 scores of those values."""
    npd = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    Q, H, W, b = _data(rng, npd)
    s, a = lik_cupy.maxsim_from_hidden(Q, H, W, b, return_argmax=True, backend="cpu")  # (a GPU host too)
    want = lik_cupy.maxsim_from_hidden(*[x.astype(np.float64) for x in (Q, H, W, b)], backend="cpu")
    assert s.dtype == np.float32
    np.testing.assert_array_equal(s, want.astype(np.float32))
    grads = lik_cupy.maxsim_from_hidden_backward(np.ones(s.shape, np.float32), Q, H, W, b, a, backend="cpu")
    assert [x.dtype for x in grads] == [npd] * 4
    tq = torch.tensor(Q.astype(np.float32)).to(torch.bfloat16 if dtype == "bfloat16" else getattr(torch, dtype))
    th, tw, tb = (torch.tensor(x.astype(np.float32)).to(tq.dtype).requires_grad_() for x in (H, W, b))
    st = lt.maxsim_from_hidden(tq.requires_grad_(), th, tw, tb)
    st.sum().backward()
    assert st.dtype == torch.float32 and tq.grad.dtype == tq.dtype and tb.grad.dtype == tq.dtype


def test_opcheck(rng):
    op, bwd = torch.ops.lik_cupy.maxsim_from_hidden.default, torch.ops.lik_cupy.maxsim_from_hidden_backward.default
    Q, H, W, b = (_t(x, True) for x in _data(rng))
    d_len = torch.tensor(_lengths(rng, ND, LD, empty=(1,)))
    q_mask = torch.tensor(rng.random((NQ, LQ)) < 0.7)
    args = (Q, H, W, b, q_mask, None, None, d_len, True, 1e-12, True, LD * DIM * 8, None)
    torch.library.opcheck(op, args)
    plain = (Q.detach(), H.detach(), W.detach(), None, None, None, None, None, False, 1e-12, False, None, "fp32")
    torch.library.opcheck(op, plain, test_utils=("test_faketensor",))
    scores, amax = op(*args)
    g = torch.randn(scores.shape, dtype=torch.float64)
    g[torch.isinf(scores)] = 0
    torch.library.opcheck(bwd, (g, Q.detach(), H.detach(), W.detach(), None, amax, None, d_len, True, 1e-12, None,
                                None), test_utils=("test_schema", "test_faketensor"))


def test_compiles_without_graph_break(rng):
    Q, H, W, b = (_t(x, True) for x in _data(rng))

    def step(q, h, w, bb):
        return lt.maxsim_from_hidden(q, h, w, bb).logsumexp(dim=1).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    want = torch.autograd.grad(step(Q, H, W, b), (Q, H, W, b))
    got = torch.autograd.grad(compiled(Q, H, W, b), (Q, H, W, b))
    for x, y in zip(got, want):
        assert torch.allclose(x, y, rtol=1e-12, atol=1e-14)


def test_a_chunk_bound_past_int64_bounds_nothing(rng):
    """max_chunk_bytes = 2**64 (any int is taken) under torch.compile: torch's operator schema takes int64,
    and the call failed while tracing ('Expected a value of type Optional[int]'); it is no bound at all."""
    Q, H, W, b = (_t(x) for x in _data(rng))
    want = lik_cupy.maxsim_from_hidden(*(x.numpy() for x in (Q, H, W, b)))
    compiled = torch.compile(lambda q: lt.maxsim_from_hidden(q, H, W, b, max_chunk_bytes=2**64), backend="aot_eager",
                             fullgraph=True)
    assert np.array_equal(compiled(Q).numpy(), want)
    assert np.array_equal(lik_cupy.maxsim_from_hidden(*(x.numpy() for x in (Q, H, W, b)), max_chunk_bytes=2**64), want)


def test_grad_only_where_asked(rng):
    Q, H, W, b = (_t(x) for x in _data(rng))
    Q.requires_grad_()
    lt.maxsim_from_hidden(Q, H, W, b).sum().backward()
    assert Q.grad is not None and H.grad is None and W.grad is None and b.grad is None


@pytest.mark.parametrize("call, match", [
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W[:, :-1], b), r"W must be \[d, h\] = \[8, 24\] \(Q's dim, H's hidden size\); got shape \[8, 23\]"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b[:-1]), r"bias has shape \[7\]; expected \[8\]"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H[0], W, b), r"H must be hidden states \[Nd, Ld, h\]; got shape \[6, 24\]"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W.astype(np.float32), b), "W has dtype float32 but Q has float64"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, torch.tensor(H), W, b), "H is a torch array but Q is a numpy array"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b, eps=0.0), "eps must be a positive finite float"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b, eps=10**400),
     "eps must be a positive finite float"),  # (float() of it raised OverflowError)
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b, eps=np.float32(np.inf)),
     "eps must be a positive finite float"),  # (compared with float64's largest cast to float32: inf, so it passed)
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b, normalize="yes"), "normalize must be True or False"),
    (lambda Q, H, W, b: lt.maxsim_from_hidden(*(_t(x) for x in (Q, H, W, b)), normalize="no"),
     "normalize must be True or False"),  # (torch's wrapper once cast it to True)
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b, max_chunk_bytes=0), "max_chunk_bytes must be a positive int"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b, d_lengths=[1, 2]), r"d_lengths has shape \[2\]; expected \[7\]"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b, d_mask=np.ones((ND, LD - 1), bool)),
     r"d_mask has shape \[7, 5\]; expected \[7, 6\] \(H's shape without its last axis\)"),  # (was D's: no D here)
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden(Q, H, W, b, d_lengths=[7] * ND), "d_lengths"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden_backward(np.ones((NQ, ND)), Q, H, W, b, np.zeros((NQ, ND, LQ))),
     "argmax has dtype float64; expected int32"),
    (lambda Q, H, W, b: lik_cupy.maxsim_from_hidden_backward(np.ones((NQ, 2)), Q, H, W, b,
                                                             np.zeros((NQ, ND, LQ), np.int32)),
     r"grad_scores has shape \[3, 2\]; expected the scores' shape \[3, 7\]"),
])
def test_errors_name_the_argument(rng, call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call(*_data(rng))


@pytest.mark.filterwarnings("error")  # a float32 eps warned 'overflow encountered in cast' in its check
def test_numpy_scalar_options_are_taken(rng):
    """NumPy's scalars (from a config array, say) for the options, as Python's, also through torch's operator."""
    Q, H, W, b = _data(rng)
    want = lik_cupy.maxsim_from_hidden(Q, H, W, b, eps=1e-6, max_chunk_bytes=4096)
    got = lik_cupy.maxsim_from_hidden(Q, H, W, b, normalize=np.True_, eps=np.float32(1e-6),
                                      max_chunk_bytes=np.int64(4096))
    assert np.array_equal(got, want)
    got = lt.maxsim_from_hidden(*(_t(x) for x in (Q, H, W, b)), normalize=np.True_, eps=np.float32(1e-6),
                                max_chunk_bytes=np.int64(4096))
    assert np.array_equal(got.numpy(), want)


@pytest.mark.filterwarnings("error")
def test_row_kernels_take_any_valid_eps(monkeypatch):
    """The GPU row kernels (cuda_src/hidden.cu) get eps as a float32: an eps past float32's range, which
    the options take (any positive finite float), reaches them as inf, without a warning (it raised
    struct's OverflowError once the projection's GEMM had run)."""
    from lik_cupy._runtime import hidden

    packed = []
    monkeypatch.setattr(hidden, "_function", lambda entry, dtype, device: type("Kernel", (), {"ptr": 0}))
    monkeypatch.setattr(hidden, "launch_raw", lambda func, grid, threads, smem, stream, params, values:
                        packed.append(params.unpack(params.pack(*values))))
    hidden.launch_rows("lik_hidden_normalize", "bfloat16", 0, 3, (1, 2, 3, 3, 64, 1e39), 0)
    hidden.launch_rows("lik_hidden_normalize_grad", "float16", 0, 3, (1, 2, 3, 4, 3, 64, 1e-12), 0)
    assert packed[0] == (1, 2, 3, 3, 64, np.inf)
    assert packed[1][:6] == (1, 2, 3, 4, 3, 64) and packed[1][6] == np.float32(1e-12)


def test_jax_gradients(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import lik_cupy.jax as lj

    Q, H, W, b = _data(rng, np.float32)
    d_len = _lengths(rng, ND, LD, empty=(2,))
    d_len_bad = d_len.copy()
    d_len_bad[5] = LD + 1

    def loss(q, h, w, bb, lengths):
        s = lj.maxsim_from_hidden(q, h, w, bb, d_lengths=lengths, max_chunk_bytes=LD * DIM * 8 * 3)
        return jnp.where(jnp.isinf(s), 0, s).sum(), s

    with jax.default_device(jax.devices("cpu")[0]):  # the NumPy path (a GPU host's default device is its GPU)
        (_, s), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(Q, H, W, b, d_len)
    leaves = [_t(x, True) for x in (Q, H, W, b)]
    ref, _ = _reference(*leaves, d_lengths=torch.tensor(d_len))
    np.testing.assert_allclose(np.asarray(s), ref.detach().numpy(), rtol=1e-6)
    want = torch.autograd.grad(ref.masked_fill(torch.isinf(ref), 0).sum(), leaves)
    for x, y in zip(grads, want):
        assert x.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(x), y.numpy(), rtol=1e-5, atol=1e-5)
    with jax.default_device(jax.devices("cpu")[0]):
        bad = lj.maxsim_from_hidden(Q, H, W, None, d_lengths=d_len_bad)
    assert np.isnan(np.asarray(bad)[:, 5]).all() and not np.isnan(np.asarray(bad)[:, :5]).any()


def test_lik_adapter_translates_the_semantics(rng):
    """tests/lik_fused_head_adapter.py (how LIK's own tests reach us): LIK's ``b=``, a 1-D ``d_mask``,
    and 0 (no gradient) for a document with no valid token, where lik_cupy scores -inf."""
    from lik_fused_head_adapter import maxsim_from_hidden as adapted

    Q, H, W, b = (_t(x, True) for x in _data(rng))
    d_mask = torch.ones(ND, LD, dtype=torch.bool)
    d_mask[1] = False
    s = adapted(Q, H, W, b=b, d_mask=d_mask)
    assert (s[:, 1] == 0).all() and torch.isfinite(s).all()
    s.sum().backward()
    assert (H.grad[1] == 0).all()
    one = adapted(Q[:1].detach(), H[:1].detach(), W.detach(), d_mask=d_mask[0])
    assert torch.equal(one, lt.maxsim_from_hidden(Q[:1].detach(), H[:1].detach(), W.detach(), None, None, d_mask[:1]))


def test_torch_func_grad_and_vmap(rng):
    """torch.func's grad of every input, vmap over queries and per-sample gradients of W, against
    eager autograd and a loop of eager calls."""
    q, h, w, b = (torch.from_numpy(rng.standard_normal(s)) for s in ((3, 5, 8), (4, 7, 12), (8, 12), (8,)))
    dl = torch.tensor([7, 3, 0, 5])

    def loss(*xs):
        return lt.maxsim_from_hidden(*xs, d_lengths=dl).logsumexp(-1).sum()

    def eager(*xs):
        xs = [x.clone().requires_grad_() for x in xs]
        loss(*xs).backward()
        return [x.grad for x in xs]

    for got, want in zip(torch.func.grad(loss, argnums=(0, 1, 2, 3))(q, h, w, b), eager(q, h, w, b)):
        assert torch.equal(got, want)
    single = torch.func.vmap(lambda x: lt.maxsim_from_hidden(x, h, w, b, d_lengths=dl))(q)
    assert torch.equal(single, torch.stack([lt.maxsim_from_hidden(x, h, w, b, d_lengths=dl) for x in q]))
    per_w = torch.func.vmap(torch.func.grad(loss, argnums=2), in_dims=(0, None, None, None))(q[:, None], h, w, b)
    for i in range(3):
        assert torch.equal(per_w[i], eager(q[i:i + 1], h, w, b)[2])
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.func.grad(lambda x: torch.func.grad(loss, argnums=2)(q, h, x, b).sum())(w)


def test_where_the_one_pass_kernel_runs():
    """``_dispatch.choose_hidden_fused``: Hopper, 16-bit, d = 128, whole 128-byte boxes of H, and at most
    64 query rows, the narrowest width that holds them; the kernel's shared memory fits a block at each."""
    from lik_cupy._dispatch import SMEM_PER_BLOCK, choose_hidden_fused, tables
    from lik_cupy._runtime.hidden_maxsim import shared_bytes
    from lik_cupy._runtime.kernels import HIDDEN_FUSED

    assert choose_hidden_fused(90, "bfloat16", 128, 768, 32, 300_000) == 32
    assert choose_hidden_fused(90, "float16", 128, 64, 1, 1) == 32
    assert choose_hidden_fused(90, "float16", 128, 768, 33, 10) == 64
    assert choose_hidden_fused(90, "float16", 128, 768, 64, 10) == 64
    for args in [(90, "float16", 128, 768, 65, 10), (90, "float16", 128, 768, 0, 10), (90, "float16", 128, 768, 32, 0),
                 (89, "float16", 128, 768, 32, 10), (100, "float16", 128, 768, 32, 10), (90, "float32", 128, 768, 32, 10),
                 (90, "float16", 64, 768, 32, 10), (90, "float16", 128, 96, 32, 10), (90, "float16", 128, 0, 32, 10),
                 (90, "int8", 128, 768, 32, 10), (90, "float16", 128, 768, 32, 2**31 - 255)]:
        assert choose_hidden_fused(*args) is None, args
    for qn in tables.HIDDEN_FUSED_QN:
        assert shared_bytes(qn, tables.HIDDEN_FUSED_STAGES, tables.HIDDEN_FUSED_WARPGROUPS) <= SMEM_PER_BLOCK[90]
    assert HIDDEN_FUSED.target(90) == "90a" and HIDDEN_FUSED.target(89) is None and HIDDEN_FUSED.target(80) is None


def test_the_one_pass_kernel_leaves_masked_queries_and_lengths_to_the_pipeline(monkeypatch):
    """``fused_width``: query masks and lengths and document lengths (whose invalid values the pipeline's
    checks and NaN pass handle), a scratch past the call's ``max_chunk_bytes``, misaligned operands and
    wgmma or TMA turned off keep the streamed pipeline; the rest follows ``choose_hidden_fused``."""
    from lik_cupy._runtime import hidden_maxsim, tma
    from lik_cupy._validate import check_hidden

    class Props:
        cc = 90

    monkeypatch.setattr(hidden_maxsim, "device_properties", lambda device: Props)
    monkeypatch.setattr(tma, "available", lambda: True)
    rng = np.random.default_rng(0)
    Q = rng.standard_normal((1, 32, 128)).astype(ml_dtypes.bfloat16)
    H = rng.standard_normal((3, 10, 64)).astype(ml_dtypes.bfloat16)
    W = rng.standard_normal((128, 64)).astype(ml_dtypes.bfloat16)
    hp = check_hidden(Q, H, W, None, None, None, None, None)
    budget = 8 * 32 * 3  # the scratch: 8 bytes a query token and document
    assert hidden_maxsim.fused_width(hp, 0, None, None, None, budget) == 32
    assert hidden_maxsim.fused_width(hp, 0, None, None, None, budget - 1) is None
    assert hidden_maxsim.fused_width(hp, 0, np.ones((1, 32), bool), None, None, budget) is None
    assert hidden_maxsim.fused_width(hp, 0, None, [32], None, budget) is None
    assert hidden_maxsim.fused_width(hp, 0, None, None, [10, 10, 10], budget) is None
    assert hidden_maxsim.aligned(0, 256, 4096) and not hidden_maxsim.aligned(0, 8, 4096)
    monkeypatch.setenv("LIK_DISABLE_WGMMA", "1")
    assert hidden_maxsim.fused_width(hp, 0, None, None, None, budget) is None
    monkeypatch.delenv("LIK_DISABLE_WGMMA")
    monkeypatch.setenv("LIK_DISABLE_TMA", "1")
    assert hidden_maxsim.fused_width(hp, 0, None, None, None, budget) is None


def test_cpu_chunks_count_the_hidden_states_they_hold(rng):
    """A CPU chunk holds its tokens' hidden states in float64 besides their projection: counting the
    projection alone, h = 768 against d = 32 held about ten times max_chunk_bytes (a 4 MiB budget
    peaked at 42 MiB); the backward held a float64 dH the size of H besides."""
    import tracemalloc

    q = rng.standard_normal((2, 8, 32)).astype(np.float32)
    h = rng.standard_normal((200, 32, 768)).astype(np.float32)
    w = (rng.standard_normal((32, 768)) / 28).astype(np.float32)
    budget = 4 << 20
    tracemalloc.start()
    try:
        s, a = lik_cupy.maxsim_from_hidden(q, h, w, return_argmax=True, max_chunk_bytes=budget, backend="cpu")
        forward = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        grads = lik_cupy.maxsim_from_hidden_backward(np.ones_like(s), q, h, w, None, a, max_chunk_bytes=budget,
                                                     backend="cpu")
        backward = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert forward < budget * 3 // 2 + (1 << 20), forward
    assert backward < 2 * h.nbytes + budget * 3 // 2 + (1 << 20), backward  # dH and its copy in H's dtype
    whole = lik_cupy.maxsim_from_hidden_backward(np.ones_like(s), q, h, w, None, a, backend="cpu")
    for x, y in zip(grads[:3], whole[:3]):  # chunks change no value (dW: float64 sums, rounded once; no bias)
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_cpu_scores_alone_hold_no_argmax(rng):
    """Without return_argmax the CPU forward kept an int32 argmax of Lq entries a score all the same (and
    asked each chunk's MaxSim for one): 64 queries of 32 tokens against 4,000 documents held 109 MiB for
    1 MiB of scores (now 47); it holds the argmax only where asked."""
    import tracemalloc

    q = rng.standard_normal((32, 32, 8)).astype(np.float32)
    h = rng.standard_normal((2000, 2, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    peaks = []
    for return_argmax in (True, False):
        tracemalloc.start()
        try:
            out = lik_cupy.maxsim_from_hidden(q, h, w, return_argmax=return_argmax, backend="cpu")
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    with_argmax, alone = peaks
    amax_bytes = 32 * 2000 * 32 * 4
    assert alone + amax_bytes < with_argmax, (alone, with_argmax)
    np.testing.assert_array_equal(out, lik_cupy.maxsim_from_hidden(q, h, w, return_argmax=True, backend="cpu")[0])
