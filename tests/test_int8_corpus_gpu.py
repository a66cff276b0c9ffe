"""INT8 corpora in retrieve on the GPU: device and host corpora against float64 and the CPU path
(skipped without a GPU)."""

import numpy as np
import pytest

import lik_cupy
from lik_cupy._cpu import quantize_numpy
from reference import maxsim_ref
from test_corpus_gpu import _pad, _ragged, _ranked
from test_forward_gpu import _cp, _np, _torch, _unit

pytestmark = pytest.mark.gpu

_STEP = 2.0**-7


@pytest.fixture(params=[True, False], ids=["wgmma", "portable"])
def kernels(request, monkeypatch):
    if not request.param:
        monkeypatch.setenv("LIK_DISABLE_WGMMA", "1")
    return request.param


def _exact(rng, *shape):
    """Integer tokens that quantize exactly: multiples of 32 in [-96, 96] (many ties) and one
    +-127 per token. Given as float ``x * 2**-7``, each token's scale is 2**-7 and its int8
    values are ``x``; every product, scaled similarity and score is then exact in float32
    in any order, so GPU rankings and scores compare exactly with float64."""
    x = rng.integers(-3, 4, size=shape) * 32
    pos = rng.integers(0, shape[-1], size=shape[:-1])
    np.put_along_axis(x, pos[..., None], rng.choice([-127, 127], size=shape[:-1])[..., None], axis=-1)
    return x


def test_exact_inputs_quantize_exactly(rng):
    x = _exact(rng, 50, 48)
    q8, s = quantize_numpy((x * _STEP).astype(np.float16))
    np.testing.assert_array_equal(q8, x)
    assert np.all(s == np.float32(_STEP))


@pytest.mark.parametrize("layout", ["padded", "packed", "shards", "host", "host_packed", "host_shards"])
def test_retrieve_int8_exact_ranking(rng, kernels, layout):
    dim, nd, nq, lq, k = 48, 613, 9, 13, 50
    lens = _ragged(rng, nd, 0, 90, empty_frac=0.1)
    ld = int(lens.max())
    x, dv = _pad(_exact(rng, int(lens.sum()), dim), lens)
    x, dv = x[:, :ld], dv[:, :ld]
    x[nd // 2], dv[nd // 2], lens[nd // 2] = x[nd // 3], dv[nd // 3], lens[nd // 3]  # duplicates: a tie by index
    off = np.concatenate([[0], np.cumsum(lens)])
    d8, ds = x.astype(np.int8), np.full((nd, ld), _STEP, np.float32)
    t8 = x[dv].astype(np.int8)
    ts = np.full(t8.shape[0], _STEP, np.float32)
    q = (_exact(rng, nq, lq, dim) * _STEP).astype(np.float16)  # float queries: quantized on the device
    qmask = rng.random((nq, lq)) < 0.85
    ref, _ = maxsim_ref(q, x * _STEP, qmask, dv)
    want_s, want_i = _ranked(ref.astype(np.float32), k)

    budget = 200_000  # forces many chunks for the host layouts
    cut = int(off[300])
    if layout == "padded":
        s, i = lik_cupy.retrieve(_cp(q), _cp(d8), k, _cp(qmask), d_lengths=_cp(lens), d_scales=_cp(ds))
    elif layout == "packed":
        s, i = lik_cupy.retrieve(_cp(q), _cp(t8), k, _cp(qmask), d_offsets=_cp(off), d_scales=_cp(ts))
    elif layout == "shards":
        s, i = lik_cupy.retrieve(_cp(q), [(_cp(t8[:cut]), _cp(off[:301]), _cp(ts[:cut])),
                                          (_cp(t8[cut:]), _cp(off[300:] - cut), _cp(ts[cut:]))], k, _cp(qmask))
    elif layout == "host":
        s, i = lik_cupy.retrieve(_cp(q), d8, k, _cp(qmask), d_mask=dv, d_scales=ds, max_gpu_bytes=budget)
    elif layout == "host_packed":
        s, i = lik_cupy.retrieve(_cp(q), t8, k, _cp(qmask), d_offsets=off, d_scales=ts, max_gpu_bytes=budget)
    else:  # int8 queries with their scales, from the host; NumPy results
        q8, qs = quantize_numpy(q)
        s, i = lik_cupy.retrieve(q8, [(t8[:cut], off[:301], ts[:cut]), (t8[cut:], off[300:] - cut, ts[cut:])], k,
                                 qmask, q_scales=qs, max_gpu_bytes=budget)
        assert isinstance(s, np.ndarray)
    s, i = _np(s), _np(i)
    assert i.dtype == np.int64 and s.dtype == np.float32 and s.shape == (nq, k)
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_array_equal(s, want_s)
    cs, ci = lik_cupy.retrieve(q, t8, k, qmask, d_offsets=off, d_scales=ts, backend="cpu")
    np.testing.assert_array_equal(ci, i)
    np.testing.assert_array_equal(cs, s)


@pytest.mark.parametrize("qdtype", ["float16", "bfloat16", "float32"])
def test_retrieve_int8_random_vs_cpu(rng, qdtype):
    """Unit-norm data quantized on the device; long queries (split over tiles), ragged documents.
    bfloat16 queries come as torch tensors (NumPy has no native bf16 array to hand to CuPy)."""
    import cupy
    import ml_dtypes

    dim, nd, nq, lq, k = 128, 1001, 7, 37, 64
    lens = _ragged(rng, nd, 0, 300)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok = _unit(rng, int(off[-1]), dim).astype(np.float16)
    t8, ts = lik_cupy.quantize_int8(_cp(tok))  # the device quantizer; the host one gives the same bytes
    h8, hs = quantize_numpy(tok)
    np.testing.assert_array_equal(_np(t8), h8)
    np.testing.assert_array_equal(_np(ts), hs)
    q = _unit(rng, nq, lq, dim).astype(ml_dtypes.bfloat16 if qdtype == "bfloat16" else qdtype)
    conv = _torch if qdtype == "bfloat16" else _cp
    qlen = rng.integers(0, lq + 1, size=nq)
    full = lik_cupy.maxsim_int8_varlen(q, h8, hs, off, q_lengths=qlen, backend="cpu")
    for D, kw in ((t8, dict(d_offsets=_cp(off), d_scales=ts)), (h8, dict(d_offsets=off, d_scales=hs, max_gpu_bytes=1 << 20))):
        s, i = lik_cupy.retrieve(conv(q), D, k, q_lengths=conv(qlen), **kw)
        s, i = _np(s), _np(i)
        cupy.cuda.Device().synchronize()
        # Float32 sums in another order: scores agree to rounding, and each returned document
        # holds, by the CPU's scores, the rank it was given (near-ties may swap places).
        got = np.take_along_axis(full, i, 1)
        np.testing.assert_allclose(s, got, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, _ranked(full, k)[0], rtol=1e-5, atol=1e-5)
        assert all(len(set(row)) == k for row in i.tolist())


def test_retrieve_int8_padded_shards_nan_query_and_checks(rng):
    import cupy

    dim = 32
    a8, a_s = quantize_numpy(_unit(rng, 40, 23, dim))
    b8, b_s = quantize_numpy(_unit(rng, 19, 6, dim))
    q = _unit(rng, 4, 11, dim).astype(np.float32)
    q[1, 5, 3] = np.nan  # query 1 scores NaN against every (non-empty) document
    corpus = [(_cp(a8), _cp(a_s)), (_cp(b8), _cp(b_s))]
    s, i = lik_cupy.retrieve(_cp(q), iter(corpus), 59)
    cs, ci = lik_cupy.retrieve(q, [(a8, a_s), (b8, b_s)], 59, backend="cpu")
    s, i = _np(s), _np(i)
    assert np.isnan(s[1]).all() and i[1].tolist() == list(range(59))
    keep = [0, 2, 3]
    np.testing.assert_allclose(s[keep], cs[keep], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="int8 scoring on the GPU needs dim a multiple of 16"):
        t8, ts = quantize_numpy(_unit(rng, 10, 24))
        lik_cupy.retrieve(_cp(q[:, :, :24]), _cp(t8), 3, d_offsets=_cp(np.array([0, 4, 10])), d_scales=_cp(ts))
    with pytest.raises(TypeError, match="shard 1 has dtype float32 but earlier shards are int8"):
        lik_cupy.retrieve(_cp(q), [corpus[0], _cp(_unit(rng, 5, 4, dim).astype(np.float32))], 3)
    with pytest.raises(TypeError, match=r"shard 0 scales is a numpy array but shard 0's tokens is a cupy array"):
        lik_cupy.retrieve(_cp(q), [(_cp(a8), a_s)], 3)
    cupy.cuda.Device().synchronize()


def test_auto_scores_a_host_int8_corpus_of_a_dim_the_gpu_lacks_on_the_cpu(rng):
    """Float host queries against a host INT8 corpus at d = 8 (the INT8 kernels take multiples of
    16): "auto" scores them on the CPU, as the CPU path does; "gpu" and a device Q refuse the dim."""
    import cupy

    q = rng.standard_normal((2, 3, 8)).astype(np.float32)
    d8, ds = quantize_numpy(rng.standard_normal((5, 4, 8)).astype(np.float32))
    want = lik_cupy.retrieve(q, d8, 3, d_scales=ds, backend="cpu")
    got = lik_cupy.retrieve(q, d8, 3, d_scales=ds)
    assert isinstance(got[0], np.ndarray)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    for args in ((q, "gpu"), (cupy.asarray(q), "auto")):
        with pytest.raises(ValueError, match=r"int8 scoring on the GPU needs dim a multiple of 16"):
            lik_cupy.retrieve(args[0], d8, 3, d_scales=ds, backend=args[1])

