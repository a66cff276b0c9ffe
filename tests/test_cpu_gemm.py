"""The folded path's own GEMM (``lik_cupy/_cpu/gemm_kernels.py``, chosen by ``fold.tokens_first_gemm``):
its sums against float64 at every tail of tokens and rows, nothing written past its output, non-finite
values as float32 gives them, whole calls bit for bit BLAS's whichever the host, and the host rule."""

from __future__ import annotations

import warnings

import numba
import numpy as np
import pytest

import lik_cupy
from lik_cupy._cpu import fold

pytest.importorskip("numba")
gemm_kernels = pytest.importorskip("lik_cupy._cpu.gemm_kernels")


@pytest.fixture
def folding():
    """The compiled fold, where these tests' whole calls need it (Numba switched off: skipped)."""
    if not fold.available():
        pytest.skip("the compiled fold is off (LIK_DISABLE_NUMBA) or failed to build")


def _run(T, A, lanes=8):
    """``tokens_by_rows`` with tiles of ``lanes``-wide vectors into an output inside a NaN-filled buffer:
    (the output, what lies past it)."""
    n, r = T.shape[0], A.shape[0]
    buf = np.full(n * r + 64, np.nan, np.float32)
    out = buf[:n * r].reshape(n, r)
    gemm_kernels.tokens_by_rows(T, gemm_kernels.pack(A, lanes), out)
    return out, buf[n * r:]


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("d", [0, 1, 7, 96, 129])
@pytest.mark.parametrize("rows", [0, 1, 7, 16, 17, 31, 32, 33, 100])
def test_sums_against_float64_at_every_tail(rng, d, rows, lanes):
    """Tokens not a multiple of the tile's four, rows not a multiple of its 16 or 32, any d: each sum
    within float32's accumulated rounding of float64's, and nothing past the output written."""
    for n in (0, 1, 3, 4, 5, 203):
        T = rng.standard_normal((n, d)).astype(np.float32)
        A = (rng.standard_normal((rows, d)) * np.exp2(rng.integers(-8, 8, (rows, 1)))).astype(np.float32)
        out, past = _run(T, A, lanes)
        exact = T.astype(np.float64) @ A.T.astype(np.float64)
        bound = (d + 1) * 2.0 ** -24 * (np.abs(T).astype(np.float64) @ np.abs(A).T.astype(np.float64))
        assert np.all(np.abs(out - exact) <= bound), (n, rows, d)
        assert np.isnan(past).all(), (n, rows, d)


@pytest.mark.parametrize("lanes", [8, 16])
def test_each_sum_is_ascending_fused_multiply_adds(rng, lanes):
    """The order the module docstring states: ``s = fma(T[t, k], A[j, k], s)`` for k ascending, each step
    rounded once. Values of at most nine bits at scales 2^-8 .. 2^8 make each step's product and sum exact
    in float64, so one rounding to float32 is the fused step's, while float32's sums round often."""
    def values(shape):
        return (np.round(rng.standard_normal(shape) * 64) / 64 * np.exp2(rng.integers(-8, 9, shape))).astype(np.float32)
    T, A = values((9, 40)), values((21, 40))
    out, _ = _run(T, A, lanes)
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
    A[0, 1:3], A[1, 1:3] = (1, 1), (1, -1)  # inf - inf, and inf + inf
    out, _ = _run(T, A)
    with np.errstate(invalid="ignore"):
        exact = T.astype(np.float64) @ A.T.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(exact))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(exact))
    assert np.isnan(out[3]).all() and np.isnan(out[7, 4]) and np.isinf(out[7, :4]).all()
    assert np.isnan(out[8, 0]) and out[8, 1] == np.inf


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


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("call", ["padded", "packed", "float16"])
def test_whole_calls_are_blas_calls_bit_for_bit(rng, monkeypatch, folding, call, lanes):
    """The scores and argmax do not depend on which GEMM filled the similarities (float64 decides every
    near tie): the kernel, at either vector width, and BLAS forced in turn, whatever the host's rule."""
    seen = []
    real = gemm_kernels.tokens_by_rows
    monkeypatch.setattr(fold, "_gemm", (lambda *a: seen.append(1) or real(*a), lanes, 512))
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
    monkeypatch.setattr(fold, "_gemm", (gemm_kernels.tokens_by_rows, 8, 512))
    A = rng.standard_normal((20, 32)).astype(np.float32)
    T = rng.standard_normal((50, 64)).astype(np.float32)[:, ::2]
    out = np.empty((50, 20), np.float32)
    fold.tokens_first_gemm(A)(T, out)
    np.testing.assert_array_equal(out, np.matmul(T, A.T))


@pytest.mark.parametrize("features, rule", [({"avx2": True, "fma": True}, (8, 512)),
                                            ({"avx2": True, "fma": True, "avx512f": True}, (16, 64)),
                                            ({"avx512f": True}, (16, 64)),
                                            ({"avx2": False, "fma": True}, None), ({"avx2": True}, None), ({}, None)])
def test_the_host_rule(monkeypatch, features, rule):
    """Tiles of 16 lanes for up to 64 rows with AVX-512, of 8 for up to 512 with AVX2 and FMA, else BLAS
    (``fold._OWN_GEMM``)."""
    from llvmlite import binding

    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: features)
    got = fold._build_gemm()
    assert got == ((gemm_kernels.tokens_by_rows, *rule) if rule else False)


def test_a_gemm_that_miscomputes_warns_and_leaves_blas(monkeypatch):
    from llvmlite import binding

    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: {"avx2": True, "fma": True})
    monkeypatch.setattr(gemm_kernels, "tokens_by_rows", lambda T, Ap, out: out.fill(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fold._build_gemm() is False
    assert any("compiled GEMM is not used" in str(w.message) for w in caught)


@pytest.mark.parametrize("lanes, most", [(8, 512), (16, 64)])
@pytest.mark.parametrize("past", [False, True])
def test_blas_keeps_the_gemm_of_many_rows(rng, monkeypatch, lanes, most, past):
    seen = []
    monkeypatch.setattr(fold, "_gemm", (lambda *a: seen.append(1) or gemm_kernels.tokens_by_rows(*a), lanes, most))
    rows, own = most + past, not past
    A = rng.standard_normal((rows, 8)).astype(np.float32)
    T = rng.standard_normal((6, 8)).astype(np.float32)
    out = np.empty((6, rows), np.float32)
    fold.tokens_first_gemm(A)(T, out)
    assert bool(seen) == own
    np.testing.assert_allclose(out, T @ A.T, rtol=1e-5, atol=1e-5)


def test_shapes_that_disagree_are_refused(rng):
    T = rng.standard_normal((6, 8)).astype(np.float32)
    A = rng.standard_normal((20, 8)).astype(np.float32)
    for t, ap, out in ((T, gemm_kernels.pack(A[:, :7]), np.empty((6, 20), np.float32)),  # d
                       (T, gemm_kernels.pack(A[:16]), np.empty((6, 20), np.float32)),  # rows past the packed ones
                       (T, gemm_kernels.pack(A), np.empty((5, 20), np.float32)),  # tokens
                       (T, np.zeros((2, 8, 24), np.float32), np.empty((6, 20), np.float32))):  # not pack's
        with pytest.raises(ValueError):
            gemm_kernels.tokens_by_rows(t, ap, out)
    with pytest.raises(numba.core.errors.TypingError):  # an unpacked A, and a read-only out
        gemm_kernels.tokens_by_rows(T, A, np.empty((6, 20), np.float32))
    out = np.empty((6, 20), np.float32)
    out.setflags(write=False)
    with pytest.raises(numba.core.errors.TypingError):
        gemm_kernels.tokens_by_rows(T, gemm_kernels.pack(A), out)


def test_read_only_tokens(rng):
    T = rng.standard_normal((9, 40)).astype(np.float32)
    A = rng.standard_normal((21, 40)).astype(np.float32)
    want, _ = _run(T, A)
    T.setflags(write=False)
    got, _ = _run(T, A)
    np.testing.assert_array_equal(got, want)


def test_the_wrapper_keeps_blas_where_the_kernel_does_not_apply(rng, monkeypatch):
    """float64 rows, a strided or float64 output, and a block BLAS runs on its own threads: np.matmul."""
    seen = []
    monkeypatch.setattr(fold, "_gemm", (lambda *a: seen.append(1), 8, 512))
    A = rng.standard_normal((20, 32)).astype(np.float32)
    T = rng.standard_normal((50, 32)).astype(np.float32)
    for rows, out, blas_threads in ((A.astype(np.float64), np.empty((50, 20)), False),
                                    (A, np.empty((50, 40), np.float32)[:, ::2], False),
                                    (A, np.empty((50, 20)), False), (A, np.empty((50, 20), np.float32), True)):
        fold.tokens_first_gemm(rows, blas_threads)(T, out)
        np.testing.assert_allclose(out, T @ rows.T, rtol=1e-5, atol=1e-5)
    assert not seen


def test_the_first_call_builds_the_kernel_for_the_host(rng, monkeypatch, folding):
    """From nothing built: the rule's row for the host's features, checked against float64, then used by a
    whole call; a Numba that compiles for another CPU keeps BLAS."""
    from llvmlite import binding

    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: {"avx2": True, "fma": True})
    monkeypatch.setattr(fold, "_gemm", None)
    seen = []
    real = gemm_kernels.tokens_by_rows
    monkeypatch.setattr(gemm_kernels, "tokens_by_rows", lambda *a: seen.append(1) or real(*a))
    q = rng.standard_normal((1, 12, 16)).astype(np.float32)
    d = rng.standard_normal((30, 20, 16)).astype(np.float32)
    got = lik_cupy.maxsim(q, d, backend="cpu", return_argmax=True)
    assert fold._gemm[1:] == (8, 512) and seen
    monkeypatch.setattr(fold, "_gemm", False)
    for a, b in zip(got, lik_cupy.maxsim(q, d, backend="cpu", return_argmax=True), strict=True):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(fold, "_gemm", None)
    monkeypatch.setattr(fold, "_numba_config", lambda name: "generic" if name == "CPU_NAME" else None)
    fold.tokens_first_gemm(q[0])
    assert fold._gemm is False


@pytest.mark.parametrize("lanes", [8, 16])
def test_a_long_query_stays_within_block_bytes_with_the_kernel(rng, monkeypatch, folding, lanes):
    """With the kernel and its copy of the rows (padded to whole tiles), a query whose rows alone pass the
    bound, against short documents, stays within it as ``test_cpu_exact`` checks with BLAS, and gives
    BLAS's bits."""
    from test_cpu_exact import NUMPY_BUFFERS, _peak

    from lik_cupy import _cpu as cpu

    seen = []
    monkeypatch.setattr(fold, "_gemm", (lambda *a: seen.append(1) or gemm_kernels.tokens_by_rows(*a), lanes, 1 << 30))
    nq, lq, dim, block = 1, 3000, 128, 1 << 20
    q = rng.standard_normal((nq, lq, dim)).astype(np.float32)
    qv = np.ones((nq, lq), bool)
    lens = np.array([1, 0, 3, 2])
    tok = rng.standard_normal((int(lens.sum()), dim)).astype(np.float32)
    off = np.concatenate([[0], np.cumsum(lens)])

    def run(b):
        return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=b)
    run(block)
    outputs = nq * lens.size * (4 + lq * 4)
    assert _peak(lambda: run(block)) < outputs + nq * lq * 16 + block * 9 // 8 + NUMPY_BUFFERS
    assert seen, "the kernel did not run"
    monkeypatch.setattr(fold, "_gemm", False)
    for a, b in zip(run(block), run(1 << 30), strict=True):
        np.testing.assert_array_equal(a, b)
