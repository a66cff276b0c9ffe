"""INT8 quantisation and scoring on the CPU path: exact quantiser checks, scores against the
float64 MaxSim of the dequantised inputs, fidelity against the float inputs, validation."""

import warnings

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from reference import clustered, maxsim_ref, rel_err, spearman, topk_overlap

TOL = 2e-6


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _deq(q, s):
    return q.astype(np.float64) * s.astype(np.float64)[..., None]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_quantiser_round_trip_within_half_a_step(rng, dtype):
    x = (rng.standard_normal((7, 13, 100)) * rng.uniform(1e-3, 50, (7, 13, 1))).astype(dtype)
    x[2, 4] = 0  # padding token
    q, s = lik_cupy.quantize_int8(x)
    assert q.dtype == np.int8 and q.shape == x.shape and s.dtype == np.float32 and s.shape == x.shape[:-1]
    assert q.min() >= -127 and q.max() <= 127
    x32 = x.astype(np.float32)
    assert np.array_equal(s, np.abs(x32).max(-1) / np.float32(127))  # scale = max|x| / 127 exactly
    assert np.array_equal(np.abs(q).max(-1)[s > 0], np.full(int((s > 0).sum()), 127))  # the largest maps to 127
    err = np.abs(x32.astype(np.float64) - _deq(q, s))
    assert np.all(err <= s[..., None].astype(np.float64) * (0.5 + 1e-5))  # + float32 rounding of x / scale
    assert s[2, 4] == 0 and not q[2, 4].any()
    back = lik_cupy.dequantize_int8(q, s)
    assert back.dtype == np.float32 and np.array_equal(back, q.astype(np.float32) * s[..., None])


def test_quantiser_rejects_nan_and_inf():
    x = np.ones((3, 4, 16), np.float32)
    x[1, 2, 5] = np.nan
    with pytest.raises(ValueError, match=r"token \(1, 2\)"):
        lik_cupy.quantize_int8(x)
    x[1, 2, 5] = -np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        lik_cupy.quantize_int8(x)
    with pytest.raises(TypeError, match="dtype int32"):
        lik_cupy.quantize_int8(np.ones((2, 16), np.int32))


@pytest.mark.parametrize("quantize", ["quantize_int8", "quantize_fp8"])
def test_float64_beyond_float32_is_named_as_such(quantize):
    x = np.ones((3, 4, 16))
    x[1, 2, 5] = -1e300  # finite, but inf once scaled in float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no overflow warning from the cast on the way
        with pytest.raises(ValueError, match=r"beyond float32's range .* in token \(1, 2\)"):
            getattr(lik_cupy, quantize)(x, backend="cpu")


@pytest.mark.parametrize("quantize", ["quantize_int8", "quantize_fp8"])
def test_quantiser_temporaries_stay_bounded_for_wide_tokens(quantize):
    """The quantisers work in float32 blocks of a bounded number of values, not of tokens: blocks of
    65,536 tokens whatever their dim made a [1024, 16384] float16 input (32 MiB) hold 128 MiB (INT8)
    or 160 MiB (FP8) of temporaries, and one of 65,536 such tokens 8 GiB or more."""
    import tracemalloc

    x = np.ones((1024, 16384), np.float16)
    f = getattr(lik_cupy, quantize)
    f(x[:2], backend="cpu")  # (imports made before measuring)
    tracemalloc.start()
    try:
        q, s = f(x, backend="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.all(np.asarray(q).view(np.uint8) == q.view(np.uint8).flat[0])
    # a block's float32 copy and one float32 temporary (8 bytes a value), 32 MiB of values a block
    assert peak - q.nbytes - np.asarray(s).nbytes < 8 * (32 << 20) // 4 + (256 << 10), peak


def test_dequantize_checks_its_arguments():
    q = np.zeros((3, 16), np.int8)
    with pytest.raises(TypeError, match="expected int8"):
        lik_cupy.dequantize_int8(q.astype(np.int16), np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"scales has shape \[4\]; expected \[3\]"):
        lik_cupy.dequantize_int8(q, np.ones(4, np.float32))
    with pytest.raises(TypeError, match="scales is required"):
        lik_cupy.dequantize_int8(q, None)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_dequantize_holds_no_second_copy_of_its_result(rng, kind):
    """The float32 result is written once: its values looked up, then scaled in place (a product
    into a new array held a second result-sized temporary, 4 bytes per 1-byte code)."""
    import tracemalloc

    q, s = getattr(lik_cupy, f"quantize_{kind}")(rng.standard_normal((4096, 256)).astype(np.float32), backend="cpu")
    dequantize = getattr(lik_cupy, f"dequantize_{kind}")
    dequantize(q[:2], s[:2], backend="cpu")  # (imports and lookup tables made before measuring)
    tracemalloc.start()
    try:
        back = dequantize(q, s, backend="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(back, q.astype(np.float32) * s[..., None])
    assert peak < back.nbytes + (256 << 10), (peak, back.nbytes)


@pytest.mark.parametrize("dim", [16, 33, 128])
def test_scores_match_float64_of_dequantised(rng, dim):
    nq, lq, nd, ld = 3, int(rng.integers(1, 40)), 19, int(rng.integers(1, 60))
    q8, qs = lik_cupy.quantize_int8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_int8(_unit(rng, nd, ld, dim))
    q_mask = rng.random((nq, lq)) < 0.8
    d_len = rng.integers(0, ld + 1, nd)
    d_len[3] = 0
    s, a = lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs, q_mask=q_mask, d_lengths=d_len, return_argmax=True,
                                backend="cpu")
    dv = np.arange(ld)[None, :] < d_len[:, None]
    ref, sim = maxsim_ref(_deq(q8, qs), _deq(d8, ds), q_mask, dv)
    assert rel_err(s, ref) < TOL
    assert np.all(a[:, 3] == -1) and np.all(a[~np.broadcast_to(q_mask[:, None, :], a.shape)] == -1)
    i, j, t = np.nonzero(a >= 0)
    chosen = sim[i, j, t, a[i, j, t]]
    assert np.all(dv[j, a[i, j, t]]) and np.allclose(chosen, sim[i, j, t].max(-1), rtol=1e-6, atol=1e-9)


def test_float_queries_quantised_on_the_fly_equal_prequantised(rng):
    q = _unit(rng, 2, 21, 64).astype(np.float16)
    d8, ds = lik_cupy.quantize_int8(_unit(rng, 9, 30, 64))
    q8, qs = lik_cupy.quantize_int8(q)
    assert np.array_equal(lik_cupy.maxsim_int8(q, d8, ds, backend="cpu"),
                          lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs, backend="cpu"))


def test_packed_equals_padded(rng):
    dim, lens = 48, np.array([5, 0, 17, 1, 40, 0, 9])
    off = np.concatenate([[0], np.cumsum(lens)])
    t8, ts = lik_cupy.quantize_int8(_unit(rng, int(off[-1]), dim))
    pad8 = np.zeros((lens.size, lens.max(), dim), np.int8)
    pads = np.zeros((lens.size, lens.max()), np.float32)
    for j, n in enumerate(lens):
        pad8[j, :n], pads[j, :n] = t8[off[j]:off[j + 1]], ts[off[j]:off[j + 1]]
    q = _unit(rng, 3, 11, dim).astype(np.float32)
    a = lik_cupy.maxsim_int8_varlen(q, t8, ts, off, return_argmax=True, backend="cpu")
    b = lik_cupy.maxsim_int8(q, pad8, pads, d_lengths=lens, return_argmax=True, backend="cpu")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert np.all(np.isneginf(a[0][:, lens == 0]))


@pytest.mark.parametrize("kind", ["unit", "clustered"])
def test_fidelity_against_float_scores(kind):
    # The bar: Spearman >= 0.999 and top-20 overlap >= 95% per query on average. The
    # bar is statistical (top-20 of 1500 close scores), so this test fixes its inputs; the
    # benchmark (bench/suites/bench_int8.py) reports it on fresh, larger samples and tighter clusters.
    rng = np.random.default_rng(2026)
    dim, nq, lq, nd, ld = 128, 16, 32, 1500, 48
    make = _unit if kind == "unit" else (lambda r, *s: clustered(r, s, centres=64, spread=0.1))
    q = make(rng, nq, lq, dim).astype(np.float32)
    d = make(rng, nd, ld, dim).astype(np.float32)
    exact = maxsim_ref(q, d)[0]
    d8, ds = lik_cupy.quantize_int8(d)
    got = lik_cupy.maxsim_int8(q, d8, ds, backend="cpu")
    rho = np.mean([spearman(got[i], exact[i]) for i in range(nq)])
    overlap = np.mean([topk_overlap(got[i], exact[i], 20) for i in range(nq)])
    assert rho >= 0.999 and overlap >= 0.95, (kind, rho, overlap)


def test_validation_messages():
    q = np.zeros((2, 5, 32), np.float32)
    d8 = np.zeros((3, 7, 32), np.int8)
    ds = np.ones((3, 7), np.float32)
    with pytest.raises(TypeError, match="D has dtype float32; expected int8"):
        lik_cupy.maxsim_int8(q, d8.astype(np.float32), ds)
    with pytest.raises(TypeError, match="q_scales is required"):
        lik_cupy.maxsim_int8(q.astype(np.int8), d8, ds)
    with pytest.raises(ValueError, match="q_scales goes with an int8 Q"):
        lik_cupy.maxsim_int8(q, d8, ds, q_scales=np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"d_scales has shape \[3\]; expected \[3, 7\]"):
        lik_cupy.maxsim_int8(q, d8, ds[:, 0])
    with pytest.raises(TypeError, match="d_scales is required"):
        lik_cupy.maxsim_int8(q, d8, None)
    with pytest.raises(ValueError, match="D has dim 16 but Q has dim 32"):
        lik_cupy.maxsim_int8(q, d8[..., :16], ds)
    neg = lik_cupy.maxsim_int8(q.astype(np.int8), d8, ds, q_scales=np.full((2, 5), -1, np.float32), backend="cpu")
    assert np.all(np.isnan(neg))  # negative query scales: NaN, as in the kernel
    with pytest.raises(ValueError, match=r"d_scales has shape \[7\]; expected \[9\]"):
        lik_cupy.maxsim_int8_varlen(q, np.zeros((9, 32), np.int8), np.ones(7, np.float32), np.array([0, 4, 9]))


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3fn"])
def test_document_scale_errors_name_the_entry_as_passed(rng, kind):
    """A bad host document scale is named by its index in d_scales as passed: candidate sets
    [Nq, K, Ld] were named by their row of [Nq * K, Ld], one document's [Ld] as [1, Ld] and one
    scale for all of D ([]) as d_scales[0, 0]."""
    quantize = lik_cupy.quantize_int8 if kind == "int8" else lik_cupy.quantize_fp8
    maxsim = lik_cupy.maxsim_int8 if kind == "int8" else lik_cupy.maxsim_fp8
    q = rng.standard_normal((2, 5, 32)).astype(np.float32)
    d8, ds = quantize(rng.standard_normal((2, 3, 7, 32)).astype(np.float32))
    ds[1, 2, 4] = -1  # candidate sets
    with pytest.raises(ValueError, match=r"^d_scales\[1, 2, 4\] is -1.0; the scale of a valid token"):
        maxsim(q, d8, ds, backend="cpu")
    one = ds[0, 0].copy()
    one[3] = np.nan  # one document [Ld, d]
    with pytest.raises(ValueError, match=r"^d_scales\[3\] is nan; the scale of a valid token"):
        maxsim(q, d8[0, 0], one, backend="cpu")
    for bad in (-1.0, np.inf):  # one scale for all of D
        with pytest.raises(ValueError, match=rf"^d_scales \(one for all of D\) is {bad!r}; the scale of a valid token"):
            maxsim(q, d8[0], np.asarray(bad, np.float32), backend="cpu")
    assert np.all(np.isneginf(maxsim(q, d8[0], np.asarray(-1, np.float32), d_lengths=np.zeros(3, np.int64),
                                     backend="cpu")))  # no valid token: never read
