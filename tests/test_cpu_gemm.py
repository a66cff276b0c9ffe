"""The folded path's own GEMM (``lik_cupy/_cpu/gemm_kernels.py``, chosen by ``fold.tokens_first_gemm``):
its sums against float64 at every tail of tokens and rows, nothing written past its output, non-finite
values as float32 gives them, whole calls bit for bit BLAS's whichever the host, and the host rule."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import lik_cupy
from lik_cupy._cpu import fold

pytest.importorskip("numba")
gemm_kernels = pytest.importorskip("lik_cupy._cpu.gemm_kernels")


def _run(T, A):
    """``tokens_by_rows`` into an output inside a NaN-filled buffer: (the output, what lies past it)."""
    n, r = T.shape[0], A.shape[0]
    buf = np.full(n * r + 64, np.nan, np.float32)
    out = buf[:n * r].reshape(n, r)
    gemm_kernels.tokens_by_rows(T, gemm_kernels.pack(A), out)
    return out, buf[n * r:]


@pytest.mark.parametrize("d", [0, 1, 7, 96, 129])
@pytest.mark.parametrize("rows", [0, 1, 7, 16, 17, 33, 100])
def test_sums_against_float64_at_every_tail(rng, d, rows):
    """Tokens not a multiple of the tile's four, rows not a multiple of its sixteen, any d: each sum
    within float32's accumulated rounding of float64's, and nothing past the output written."""
    for n in (0, 1, 3, 4, 5, 203):
        T = rng.standard_normal((n, d)).astype(np.float32)
        A = (rng.standard_normal((rows, d)) * np.exp2(rng.integers(-8, 8, (rows, 1)))).astype(np.float32)
        out, past = _run(T, A)
        exact = T.astype(np.float64) @ A.T.astype(np.float64)
        bound = (d + 1) * 2.0 ** -24 * (np.abs(T).astype(np.float64) @ np.abs(A).T.astype(np.float64))
        assert np.all(np.abs(out - exact) <= bound), (n, rows, d)
        assert np.isnan(past).all(), (n, rows, d)


def test_each_sum_is_ascending_fused_multiply_adds(rng):
    """The order the module docstring states: ``s = fma(T[t, k], A[j, k], s)`` for k ascending, each step
    rounded once. Values of seven bits at scales 2^-8 .. 2^8 make each step's product and sum exact in
    float64, so one rounding to float32 is the fused step's, while float32's sums round often."""
    def values(shape):
        return (np.round(rng.standard_normal(shape) * 64) / 64 * np.exp2(rng.integers(-8, 9, shape))).astype(np.float32)
    T, A = values((9, 40)), values((21, 40))
    out, _ = _run(T, A)
    want = np.zeros((9, 21), np.float32)
    for k in range(40):
        want = (T[:, k, None].astype(np.float64) * A[None, :, k].astype(np.float64) + want).astype(np.float32)
    np.testing.assert_array_equal(out, want)


def test_non_finite_values_give_float32s_results(rng):
    """NaN, and infinities that meet a zero or each other, make NaN exactly where float64 does on values
    too small to overflow; an infinity alone, or two whose products share a sign, make an infinity."""
    T = rng.standard_normal((40, 24)).astype(np.float32)
    A = rng.standard_normal((20, 24)).astype(np.float32)
    T[3, 5] = np.nan
    T[7, 0] = np.inf
    T[8, 1], T[8, 2] = np.inf, -np.inf
    A[4, 0] = 0
    out, _ = _run(T, A)
    with np.errstate(invalid="ignore"):
        exact = T.astype(np.float64) @ A.T.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(exact))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(exact))
    assert np.isnan(out[3]).all() and np.isnan(out[7, 4]) and np.isinf(out[7, :4]).all()
    assert np.isnan(out[8]).any() and np.isinf(out[8]).any()  # +inf and -inf, as their rows' signs meet


def _calls(rng):
    """Calls that take the folded path: padded and packed, masks, 16-bit tokens, a NaN and a near tie."""
    q = rng.standard_normal((1, 37, 96)).astype(np.float32)
    d = rng.standard_normal((60, 45, 96)).astype(np.float32)
    d[5, 7] = d[5, 3] * np.float32(1 + 2.0 ** -22)  # two tokens whose similarities round alike in float32
    d[9, 2, 0] = np.nan
    lens = rng.integers(0, 80, 50)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tok = rng.standard_normal((int(off[-1]), 96)).astype(np.float32)
    return {
        "padded": lambda: lik_cupy.maxsim(q, d, d_lengths=rng.integers(0, 46, 60), backend="cpu", return_argmax=True),
        "packed": lambda: lik_cupy.maxsim_varlen(q[:, :17], tok, off, backend="cpu", return_argmax=True),
        "float16": lambda: lik_cupy.maxsim(q.astype(np.float16), d.astype(np.float16), backend="cpu",
                                           return_argmax=True),
    }


@pytest.mark.parametrize("call", ["padded", "packed", "float16"])
def test_whole_calls_are_blas_calls_bit_for_bit(rng, monkeypatch, call):
    """The scores and argmax do not depend on which GEMM filled the similarities (float64 decides every
    near tie), on this host whichever GEMM its rule picks."""
    assert fold.available()
    seen = []
    real = gemm_kernels.tokens_by_rows
    monkeypatch.setattr(fold, "_gemm", lambda *a: seen.append(1) or real(*a))
    state = rng.bit_generator.state
    own = _calls(rng)[call]()
    assert seen, "the own GEMM did not run"
    monkeypatch.setattr(fold, "_gemm", False)
    rng.bit_generator.state = state
    blas = _calls(rng)[call]()
    for a, b in zip(own, blas, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_kernel_takes_c_contiguous_float32_arrays_only(rng):
    """Its addresses assume rows of ``d`` values one after another: a strided or float64 array is
    refused when Numba types the call, before anything is read."""
    import numba

    A = rng.standard_normal((20, 32)).astype(np.float32)
    T = rng.standard_normal((50, 64)).astype(np.float32)
    for t, out in ((T[:, ::2], np.empty((50, 20), np.float32)), (T[:, :32].astype(np.float64), np.empty((50, 20), np.float32)),
                   (np.ascontiguousarray(T[:, ::2]), np.empty((50, 40), np.float32)[:, ::2])):
        with pytest.raises(numba.core.errors.TypingError):
            gemm_kernels.tokens_by_rows(t, gemm_kernels.pack(A), out)


def test_the_gemm_falls_back_to_blas_for_strided_tokens(rng, monkeypatch):
    monkeypatch.setattr(fold, "_gemm", gemm_kernels.tokens_by_rows)
    A = rng.standard_normal((20, 32)).astype(np.float32)
    T = rng.standard_normal((50, 64)).astype(np.float32)[:, ::2]
    out = np.empty((50, 20), np.float32)
    fold.tokens_first_gemm(A)(T, out)
    np.testing.assert_array_equal(out, np.matmul(T, A.T))


@pytest.mark.parametrize("features, own", [({"avx2": True, "fma": True}, True),
                                           ({"avx2": True, "fma": True, "avx512f": True}, False),
                                           ({"avx2": False, "fma": True}, False), ({}, False)])
def test_the_host_rule(monkeypatch, features, own):
    """The own GEMM where the host has AVX2 and FMA without AVX-512 (fold._OWN_GEMM_NEEDS, _UNLESS)."""
    from llvmlite import binding

    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: features)
    got = fold._build_gemm()
    assert (got is gemm_kernels.tokens_by_rows) if own else got is False


def test_a_gemm_that_miscomputes_warns_and_leaves_blas(monkeypatch):
    from llvmlite import binding

    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: {"avx2": True, "fma": True})
    monkeypatch.setattr(gemm_kernels, "tokens_by_rows", lambda T, Ap, out: out.fill(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fold._build_gemm() is False
    assert any("compiled GEMM is not used" in str(w.message) for w in caught)


@pytest.mark.parametrize("rows, own", [(fold._OWN_GEMM_MAX_ROWS, True), (fold._OWN_GEMM_MAX_ROWS + 1, False)])
def test_blas_keeps_the_gemm_of_many_rows(rng, monkeypatch, rows, own):
    seen = []
    monkeypatch.setattr(fold, "_gemm", lambda *a: seen.append(1) or gemm_kernels.tokens_by_rows(*a))
    A = rng.standard_normal((rows, 8)).astype(np.float32)
    T = rng.standard_normal((6, 8)).astype(np.float32)
    out = np.empty((6, rows), np.float32)
    fold.tokens_first_gemm(A)(T, out)
    assert bool(seen) == own
    np.testing.assert_allclose(out, T @ A.T, rtol=1e-5, atol=1e-5)
