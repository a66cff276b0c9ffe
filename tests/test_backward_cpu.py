"""maxsim_backward on the NumPy path, and its argument checks (no GPU needed)."""

import numpy as np
import pytest

import lik_cupy


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _dense_grads(g, Q, Drows, amax, rows):
    """Reference through a one-hot of the argmax (a different formulation than the code's scatter)."""
    nq, nd, lq = amax.shape
    R = Drows.shape[0]
    onehot = np.zeros((nq, nd, lq, R))
    i, j, s = np.nonzero((amax >= 0) & (rows >= 0))
    onehot[i, j, s, rows[i, j, s]] = 1.0
    dQ = np.einsum("ij,ijsr,rk->isk", g.astype(np.float64), onehot, Drows.astype(np.float64))
    dD = np.einsum("ij,ijsr,isk->rk", g.astype(np.float64), onehot, Q.astype(np.float64))
    return dQ, dD


def test_in_batch_with_masks(rng):
    nq, lq, nd, ld, dim = 3, 7, 5, 9, 6
    Q, D = _f32(rng, nq, lq, dim), _f32(rng, nd, ld, dim)
    qm = rng.random((nq, lq)) < 0.8
    dm = rng.random((nd, ld)) < 0.7
    dm[2] = False  # empty document: argmax -1, no gradient
    s, a = lik_cupy.maxsim(Q, D, qm, dm, return_argmax=True, backend="cpu")
    g = _f32(rng, nq, nd)
    dQ, dD = lik_cupy.maxsim_backward(g, Q, D, a, backend="cpu")
    assert dQ.dtype == np.float32 and dQ.shape == Q.shape and dD.shape == D.shape
    rows = np.where(a >= 0, np.arange(nd)[None, :, None] * ld + a, -1)
    rq, rd = _dense_grads(g, Q, D.reshape(-1, dim), a, rows)
    np.testing.assert_allclose(dQ, rq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dD.reshape(-1, dim), rd, rtol=1e-5, atol=1e-5)
    assert not dD[2].any()  # the empty document gets nothing
    assert not dQ[~qm].any()  # masked query tokens get nothing


def test_candidates_layout(rng):
    nq, k, lq, ld, dim = 2, 3, 4, 5, 8
    Q, D = _f32(rng, nq, lq, dim), _f32(rng, nq, k, ld, dim)
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
    g = _f32(rng, nq, k)
    dQ, dD = lik_cupy.maxsim_backward(g, Q, D, a, backend="cpu")
    base = (np.arange(nq)[:, None, None] * k + np.arange(k)[None, :, None]) * ld
    rq, rd = _dense_grads(g, Q, D.reshape(-1, dim), a, base + a)
    np.testing.assert_allclose(dQ, rq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dD.reshape(-1, dim), rd, rtol=1e-5, atol=1e-5)


def test_packed_documents_and_2d_query(rng):
    lens = np.array([3, 0, 5, 1])
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    lq, dim = 6, 5
    Q, T = _f32(rng, lq, dim), _f32(rng, int(off[-1]), dim)
    s, a = lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True, backend="cpu")
    assert a.shape == (len(lens), lq)
    g = _f32(rng, len(lens))
    dQ, dT = lik_cupy.maxsim_backward(g, Q, T, a, d_offsets=off, backend="cpu")
    assert dQ.shape == Q.shape and dT.shape == T.shape
    rows = np.where(a >= 0, off[:-1][:, None] + a, -1)
    rq, rd = _dense_grads(g[None], Q[None], T, a[None], rows[None])
    np.testing.assert_allclose(dQ, rq[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dT, rd, rtol=1e-5, atol=1e-5)


def test_float16_in_float16_out(rng):
    Q, D = _f32(rng, 2, 4, 8).astype(np.float16), _f32(rng, 3, 5, 8).astype(np.float16)
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
    dQ, dD = lik_cupy.maxsim_backward(np.ones((2, 3), np.float32), Q, D, a, backend="cpu")
    assert dQ.dtype == np.float16 and dD.dtype == np.float16


def _setup(rng):
    Q, D = _f32(rng, 2, 4, 8), _f32(rng, 3, 5, 8)
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
    return Q, D, a, np.ones((2, 3), np.float32)


def test_argument_errors(rng):
    Q, D, a, g = _setup(rng)
    with pytest.raises(ValueError, match="method must be one of"):
        lik_cupy.maxsim_backward(g, Q, D, a, method="fast", backend="cpu")
    with pytest.raises(ValueError, match=r"grad_scores has shape \[3, 2\]; expected \[2, 3\]"):
        lik_cupy.maxsim_backward(g.T, Q, D, a, backend="cpu")
    with pytest.raises(TypeError, match="argmax must be the forward's int32 argmax, got dtype int64"):
        lik_cupy.maxsim_backward(g, Q, D, a.astype(np.int64), backend="cpu")
    with pytest.raises(ValueError, match=r"argmax has shape \[2, 3, 5\]; expected \[2, 3, 4\]"):
        lik_cupy.maxsim_backward(g, Q, D, np.zeros((2, 3, 5), np.int32), backend="cpu")
    with pytest.raises(TypeError, match="grad_scores must be floating point"):
        lik_cupy.maxsim_backward(g.astype(np.int32), Q, D, a, backend="cpu")
    with pytest.raises(ValueError, match="D has dim 7 but Q has dim 8"):
        lik_cupy.maxsim_backward(g, Q, D[..., :7], a, backend="cpu")


def test_argmax_values_checked(rng):
    Q, D, a, g = _setup(rng)
    bad = a.copy()
    bad[0, 0, 0] = 5  # Ld = 5: one past the end
    with pytest.raises(ValueError, match="past the end of its document"):
        lik_cupy.maxsim_backward(g, Q, D, bad, backend="cpu")
    bad[0, 0, 0] = -2
    with pytest.raises(ValueError, match="argmax holds -2"):
        lik_cupy.maxsim_backward(g, Q, D, bad, backend="cpu")


def test_bfloat16_inputs_and_gradient(rng):
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    Q, D = _f32(rng, 2, 4, 8).astype(bf), _f32(rng, 3, 5, 8).astype(bf)
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
    g = _f32(rng, 2, 3)
    dQ, dD = lik_cupy.maxsim_backward(g.astype(bf), Q, D, a, backend="cpu")
    assert dQ.dtype == bf and dD.dtype == bf
    rq, rd = lik_cupy.maxsim_backward(g.astype(bf).astype(np.float32), Q.astype(np.float32), D.astype(np.float32), a,
                                      backend="cpu")
    np.testing.assert_allclose(dQ.astype(np.float32), rq, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(dD.astype(np.float32), rd, rtol=1e-2, atol=1e-2)


def test_packed_offsets_as_a_list(rng):
    Q, T = _f32(rng, 2, 3, 4), _f32(rng, 6, 4)
    off = [0, 2, 2, 6]
    _, a = lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True, backend="cpu")
    dQ, dT = lik_cupy.maxsim_backward(np.ones((2, 3), np.float32), Q, T, a, d_offsets=off, backend="cpu")
    assert dQ.shape == Q.shape and dT.shape == T.shape and not dT[2:2].any()


def test_masked_padding_never_reaches_the_gradients():
    # the repro: a masked query token and a NaN padding row of the document
    Q = np.array([[[1, 0], [5, 5]]], np.float32)
    D = np.array([[[np.nan, np.nan], [2, 0]]], np.float32)
    s, a = lik_cupy.maxsim(Q, D, q_lengths=np.array([1]), d_mask=np.array([[False, True]]),
                           return_argmax=True, backend="cpu")
    assert a.tolist() == [[[1, -1]]]
    dQ, dD = lik_cupy.maxsim_backward(np.ones((1, 1), np.float32), Q, D, a, backend="cpu")
    assert dQ.tolist() == [[[2, 0], [0, 0]]]
    assert dD.tolist() == [[[0, 0], [1, 0]]]


@pytest.mark.parametrize("layout", ["padded", "candidates"])
def test_empty_document_with_nan_padding_does_not_poison_dq(rng, layout):
    nq, lq, dim = 2, 3, 4
    Q = _f32(rng, nq, lq, dim)
    shape = (3, 4, dim) if layout == "padded" else (nq, 3, 4, dim)
    D = _f32(rng, *shape)
    mask = np.ones(shape[:-1], bool)
    mask[..., 0, :] = False  # document 0 (of every candidate set) is empty ...
    D[..., 0, :, :] = np.nan  # ... and all NaN
    s, a = lik_cupy.maxsim(Q, D, d_mask=mask, return_argmax=True, backend="cpu")
    assert (a[:, 0] == -1).all()
    dQ, dD = lik_cupy.maxsim_backward(np.ones(s.shape, np.float32), Q, D, a, backend="cpu")
    assert np.isfinite(dQ).all() and np.isfinite(dD).all()
    assert not dD[..., 0, :, :].any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradients_overflow_to_inf_whatever_numpys_error_state(dtype):
    """A gradient past its dtype's range is inf (and one below its subnormals 0), as float64's
    arithmetic and the rounding to the input's dtype make it, whatever the caller's ``np.seterr``
    (the cast, or float64's own product, raised FloatingPointError or warned)."""
    big = 1e30 if dtype == np.float32 else 1e300
    Q = np.array([[[big, 0], [1 / big, 0]]], dtype)
    D = np.array([[[big, 0], [0, 1]]], dtype)
    s, a = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
    assert a.tolist() == [[[0, 0]]]
    with np.errstate(all="raise"):
        dQ, dD = lik_cupy.maxsim_backward(np.array([[big]], dtype), Q, D, a, backend="cpu")
        tiny_q, tiny_d = lik_cupy.maxsim_backward(np.array([[1 / big]], dtype), Q[:, 1:], D, a[..., 1:], backend="cpu")
    assert dQ.dtype == dtype and dD.dtype == dtype
    assert dQ[0, :, 0].tolist() == [np.inf, np.inf] and dD[0, 0, 0] == np.inf
    assert dQ[0, :, 1].tolist() == [0, 0] and dD[0, 1].tolist() == [0, 0]
    assert tiny_q[0, 0, 0] == 1 and tiny_d[0, 0, 0] == 0  # 1 / big**2


def test_numpy_scalar_gradient_of_a_scalar_score(rng):
    """One query [Lq, d] against one document [Ld, d] scores a 0-d array, and NumPy's arithmetic on
    it gives a NumPy scalar (2 * s is np.float32): maxsim_backward refused that as grad_scores with
    'expected a NumPy, CuPy, PyTorch or JAX array ..., got float32'. A NumPy scalar is a 0-d array."""
    Q, D = _f32(rng, 3, 4), _f32(rng, 5, 4)
    s, a = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
    g = 2 * s
    assert isinstance(g, np.generic)
    dQ, dD = lik_cupy.maxsim_backward(g, Q, D, a, backend="cpu")
    rQ, rD = lik_cupy.maxsim_backward(np.asarray(g), Q, D, a, backend="cpu")
    np.testing.assert_array_equal(dQ, rQ)
    np.testing.assert_array_equal(dD, rD)
    with pytest.raises(ValueError, match=r"grad_scores has shape \[\]; expected \[2\]"):
        lik_cupy.maxsim_backward(np.float32(1), Q[None].repeat(2, 0), D, a[None].repeat(2, 0), backend="cpu")
